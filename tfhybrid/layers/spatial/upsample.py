"""Spatially parallel bilinear up-sampling (``UpSampling2D(interpolation="bilinear")``).

Nearest-neighbour up-sampling of a block is the block of the up-sampled
tensor and runs on blocks unchanged. Bilinear up-sampling (TensorFlow's
half-pixel centres: output row ``i`` reads input rows ``floor(c)`` and
``floor(c) + 1`` with ``c = (i + 0.5) / f - 0.5``, clamped at the border)
needs one row from each neighbour: the first output rows of a block read the
previous block's last row, the last ones the next block's first row. This
layer exchanges that one-row halo along each split axis (corners included:
the second axis's exchange carries the first's halo rows), repeats the edge
row at the global border (what the clamp does), up-samples the extended
block with the same Keras op and keeps the middle ``f x n`` rows. Outputs
and gradients equal ``keras.layers.UpSampling2D`` on the whole input, block
by block (exactly for factors that are powers of two; for other factors the
interpolation weights, computed from other row numbers, differ by float32
rounding). No weights.
"""
from __future__ import annotations

import keras
import tensorflow as tf

from tfhybrid import comm
from tfhybrid.layers.spatial import core

# interpolations whose border clamp equals a repeated edge row, and their halo rows
HALO_ROWS = {"nearest": 0, "bilinear": 1}


@keras.saving.register_keras_serializable(package="tfhybrid")
class SpatialUpSampling2D(core.SpatialMixin, keras.layers.UpSampling2D):
    """Bilinear (or nearest) up-sampling of an NHWC input split into blocks over a
    group of ranks.

    Equals ``keras.layers.UpSampling2D`` on the full input, block by block.

    Args:
        size, interpolation, **kwargs: as ``keras.layers.UpSampling2D``
            (channels_last; interpolation ``"bilinear"`` or ``"nearest"``).
        split: "height", "width" or a block grid ``(ph, pw)``.
        group: Group the blocks are split over.

    Raises:
        ValueError: for another interpolation (``bicubic``, ``lanczos3/5``
            weigh the global border differently from a repeated edge row) or
            data format.

    Example:
        >>> up = SpatialUpSampling2D(2, interpolation="bilinear", split="height")
        >>> y = up(x_block)     # (batch, H/k, W, C) -> (batch, 2H/k, 2W, C)
    """

    _ndim = 2
    _keras_class = keras.layers.UpSampling2D

    def __init__(self, size=(2, 2), interpolation="bilinear", split=None, group="model",
                 **kwargs):
        super().__init__(size=size, interpolation=interpolation, **kwargs)
        if self.data_format != "channels_last":
            raise ValueError(f"{self._label()}: only data_format='channels_last' is supported; "
                             f"received data_format={self.data_format!r}.")
        if self.interpolation not in HALO_ROWS:
            raise ValueError(
                f"{self._label()}: Received interpolation={self.interpolation!r}; spatial "
                f"up-sampling supports {sorted(HALO_ROWS)} (the others weigh the image "
                "border differently from a repeated edge row). transform() gathers the "
                "blocks before such a layer.")
        self._init_spatial(self._default_split if split is None else split, group)

    def call(self, inputs):
        halo = HALO_ROWS[self.interpolation]
        groups = self._spatial_groups()
        x, crops = inputs, []
        for d, g in enumerate(groups):
            axis = d + 1
            if not halo or g.size == 1:
                crops.append(0)
                continue
            ext = comm.halo_exchange(x, axis, halo, halo, g, name=f"{self.name}.halo.ax{axis}")
            # the global border: the edge row repeated (the resize's clamp), not zeros
            n = ext.shape[axis] - 2 * halo
            if g.index == 0:
                ext = tf.concat([_rows(ext, axis, halo, halo), _rows(ext, axis, halo, n + halo)],
                                axis)
            if g.index == g.size - 1:
                ext = tf.concat([_rows(ext, axis, 0, n + halo),
                                 _rows(ext, axis, n + halo - 1, halo)], axis)
            x = ext
            crops.append(halo * self.size[d])
        y = self._resize_images(x, self.size[0], self.size[1], "channels_last",
                                interpolation=self.interpolation)
        for d, crop in enumerate(crops):
            if crop:
                y = _rows(y, d + 1, crop, y.shape[d + 1] - 2 * crop)
        return y


def _rows(t, axis, start, count):
    begin = [0] * t.shape.rank
    size = [-1] * t.shape.rank
    begin[axis], size[axis] = start, count
    return tf.slice(t, begin, size)
