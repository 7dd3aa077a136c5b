"""Global average and max pooling of spatial blocks, without gathering the volume.

A classification or regression head on ``GlobalAveragePooling2D/3D`` (ResNet,
CosmoFlow-like encoders) needs no
:class:`~tfhybrid.layers.spatial.SpatialGather` at the end of the spatial
region of ``s``/``ds``: a gather would make every rank all-gather the whole
feature map (p blocks) and keep it, and its gradient, for the backward pass,
so a rank would hold p times its block at the region's end and send p - 1
blocks per step. The mean over the volume is the sum of the blocks' sums
divided by the volume's voxel count, so each rank sums its block and one
all-reduce of ``(batch, channels + 1)`` numbers (the sums and the block's
voxel count) gives every rank the whole volume's mean:
:class:`SpatialGlobalAveragePooling2D` / :class:`SpatialGlobalAveragePooling3D`.

The output is replicated (the same on every rank of the spatial group), as
a gather's would be; the layers after it run unchanged. Backward, the gradient
of a replicated output is the same on every rank and passes to the block's
sums unchanged (:func:`tfhybrid.comm.reduce`): each voxel of the block gets
``dy / count``, as in ``keras.layers.GlobalAveragePooling*`` on the whole
volume. Values equal Keras' up to float32 rounding (the same terms summed in
another order).

:class:`SpatialGlobalMaxPooling2D` / :class:`SpatialGlobalMaxPooling3D` take
each block's maximum and all-gather those ``(batch, channels)`` maxima;
backward, as TensorFlow's ``reduce_max``, the gradient goes to every voxel
equal to the maximum, divided by the number of such voxels in the whole
volume (each block counts its own, one all-reduce sums the counts): equal to
Keras' ``GlobalMaxPooling*`` on the whole volume bit for bit.
"""
from __future__ import annotations

import keras
import tensorflow as tf

from tfhybrid.comm import backend, reduce as reduce_over, resolve_group
from tfhybrid.layers.no_xla import NoXLA
from tfhybrid.layers.partitioned import collective_base, deserialize_group, serialize_group

_PACKAGE = "tfhybrid"


class _SpatialGlobalPool(NoXLA):
    """What the average and max poolings share: the spatial group, channels-last
    blocks, config and conversion from and to the Keras layer (``keepdims`` as in
    Keras); subclasses define ``call``."""

    _keras_class = None

    def __init__(self, group="model", **kwargs):
        super().__init__(**kwargs)
        if self.data_format != "channels_last":
            raise ValueError(f"Layer '{self.name}': {type(self).__name__} pools channels-last "
                             f"blocks; received data_format={self.data_format!r}. Use "
                             "data_format='channels_last' (Keras' default).")
        self.group = deserialize_group(group)

    def get_config(self):
        return {**super().get_config(), "group": serialize_group(self.group)}

    @classmethod
    def from_layer(cls, layer, group="model", split=None):
        """The spatial counterpart of ``layer`` (same options and name); ``split``
        is accepted for the spatial builders and unused: every block of the
        group is pooled, whatever the block grid."""
        if not isinstance(layer, cls._keras_class):
            raise TypeError(f"{cls.__name__}.from_layer expects a keras.layers."
                            f"{cls._keras_class.__name__}; received {type(layer).__name__}.")
        return cls.from_config({**layer.get_config(), "group": serialize_group(group)})

    def to_layer(self):
        """The plain Keras layer with the same options (no weights)."""
        config = {k: v for k, v in self.get_config().items() if k != "group"}
        return self._keras_class.from_config(config)


