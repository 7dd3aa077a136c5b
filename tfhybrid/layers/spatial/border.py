"""Spatially parallel borders: zero padding (``SpatialZeroPadding2D/3D``),
cropping (``SpatialCropping2D/3D``) and their shared re-blocking
(:class:`BorderReblocking`).

``keras.layers.ZeroPadding2D`` on a tensor split into blocks over a group
of ranks (as for :class:`tfhybrid.layers.SpatialConv2D`). Zeros are added
only at the global border: the rank holding the first rows pads the top,
the rank holding the last rows pads the bottom (likewise left/right along
width). The padded tensor is then re-blocked so that every rank again holds
an equal block of the *padded* tensor, which the spatial layers that follow
require. Re-blocking is the halo machinery of the sliding-window layers
with a window of one row, stride one and explicit padding ``(before,
after)``: a rank gives up or receives the rows by which the border padding
shifts the block boundaries (none for symmetric padding over two ranks,
e.g. ResNet-50's stem). Zero padding has no weights; the backward of the
halo exchange returns every row's gradient to the rank that owns the row.

Cropping is the same operation with negative border rows: the first rank
drops the top rows, the last rank the bottom rows, and the blocks are
re-blocked the same way. A rank receives from a neighbour the rows by which
the crop shifts the block boundaries (none for a symmetric crop over two
ranks); the gradient of a cropped row is zero and every kept row's gradient
returns to the rank that owns the row.
"""
from __future__ import annotations

import keras

from tfhybrid.layers.spatial import core
from tfhybrid import spatial_geometry as sp


class BorderReblocking(core.SpatialMixin):
    """Rows added (positive) or removed (negative) at the global border, then re-blocked.

    Subclasses also derive from the Keras layer they parallelise (which
    validates and stores its own arguments), set ``_ndim`` and
    ``_keras_class`` and implement :meth:`_border`.
    """

    _keras_class = None

    def _init_border(self, split, group):
        if self.data_format != "channels_last":
            raise ValueError(f"{self._label()}: only data_format='channels_last' is supported; "
                             f"received data_format={self.data_format!r}.")
        self._init_spatial(split, group)

    def _border(self):
        """Per spatial axis, rows (before, after) added at the global border."""
        raise NotImplementedError

    def build(self, input_shape):
        self._spatial_groups()  # collective: registers the block grid's groups
        super().build(input_shape)

    def _axis_plans(self, local_shape):
        """One validated :class:`AxisPlan` per spatial axis (cached per shape)."""
        key = tuple(local_shape[1:1 + self._ndim])
        if key not in self._plans:
            dims = self._static_spatial(local_shape)
            plans = []
            for d, (n, g) in enumerate(zip(dims, self._spatial_groups())):
                geom = sp.AxisGeometry(n * g.size, g.size, 1, 1, self._border()[d])
                if geom.problem():
                    raise ValueError(self._problem_message(local_shape, d, geom))
                plans.append(sp.AxisPlan(geom, g.index))
            self._plans[key] = tuple(plans)
        return self._plans[key]

    def _problem_message(self, local_shape, d, geom):
        """ValueError text for an axis whose border rows cannot be re-blocked."""
        axis, (lo, hi) = sp.SPATIAL_AXES[self._ndim][d], self._border()[d]
        if (lo + hi) % geom.parts == 0:   # sizes exist that split: name the nearest ones
            return sp.axis_problem_message(self._label(), self._global_shape(local_shape),
                                           self._grid_shape(), axis, geom)
        what = "padding" if lo + hi > 0 else "cropping"
        return (f"{self._label()}: the input of global shape "
                f"{self._global_shape(local_shape)} cannot be split over the "
                f"{'x'.join(map(str, self._grid_shape()))} grid along {axis}: {what} "
                f"({abs(lo)}, {abs(hi)}) rows changes its size {geom.size} to "
                f"{geom.out_size}, which does not split evenly over {geom.parts} ranks, nor "
                f"does it for any input size (the change, {lo + hi:+d} rows, is not a "
                f"multiple of {geom.parts}). Change the {what} along {axis}, the split or the "
                "number of ranks.")

    def call(self, inputs):
        plans = self._axis_plans(inputs.shape)
        return core.windowed(inputs, plans, self._spatial_groups(), lambda x, _ranges: x, 0.0,
                             f"{self.name}.halo", False)

    def compute_output_shape(self, input_shape):
        input_shape = tuple(input_shape)
        dims = input_shape[1:1 + self._ndim]
        if any(v is None for v in dims):   # call() needs static sizes; nothing to plan yet
            return (input_shape[0],) + (None,) * self._ndim + input_shape[1 + self._ndim:]
        plans = self._axis_plans(input_shape)
        return (input_shape[0],) + tuple(p.geometry.out_block for p in plans) + \
            input_shape[1 + self._ndim:]


def _rows(pairs):
    return tuple((int(lo), int(hi)) for lo, hi in pairs)


