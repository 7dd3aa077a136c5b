"""Synchronized batch normalization over any groups of the process grid.

:class:`SyncBatchNormalization` is ``keras.layers.BatchNormalization`` whose
training-time batch moments are those of the union of the local batches of
``groups`` (the data group, a spatial sub-grid, the world, or several
orthogonal groups at once), so small-batch and spatially split training
normalizes exactly as single-process batch norm on the full batch. Horovod's
own ``SyncBatchNormalization`` is Keras-2-only; this is the Keras 3 one.

The moments are computed in two passes for accuracy: an all-reduce of the
per-channel sums and counts gives the mean, a second all-reduce of the sums
of squared deviations gives the (biased, as in Keras) variance. Each
all-reduce is differentiable with an all-reduce (sum) as its backward: every
rank's local loss contributes to the moments' gradient, so each rank's
gradient w.r.t. its inputs is that of the sum of the ranks' losses.

Gamma/beta: each rank's gradient is its own rows' share of the loss
gradient. When the ranks of ``groups`` hold different examples (data
parallelism), that share is the gradient of the rank's own loss: the
weights are ``replicated`` (the optimizer averages over the world). When
some ranks hold different *spatial blocks of the same examples*, pass that
group as ``spatial_group``: the gamma/beta gradients are then partial sums
over it and are tagged ``partial`` over that group.
"""
from __future__ import annotations

import keras
import tensorflow as tf

from tfhybrid.comm import backend, resolve_group
from tfhybrid.layers.partitioned import (collective_base, deserialize_group, layout_group,
                                         serialize_group)
from tfhybrid.layers.no_xla import NoXLA
from tfhybrid.layout import VariableLayout, set_layout

_PACKAGE = "tfhybrid"


def allreduce_sum(x, group, name):
    """All-reduce (sum) whose backward is also an all-reduce (sum).

    Right for a value every rank feeds into its *own* loss: the gradient of
    the sum of the losses w.r.t. one rank's contribution sums all ranks'
    upstream gradients.
    """
    if group.size == 1:
        return x

    @tf.custom_gradient
    def _sum(t):
        def grad(dy):
            return backend.allreduce(dy, group.ranks, name + ".bwd")
        return backend.allreduce(t, group.ranks, name), grad

    return _sum(x)


def _sum_of_squares(inputs, centre, axes):
    """``reduce_sum(square(inputs - centre), axes)`` (``centre`` has no gradient)
    without keeping the full-size deviations for the backward pass.

    The backward recomputes ``inputs - centre`` once the incoming gradient
    exists and applies TensorFlow's own gradients of Square and Sum to it:
    the same values as differentiating the expression directly, but only
    ``inputs`` (which the normalisation keeps anyway) stays alive between
    the forward and the backward pass, not a second activation-sized tensor.
    """
    @tf.custom_gradient
    def run(x):
        out = tf.reduce_sum(tf.square(x - centre), axes)

        def grad(dy):
            with tf.control_dependencies([dy]):   # recompute late; no merging with the forward
                again = tf.identity(x) - centre
            with tf.GradientTape() as tape:
                tape.watch(again)
                y = tf.reduce_sum(tf.square(again), axes)
            return tape.gradient(y, again, output_gradients=dy)
        return out, grad

    return run(inputs)


def _input_shape(bn):
    """An input shape that builds a BatchNormalization like the built ``bn``."""
    shape = [None] * bn.input_spec.ndim
    shape[bn.axis] = bn.moving_mean.shape[0]
    return tuple(shape)