class _SpatialGlobalAverage(_SpatialGlobalPool):
    """The average poolings: block sums and voxel count, one all-reduce."""

    def call(self, inputs):
        dtype = inputs.dtype
        work = tf.float32 if dtype in (tf.float16, tf.bfloat16) else dtype
        x = tf.cast(inputs, work)
        axes = list(range(1, len(x.shape) - 1))
        sums = tf.reduce_sum(x, axes)                                   # (batch, channels)
        count = tf.cast(tf.reduce_prod(tf.shape(x)[1:-1]), work)       # this block's voxels
        packed = tf.concat([sums, tf.fill([tf.shape(sums)[0], 1], count)], -1)
        total = reduce_over(packed, resolve_group(self.group), collective_base(self.name))
        mean = total[:, :-1] / tf.stop_gradient(total[:, -1:])
        if self.keepdims:
            mean = tf.reshape(mean, [-1] + [1] * len(axes) + [mean.shape[-1]])
        return tf.cast(mean, dtype)


@keras.saving.register_keras_serializable(package=_PACKAGE)
class SpatialGlobalAveragePooling2D(_SpatialGlobalAverage, keras.layers.GlobalAveragePooling2D):
    """``keras.layers.GlobalAveragePooling2D`` of an image split into blocks over
    ``group`` (``"model"`` under s/ds): the whole image's mean on every rank.

    Example:
        >>> x = SpatialGlobalAveragePooling2D(group="model")(blocks)   # (batch, channels)
    """

    _keras_class = keras.layers.GlobalAveragePooling2D


@keras.saving.register_keras_serializable(package=_PACKAGE)
class SpatialGlobalAveragePooling3D(_SpatialGlobalAverage, keras.layers.GlobalAveragePooling3D):
    """``keras.layers.GlobalAveragePooling3D`` of a volume split into blocks over
    ``group``: the whole volume's mean on every rank.

    Example:
        >>> x = SpatialGlobalAveragePooling3D(group="model")(blocks)   # (batch, channels)
    """

    _keras_class = keras.layers.GlobalAveragePooling3D


class _SpatialGlobalMax(_SpatialGlobalPool):
    """The max poolings: block maxima all-gathered, tie counts all-reduced backward."""

    def call(self, inputs):
        axes = list(range(1, len(inputs.shape) - 1))
        group = resolve_group(self.group)
        base = collective_base(self.name)
        kept = [-1] + [1] * len(axes) + [inputs.shape[-1]]

        @tf.custom_gradient
        def pooled(t):
            y = tf.reduce_max(t, axes)                                     # (batch, channels)
            if group.size > 1:
                every = backend.allgather(y[None], group.ranks, base + ".max")
                y = tf.reduce_max(every, 0)

            def grad(dy):
                # TensorFlow's reduce_max gradient: dy split evenly over the maxima
                hits = tf.cast(tf.equal(t, tf.reshape(y, kept)), dy.dtype)
                count = tf.reduce_sum(hits, axes)
                if group.size > 1:
                    count = backend.allreduce(count, group.ranks, base + ".ties")
                return hits / tf.reshape(count, kept) * tf.reshape(dy, kept)
            return y, grad

        out = pooled(inputs)
        return tf.reshape(out, kept) if self.keepdims else out


@keras.saving.register_keras_serializable(package=_PACKAGE)
class SpatialGlobalMaxPooling2D(_SpatialGlobalMax, keras.layers.GlobalMaxPooling2D):
    """``keras.layers.GlobalMaxPooling2D`` of an image split into blocks over
    ``group``: the whole image's maximum on every rank.

    Example:
        >>> x = SpatialGlobalMaxPooling2D(group="model")(blocks)   # (batch, channels)
    """

    _keras_class = keras.layers.GlobalMaxPooling2D


@keras.saving.register_keras_serializable(package=_PACKAGE)
class SpatialGlobalMaxPooling3D(_SpatialGlobalMax, keras.layers.GlobalMaxPooling3D):
    """``keras.layers.GlobalMaxPooling3D`` of a volume split into blocks over
    ``group``: the whole volume's maximum on every rank.

    Example:
        >>> x = SpatialGlobalMaxPooling3D(group="model")(blocks)   # (batch, channels)
    """

    _keras_class = keras.layers.GlobalMaxPooling3D


__all__ = ["SpatialGlobalAveragePooling2D", "SpatialGlobalAveragePooling3D",
           "SpatialGlobalMaxPooling2D", "SpatialGlobalMaxPooling3D"]
