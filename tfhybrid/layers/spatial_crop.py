"""Spatially parallel cropping: ``SpatialCropping2D`` and ``SpatialCropping3D``.

``keras.layers.Cropping2D`` / ``Cropping3D`` on a tensor split into blocks
over a group of ranks (as for :class:`tfhybrid.layers.SpatialConv2D`).
Rows are removed only at the global border: the rank holding the first
rows drops the top crop, the rank holding the last rows the bottom crop
(likewise along every split axis). The cropped tensor is then re-blocked so
that every rank again holds an equal block of it, exactly as
:class:`tfhybrid.layers.SpatialZeroPadding2D` does after padding (cropping
is padding by a negative number of rows; both share
:class:`tfhybrid.layers.spatial_pad.BorderReblocking`). A rank receives
from a neighbour the rows by which the crop shifts the block boundaries
(none for a symmetric crop over two ranks). Cropping has no weights; the
gradient of a cropped row is zero and every kept row's gradient returns to
the rank that owns the row.
"""
from __future__ import annotations

import keras

from tfhybrid.layers.spatial_pad import BorderReblocking


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
