"""GroupNormalization on spatial blocks (U-Nets with group norm under s/ds).

Group normalisation normalises each sample over its voxels and the channels
of a group. On a spatial block the moments are those of the block only, so
:class:`SpatialGroupNormalization` sums, per sample and group, the block's
sum and sum of squared deviations (and voxel count) over the spatial group:
every rank then normalises with the moments of the whole volume, exactly as
``keras.layers.GroupNormalization`` on the full input. The backward of each
sum is a sum (every rank's loss depends on it); gamma and beta are partial
over the group (each block's share of their gradient).
"""
from __future__ import annotations

import keras
import tensorflow as tf

from tfhybrid.comm import resolve_group
from tfhybrid.layers.no_xla import NoXLA
from tfhybrid.layers.partitioned import (collective_base, deserialize_group, layout_group,
                                         serialize_group)
from tfhybrid.layers.sync_bn import allreduce_sum
from tfhybrid.layout import VariableLayout, set_layout

_PACKAGE = "tfhybrid"


@keras.saving.register_keras_serializable(package=_PACKAGE)
class SpatialGroupNormalization(NoXLA, keras.layers.GroupNormalization):
    """``keras.layers.GroupNormalization`` (channels last) on spatial blocks.

    Args:
        group: The spatial group whose ranks hold the blocks of each sample
            (``"model"`` under s/ds, or a :class:`tfhybrid.process_grid.Group`).
        **kwargs: GroupNormalization's arguments (``axis`` must be the last axis).

    Example:
        >>> gn = SpatialGroupNormalization.from_layer(keras_gn, group="model")
    """

    def __init__(self, group="model", **kwargs):
        super().__init__(**kwargs)
        self.group = deserialize_group(group)

    def build(self, input_shape):
        if self.axis not in (-1, len(input_shape) - 1):
            raise ValueError(f"Layer '{self.name}': SpatialGroupNormalization normalises "
                             f"channels-last blocks; received axis={self.axis} for input "
                             f"shape {tuple(input_shape)}. Use axis=-1.")
        super().build(input_shape)
        for weight in (self.gamma, self.beta):
            if weight is not None:
                set_layout(weight, VariableLayout("partial", layout_group(self.group)))

    def _apply_normalization(self, reshaped_inputs, input_shape):
        dtype = reshaped_inputs.dtype
        x = tf.cast(reshaped_inputs, tf.float32 if dtype in (tf.float16, tf.bfloat16)
                    else dtype)
        rank = len(x.shape)
        axes = [a for a in range(1, rank) if a != rank - 2]   # all but batch and group
        group = resolve_group(self.group)
        base = collective_base(self.name)
        count = tf.cast(tf.reduce_prod(tf.gather(tf.shape(x), axes)), x.dtype)
        total = allreduce_sum(tf.reduce_sum(x, axes, keepdims=True), group, base + ".sum")
        count = count * group.size      # equal blocks
        mean = total / count
        sumsq = tf.reduce_sum(tf.square(x - mean), axes, keepdims=True)
        variance = allreduce_sum(sumsq, group, base + ".sumsq") / count
        broadcast = self._create_broadcast_shape(input_shape)
        inv = tf.math.rsqrt(variance + self.epsilon)
        if self.scale:
            inv = inv * tf.cast(tf.reshape(self.gamma, broadcast), x.dtype)
        res = -mean * inv
        if self.center:
            res = res + tf.cast(tf.reshape(self.beta, broadcast), x.dtype)
        return tf.cast(x * inv + res, dtype)

    def get_config(self):
        return {**super().get_config(), "group": serialize_group(self.group)}

    @classmethod
    def from_layer(cls, layer, group="model", split=None):
        """A SpatialGroupNormalization with ``layer``'s options, name and weights
        (``split`` is accepted for the spatial builders and unused: the moments
        are summed over every block of the group)."""
        if not isinstance(layer, keras.layers.GroupNormalization):
            raise TypeError("SpatialGroupNormalization.from_layer expects a keras.layers."
                            f"GroupNormalization; received {type(layer).__name__}.")
        new = cls.from_config({**layer.get_config(), "group": serialize_group(group)})
        if layer.built:
            new.build(layer.input.shape)
            new.set_weights(layer.get_weights())
        return new

    def to_layer(self):
        """A plain ``keras.layers.GroupNormalization`` with the same options and weights."""
        config = {k: v for k, v in self.get_config().items() if k != "group"}
        layer = keras.layers.GroupNormalization.from_config(config)
        layer.build(self.input.shape)
        layer.set_weights(self.get_weights())
        return layer


__all__ = ["SpatialGroupNormalization"]
