"""Spatially parallel zero padding: ``SpatialZeroPadding2D``.

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
"""
from __future__ import annotations

import keras

from tfhybrid.layers import spatial_core as core
from tfhybrid.layers import spatial_plan as sp

_SPATIAL_KEYS = ("split", "group")


@keras.saving.register_keras_serializable(package="tfhybrid")
class SpatialZeroPadding2D(core.SpatialMixin, keras.layers.ZeroPadding2D):
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

    supports_jit = False
    _ndim = 2

    def __init__(self, padding=(1, 1), split="height", group="model", **kwargs):
        super().__init__(padding=padding, **kwargs)
        if self.data_format != "channels_last":
            raise ValueError(f"{self._label()}: only data_format='channels_last' is supported; "
                             f"received data_format={self.data_format!r}.")
        self._init_spatial(split, group)

    def build(self, input_shape):
        self._spatial_groups()  # collective: registers the block grid's groups
        super().build(input_shape)

    def _axis_plans(self, local_shape):
        """One validated :class:`AxisPlan` per spatial axis (cached per shape)."""
        key = tuple(local_shape[1:3])
        if key not in self._plans:
            dims = self._static_spatial(local_shape)
            plans = []
            for d, (n, g) in enumerate(zip(dims, self._spatial_groups())):
                lo, hi = (int(v) for v in self.padding[d])
                geom = sp.AxisGeometry(n * g.size, g.size, 1, 1, (lo, hi))
                if geom.problem():
                    raise ValueError(sp.axis_problem_message(
                        self._label(), self._global_shape(local_shape), self._grid_shape(),
                        sp.SPATIAL_AXES[2][d], geom))
                plans.append(sp.AxisPlan(geom, g.index))
            self._plans[key] = tuple(plans)
        return self._plans[key]

    def call(self, inputs):
        plans = self._axis_plans(inputs.shape)
        return core.windowed(inputs, plans, self._spatial_groups(), lambda x, _ranges: x, 0.0,
                             f"{self.name}.halo", False)

    def compute_output_shape(self, input_shape):
        input_shape = tuple(input_shape)
        if any(v is None for v in input_shape[1:3]):
            return super().compute_output_shape(input_shape)
        plans = self._axis_plans(input_shape)
        return (input_shape[0],) + tuple(p.geometry.out_block for p in plans) + \
            (input_shape[3],)

    def get_config(self):
        config = super().get_config()
        config.update({"split": self.split, "group": self.group})
        return config

    @classmethod
    def from_layer(cls, layer, split="height", group="model"):
        """A spatial copy of a ``keras.layers.ZeroPadding2D`` (same padding and name).

        Raises:
            TypeError: if ``layer`` is not a ``keras.layers.ZeroPadding2D``.
        """
        if not isinstance(layer, keras.layers.ZeroPadding2D):
            raise TypeError(f"{cls.__name__}.from_layer: Received layer={layer!r}; expected a "
                            "keras.layers.ZeroPadding2D.")
        config = {k: v for k, v in layer.get_config().items() if k not in _SPATIAL_KEYS}
        return cls.from_config({**config, "split": split, "group": group})


__all__ = ["SpatialZeroPadding2D"]
