"""Spatially parallel pooling: max and average pooling, 2-D and 3-D.

The input is this rank's block of a tensor split over a group of ranks (as
for :class:`tfhybrid.layers.SpatialConv2D`); where pooling windows straddle
two blocks, the missing rows are exchanged with the neighbours first. The
global border is padded the way TensorFlow pads ``same`` pooling: for max
pooling the padding never wins (``-inf``), for average pooling padded
positions are excluded from the mean (each window is divided by its count
of real elements). Pooling layers have no weights.
"""
from __future__ import annotations

import keras
import numpy as np
from keras import ops

from tfhybrid.layers.spatial import core
from tfhybrid.spatial_geometry import window_output


class _SpatialPool(core.SpatialMixin):
    """Shared implementation of the spatial pooling layers."""

    _takes_overlap = True
    _default_split = "height"
    _mode = "max"

    def __init__(self, pool_size=2, strides=None, padding="valid", split=None, group="model",
                 overlap=None, border_padding=None, **kwargs):
        super().__init__(pool_size=pool_size, strides=strides, padding=padding, **kwargs)
        if self.data_format != "channels_last":
            raise ValueError(f"{self._label()}: only data_format='channels_last' is supported; "
                             f"received data_format={self.data_format!r}.")
        if str(self.padding).lower() not in ("valid", "same"):
            raise ValueError(f"{self._label()}: Received an invalid value for `padding`: "
                             f"{self.padding!r}; expected 'valid' or 'same'.")
        self.padding = self.padding.lower()
        self._init_spatial(self._default_split if split is None else split, group, overlap)
        self._init_border_padding(border_padding)

    def call(self, inputs):
        plans = core.window_plans(self, inputs.shape, self.pool_size, self.strides,
                                  self._plan_padding())
        if self._mode == "max":   # a folded ZeroPadding's zeros can win: they are data
            pad_value = float("-inf") if self.border_padding is None else 0.0
            op = self._max_op
        else:
            pad_value, op = 0.0, lambda x, ranges: self._average_op(x, ranges, plans)
        overlap = self._overlap_now()
        return core.windowed(inputs, plans, self._spatial_groups(), op, pad_value,
                             f"{self.name}.halo", overlap)

    def _max_op(self, x, _ranges):
        return ops.max_pool(x, self.pool_size, self.strides, "valid", "channels_last")

    def _average_op(self, x, ranges, plans):
        mean = ops.average_pool(x, self.pool_size, self.strides, "valid", "channels_last")
        if self.border_padding is not None:   # a folded ZeroPadding's zeros count in the mean
            return mean
        scale = _window_scale(plans, ranges, self.pool_size)
        return mean if scale is None else mean * ops.cast(scale, mean.dtype)

    def compute_output_shape(self, input_shape):
        return core.output_block_shape(self, input_shape, self.pool_size, self.strides,
                                       self._plan_padding(), input_shape[-1])


def _window_scale(plans, ranges, pool_size):
    """window size / real elements per window, or None when no window is padded.

    The count of a window is separable: the product over axes of the real
    rows its extent covers along that axis.
    """
    scale = np.ones([1] * (len(plans) + 2), np.float64)
    padded = False
    for d, (plan, (p, q)) in enumerate(zip(plans, ranges)):
        g = plan.geometry
        pad_lo = window_output(g.size, g.window, g.stride, g.padding)[1]
        first = (plan.index * g.out_block + np.arange(p, q)) * g.stride - pad_lo
        count = np.minimum(first + g.window, g.size) - np.maximum(first, 0)
        padded = padded or bool((count != pool_size[d]).any())
        shape = [1] * (len(plans) + 2)
        shape[d + 1] = q - p
        scale = scale * (pool_size[d] / count).reshape(shape)
    return scale.astype(np.float32) if padded else None