@keras.saving.register_keras_serializable(package=_PACKAGE)
class SyncBatchNormalization(NoXLA, keras.layers.BatchNormalization):
    """Batch normalization with moments reduced over process-grid groups.

    Same arguments and behaviour as ``keras.layers.BatchNormalization``
    (``axis``, ``momentum``, ``epsilon``, ``center``, ``scale``,
    initializers, regularizers, constraints, masks, renorm), except that in
    training the mean and variance are those of all the rows held by the
    ranks of ``groups``; the moving statistics are updated from them, so
    they are identical on those ranks. Inference uses the moving statistics.

    Args:
        groups: Names ("data", "model", "world") or
            :class:`tfhybrid.process_grid.Group` objects, or one of them. Several
            groups must be orthogonal (share only this rank), e.g.
            ``("data", "model")`` = the world; the moments are reduced over
            every rank reachable through them.
        spatial_group: Optional group (name or Group) whose ranks hold
            different spatial blocks of the same examples; gamma and beta are
            then tagged ``partial`` over it instead of ``replicated``.
        **kwargs: ``keras.layers.BatchNormalization`` arguments and base
            layer arguments (not ``synchronized``).

    Raises:
        ValueError: for an invalid group, overlapping groups, or
            ``synchronized=True``.

    Example:
        >>> tfhybrid.init(model_parallel=1)          # 4 data-parallel ranks
        >>> bn = SyncBatchNormalization(groups="data")
        >>> y = bn(x, training=True)   # normalized with the 4 ranks' batch moments
        >>> bn = SyncBatchNormalization.from_layer(keras_bn, groups=("world",))
    """

    def __init__(self, groups=("data",), spatial_group=None, **kwargs):
        if kwargs.get("synchronized"):
            raise ValueError("SyncBatchNormalization is already synchronized over "
                             "`groups`; received synchronized=True (tf.distribute "
                             "synchronization), which cannot be combined with it.")
        kwargs.pop("synchronized", None)
        super().__init__(**kwargs)
        if isinstance(groups, (str, dict)) or not hasattr(groups, "__iter__"):
            groups = (groups,)
        self.groups = tuple(deserialize_group(g) for g in groups)
        if not self.groups:
            raise ValueError(f"Layer '{self.name}': received groups=(); pass at least one "
                             "group, e.g. groups=('data',).")
        self.spatial_group = deserialize_group(spatial_group)

    def _resolved_groups(self):
        resolved = [resolve_group(g) for g in self.groups]
        for i, a in enumerate(resolved):
            for b in resolved[i + 1:]:
                shared = set(a.ranks) & set(b.ranks)
                if len(shared) > 1:
                    raise ValueError(
                        f"Layer '{self.name}': groups {a.name} {list(a.ranks)} and {b.name} "
                        f"{list(b.ranks)} share ranks {sorted(shared)}; the moments would "
                        "be counted twice. Pass orthogonal groups (e.g. ('data', 'model')) "
                        "or one group that covers them (e.g. 'world').")
        return resolved

    def build(self, input_shape):
        super().build(input_shape)
        kind = "replicated" if self.spatial_group is None else "partial"
        label = "model" if self.spatial_group is None else layout_group(self.spatial_group)
        for weight in (self.gamma, self.beta):
            if weight is not None:
                set_layout(weight, VariableLayout(kind, label))

    def _sum(self, x, what):
        for g in self._resolved_groups():
            x = allreduce_sum(x, g, collective_base(f"{self.name}.{what}.{g.name}"))
        return x

    def _moments(self, inputs, mask):
        axes = self._reduction_axes
        if mask is None:
            weighted = inputs
            count = tf.cast(tf.reduce_prod(tf.gather(tf.shape(inputs), axes)), inputs.dtype)
        else:
            weights = tf.broadcast_to(tf.cast(tf.expand_dims(mask, -1), inputs.dtype),
                                      tf.shape(inputs))
            weighted = inputs * weights
            count = tf.reduce_sum(weights, axes)[0]
        total = self._sum(tf.concat([tf.reduce_sum(weighted, axes), count[None]], 0), "sum")
        mean = total[:-1] / total[-1]
        centre = tf.reshape(tf.stop_gradient(mean), self._broadcast_shape(inputs))
        if mask is None:
            sumsq = _sum_of_squares(inputs, centre, axes)
        else:
            dev = (inputs - centre) * weights
            sumsq = tf.reduce_sum(tf.square(dev), axes)
        variance = self._sum(sumsq, "sumsq") / total[-1]
        return mean, variance

    def _broadcast_shape(self, inputs):
        shape = [1] * inputs.shape.rank
        shape[self.axis] = inputs.shape[self.axis]
        return shape

    def get_config(self):
        config = super().get_config()
        config.pop("synchronized", None)
        groups = [serialize_group(g) for g in self.groups]
        return {**config, "groups": groups,
                "spatial_group": serialize_group(self.spatial_group)}

    @classmethod
    def from_layer(cls, layer, groups=("data",), spatial_group=None):
        """A SyncBatchNormalization with ``layer``'s options and weights.

        Args:
            layer: A built ``keras.layers.BatchNormalization``.
            groups: See the class.
            spatial_group: See the class.

        Returns:
            A built SyncBatchNormalization with the same name and weights.

        Raises:
            TypeError: if ``layer`` is not a BatchNormalization.
            ValueError: if ``layer`` is not built.
        """
        if not isinstance(layer, keras.layers.BatchNormalization):
            raise TypeError("SyncBatchNormalization.from_layer expects a keras.layers."
                            f"BatchNormalization; received {type(layer).__name__}.")
        if not layer.built:
            raise ValueError(f"SyncBatchNormalization.from_layer: layer '{layer.name}' is not "
                             "built, so it has no weights to copy. Build it first.")
        config = {**layer.get_config(), "groups": [serialize_group(g) for g in (
            (groups,) if isinstance(groups, str) else groups)],
            "spatial_group": serialize_group(spatial_group)}
        new = cls.from_config(config)
        new.build(_input_shape(layer))
        new.set_weights(layer.get_weights())
        return new

    def to_layer(self):
        """A plain ``keras.layers.BatchNormalization`` with the same options and weights."""
        config = {k: v for k, v in self.get_config().items()
                  if k not in ("groups", "spatial_group")}
        layer = keras.layers.BatchNormalization.from_config(config)
        layer.build(_input_shape(self))
        layer.set_weights(self.get_weights())
        return layer


__all__ = ["SyncBatchNormalization"]