@keras.saving.register_keras_serializable(package="tfhybrid")
class SpatialZeroPadding2D(BorderReblocking, keras.layers.ZeroPadding2D):
    """Zero padding of an NHWC input split into blocks over a group of ranks.

    Equals ``keras.layers.ZeroPadding2D`` on the full input, block by block:
    concatenating the ranks' outputs gives the padded full tensor, split
    into equal blocks.

    Args:
        padding: As ``keras.layers.ZeroPadding2D``: an int, ``(rows, cols)``
            or ``((top, bottom), (left, right))``.
        split: "height", "width" or a block grid ``(ph, pw)``.
        group: Group the blocks are split over.
        **kwargs: Keras layer arguments (``name``, ``dtype``; channels_last
            only).

    Raises:
        ValueError: if the padded size of a split axis does not divide over
            its ranks, or the re-blocking needs more rows than a block holds
            (the message gives the nearest valid global sizes).

    Example:
        >>> pad = SpatialZeroPadding2D(3, split="height")   # on 2 ranks
        >>> y = pad(x_block)      # (B, 16, 32, C) -> (B, 19, 38, C): 3 rows on one side
    """

    _ndim = 2
    _keras_class = keras.layers.ZeroPadding2D

    def __init__(self, padding=(1, 1), split="height", group="model", **kwargs):
        super().__init__(padding=padding, **kwargs)
        self._init_border(split, group)

    def _border(self):
        return _rows(self.padding)


@keras.saving.register_keras_serializable(package="tfhybrid")
class SpatialZeroPadding3D(BorderReblocking, keras.layers.ZeroPadding3D):
    """Zero padding of an NDHWC input split into blocks over a group of ranks.

    The 3-D counterpart of :class:`SpatialZeroPadding2D` (volumes, as split
    by :class:`tfhybrid.layers.SpatialConv3D`).

    Args:
        padding: As ``keras.layers.ZeroPadding3D``: an int, a triple, or
            ``((d0, d1), (h0, h1), (w0, w1))``.
        split: "depth", "height", "width" or a block grid ``(pd, ph, pw)``.
        group: Group the blocks are split over.
        **kwargs: Keras layer arguments (``name``, ``dtype``; channels_last
            only).

    Raises:
        ValueError: as :class:`SpatialZeroPadding2D`.

    Example:
        >>> pad = SpatialZeroPadding3D(((2, 2), (0, 0), (0, 0)), split="depth")   # 2 ranks
        >>> y = pad(x_block)     # global (B, 12, 6, 6, C) -> (B, 16, 6, 6, C)
    """

    _ndim = 3
    _keras_class = keras.layers.ZeroPadding3D

    def __init__(self, padding=((1, 1), (1, 1), (1, 1)), split="depth", group="model",
                 **kwargs):
        super().__init__(padding=padding, **kwargs)
        self._init_border(split, group)

    def _border(self):
        return _rows(self.padding)


__all__ = ["BorderReblocking", "SpatialZeroPadding2D", "SpatialZeroPadding3D"]


# -- cropping: padding by a negative number of rows --------------------------------

def _negated(pairs):
    return tuple((-int(lo), -int(hi)) for lo, hi in pairs)


@keras.saving.register_keras_serializable(package="tfhybrid")
class SpatialCropping2D(BorderReblocking, keras.layers.Cropping2D):
    """Cropping of an NHWC input split into blocks over a group of ranks.

    Equals ``keras.layers.Cropping2D`` on the full input, block by block:
    concatenating the ranks' outputs gives the cropped full tensor, split
    into equal blocks (e.g. U-Net's crop of an encoder feature map before
    it joins the decoder).

    Args:
        cropping: As ``keras.layers.Cropping2D``: an int, ``(rows, cols)``
            or ``((top, bottom), (left, right))``.
        split: "height", "width" or a block grid ``(ph, pw)``.
        group: Group the blocks are split over.
        **kwargs: Keras layer arguments (``name``, ``dtype``; channels_last
            only).

    Raises:
        ValueError: if the cropped size of a split axis does not divide over
            its ranks, or the re-blocking needs more rows than a block holds
            (the message gives the nearest valid global sizes).

    Example:
        >>> crop = SpatialCropping2D(((3, 1), (2, 2)), split="height")   # on 2 ranks
        >>> y = crop(x_block)    # global (B, 20, 20, C) -> (B, 16, 16, C): (B, 8, 16, C) here
    """

    _ndim = 2
    _keras_class = keras.layers.Cropping2D

    def __init__(self, cropping=((0, 0), (0, 0)), split="height", group="model", **kwargs):
        super().__init__(cropping=cropping, **kwargs)
        self._init_border(split, group)

    def _border(self):
        return _negated(self.cropping)


@keras.saving.register_keras_serializable(package="tfhybrid")
class SpatialCropping3D(BorderReblocking, keras.layers.Cropping3D):
    """Cropping of an NDHWC input split into blocks over a group of ranks.

    The 3-D counterpart of :class:`SpatialCropping2D` (volumes, as split by
    :class:`tfhybrid.layers.SpatialConv3D`).

    Args:
        cropping: As ``keras.layers.Cropping3D``: an int, a triple, or
            ``((d0, d1), (h0, h1), (w0, w1))``.
        split: "depth", "height", "width" or a block grid ``(pd, ph, pw)``.
        group: Group the blocks are split over.
        **kwargs: Keras layer arguments (``name``, ``dtype``; channels_last
            only).

    Raises:
        ValueError: as :class:`SpatialCropping2D`.

    Example:
        >>> crop = SpatialCropping3D(((0, 0), (1, 1), (0, 0)), split="height")
        >>> y = crop(x_block)    # global (B, 8, 10, 8, C) -> (B, 8, 8, 8, C)
    """

    _ndim = 3
    _keras_class = keras.layers.Cropping3D

    def __init__(self, cropping=((1, 1), (1, 1), (1, 1)), split="depth", group="model",
                 **kwargs):
        super().__init__(cropping=cropping, **kwargs)
        self._init_border(split, group)

    def _border(self):
        return _negated(self.cropping)


__all__ = ["SpatialCropping2D", "SpatialCropping3D"]