@keras.saving.register_keras_serializable(package="tfhybrid")
class SpatialMaxPooling2D(_SpatialPool, keras.layers.MaxPooling2D):
    """Max pooling of an NHWC input split into blocks over a group of ranks.

    Equals ``keras.layers.MaxPooling2D`` on the full input, block by block.

    Args:
        pool_size, strides, padding, **kwargs: as ``keras.layers.MaxPooling2D``
            (channels_last only).
        split: "height", "width" or a block grid ``(ph, pw)``.
        group: Group the blocks are split over.
        overlap: Overlap the halo exchange with interior pooling in a graph
            (None: only when a GPU is visible).

    Raises:
        ValueError: when the global size or the pooled size does not split
            over the grid (with the nearest valid sizes).

    Example:
        >>> pool = SpatialMaxPooling2D(3, strides=2, padding="same", split="height")
        >>> y = pool(x_block)     # (batch, H/k, W, C) -> (batch, H/2/k, W/2, C)
    """

    _ndim, _mode = 2, "max"
    _keras_class = keras.layers.MaxPooling2D


@keras.saving.register_keras_serializable(package="tfhybrid")
class SpatialAveragePooling2D(_SpatialPool, keras.layers.AveragePooling2D):
    """Average pooling of an NHWC input split into blocks over a group of ranks.

    Equals ``keras.layers.AveragePooling2D`` on the full input, including
    ``same`` padding, where padded positions do not count in the mean.

    Args:
        pool_size, strides, padding, **kwargs: as
            ``keras.layers.AveragePooling2D`` (channels_last only).
        split: "height", "width" or a block grid ``(ph, pw)``.
        group: Group the blocks are split over.
        overlap: Overlap the halo exchange with interior pooling in a graph
            (None: only when a GPU is visible).

    Raises:
        ValueError: as :class:`SpatialMaxPooling2D`.

    Example:
        >>> pool = SpatialAveragePooling2D(2, split=(2, 2))
        >>> y = pool(x_block)
    """

    _ndim, _mode = 2, "average"
    _keras_class = keras.layers.AveragePooling2D


@keras.saving.register_keras_serializable(package="tfhybrid")
class SpatialMaxPooling3D(_SpatialPool, keras.layers.MaxPooling3D):
    """Max pooling of an NDHWC volume split into blocks over a group of ranks.

    Args:
        pool_size, strides, padding, **kwargs: as ``keras.layers.MaxPooling3D``.
        split: "depth", "height", "width" or a block grid ``(pd, ph, pw)``.
        group: Group the blocks are split over.
        overlap: Overlap the halo exchange with interior pooling in a graph
            (None: only when a GPU is visible).

    Raises:
        ValueError: as :class:`SpatialMaxPooling2D`.

    Example:
        >>> pool = SpatialMaxPooling3D(2, split="depth")
        >>> y = pool(x_block)     # (batch, D/k, H, W, C) -> (batch, D/2/k, H/2, W/2, C)
    """

    _ndim, _mode, _default_split = 3, "max", "depth"
    _keras_class = keras.layers.MaxPooling3D


@keras.saving.register_keras_serializable(package="tfhybrid")
class SpatialAveragePooling3D(_SpatialPool, keras.layers.AveragePooling3D):
    """Average pooling of an NDHWC volume split into blocks over a group of ranks.

    Args:
        pool_size, strides, padding, **kwargs: as
            ``keras.layers.AveragePooling3D``.
        split: "depth", "height", "width" or a block grid ``(pd, ph, pw)``.
        group: Group the blocks are split over.
        overlap: Overlap the halo exchange with interior pooling in a graph
            (None: only when a GPU is visible).

    Raises:
        ValueError: as :class:`SpatialMaxPooling2D`.

    Example:
        >>> pool = SpatialAveragePooling3D(2, split="depth")
        >>> y = pool(x_block)
    """

    _ndim, _mode, _default_split = 3, "average", "depth"
    _keras_class = keras.layers.AveragePooling3D
