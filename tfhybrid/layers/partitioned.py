"""Shared machinery of the filter- and channel-parallel layers.

Owns what :mod:`tfhybrid.layers.parallel_dense` and
:mod:`tfhybrid.layers.parallel_conv` have in common: the layout vocabulary
of their inputs and outputs, the group argument (its validation and
serialization), the kernel/bias options of the Keras layer they replace,
and the two partitioning schemes as base classes:

* :class:`FilterParallel` (Megatron "column"): the kernel's *output* axis
  is split over the group; each rank computes its block of output
  units/filters from the full input.
* :class:`ChannelParallel` (Megatron "row"): the kernel's *input* axis is
  split; each rank computes a partial sum of the full output from its block
  of input channels.

Layouts (see :mod:`tfhybrid.comm.primitives` for R/S/P):

==============================  ======================================================
``"replicated"``                R tensor whose gradient is R (every rank holds it)
``"replicated_partial_grad"``   R tensor whose gradient is left / expected partial (P):
                                the producer (``batch_gather``, ``shard``,
                                :class:`~tfhybrid.layers.ModuloLayer`,
                                :class:`~tfhybrid.layers.ShardLayer`) sums it
``"split"``                     S(-1): this rank's block of the channel axis
``"partial"``                   P: the true tensor is the sum over the group
==============================  ======================================================

The concrete layers add the linear operation (matmul or convolution) through
three hooks: ``_kernel_shape(in_dim, out_dim)``, ``_linear(x, kernel)`` and
``_SOURCE`` (the Keras class they replace).
"""
from __future__ import annotations

import keras
import tensorflow as tf
from keras import activations, constraints, initializers, regularizers, ops

from tfhybrid import comm, errors
from tfhybrid._compat import module_aliases
from tfhybrid.comm import resolve_group
from tfhybrid.process_grid import Group
from tfhybrid.layers.no_xla import NoXLA
from tfhybrid.layout import VariableLayout, set_layout

IO_REPLICATED = "replicated"
IO_PARTIAL_GRAD = "replicated_partial_grad"
IO_SPLIT = "split"
IO_PARTIAL = "partial"

# Activations that mix the channel axis: wrong on a block or a partial sum.
_CHANNEL_MIXING = ("softmax", "log_softmax")
# Keys of a Keras Dense/Conv2D config that a parallel layer does not take.
_SOURCE_ONLY_KEYS = ("groups", "lora_rank", "lora_alpha", "quantization_config")
_OWN_KEYS = ("group", "input_layout", "output_layout")


# -- small helpers (also used by splitbrain.py and sync_bn.py) -----------------

def serialize_group(group):
    """A JSON-able form of a group argument ("model" or a :class:`Group`)."""
    if isinstance(group, Group):
        return {"name": group.name, "ranks": list(group.ranks), "index": group.index}
    return group


def deserialize_group(value):
    """Inverse of :func:`serialize_group`."""
    if isinstance(value, dict):
        return Group(value["name"], tuple(value["ranks"]), int(value["index"]))
    return value


def group_label(group) -> str:
    """The axis name of a group argument (for messages)."""
    return group.name if isinstance(group, Group) else str(group)


def layout_group(group):
    """The ``group`` of a :class:`VariableLayout`: the name, or the Group itself
    (sub-axis groups are sized by the optimizer from the Group object)."""
    return group if isinstance(group, Group) else str(group)


def collective_base(base: str) -> str:
    """A collective base name unique in the current graph, across name scopes.

    ``tfhybrid.comm`` makes names unique within the current name scope and
    Horovod then drops the scope, so a layer called twice in one graph (a
    shared layer, ModuloLayer's micro-steps, recomputation) would issue two
    collectives with the same Horovod name. Uniquifying the base at the
    graph's root scope avoids that; eagerly, collectives run one at a time
    and the base is returned unchanged.
    """
    if tf.executing_eagerly():
        return base
    graph = tf.compat.v1.get_default_graph()
    with graph.name_scope(None):
        return graph.unique_name(base, mark_as_used=True)


def check_choice(layer, arg, value, choices):
    """Raise ValueError unless ``value`` is one of ``choices``."""
    if value not in choices:
        raise errors.invalid_value(arg, value, tuple(choices), where=f"Layer '{layer}'")


def check_divisible(layer, what, n, k, group):
    """Raise ValueError unless ``k`` divides ``n`` (a size split over ``group``)."""
    if n is not None and n % k:
        raise errors.not_divisible(what, n, k, f"ranks of the '{group_label(group)}' group it "
                                   "is split over", where=f"Layer '{layer}'",
                                   fix=f"or a group size that divides {n}")


def scale_grad(x, factor):
    """Identity forward; multiplies the gradient by ``factor`` (a Python float)."""
    if factor == 1:
        return x

    @tf.custom_gradient
    def _scale(t):
        def grad(dy):
            out = dy * factor
            out.set_shape(t.shape)           # upstream slicing may lose static dims
            return out
        return tf.identity(t), grad

    return _scale(x)


def keep_grad_shape(x):
    """Identity whose gradient gets ``x``'s static shape back.

    The backward of an all-gather/reduce-scatter along a non-leading axis
    loses the static shape of that axis; Keras optimizers need it.
    """
    @tf.custom_gradient
    def _keep(t):
        def grad(dy):
            dy = tf.identity(dy)
            dy.set_shape(t.shape)
            return dy
        return tf.identity(t), grad

    return _keep(x)


def with_channels(full, block, k, axis=-1):
    """``full`` (gathered along ``axis`` from ``k`` blocks like ``block``) with its
    static shape restored: the all-gather runs along a transposed axis 0, which
    leaves the gathered axis unknown to TensorFlow's shape inference."""
    shape = block.shape.as_list()
    if shape[axis] is not None:
        shape[axis] *= k
    full.set_shape(shape)
    return full


def split_partial_grad(x, axis, group, name=None):
    """R -> S(axis) for a tensor whose gradient is expected partial (P).

    Forward keeps this rank's block (like :func:`tfhybrid.comm.split`);
    backward places the block's gradient in zeros, with no communication:
    the producer (a ``shard``/``batch_gather``) sums the partial gradients.
    """
    g = resolve_group(group)
    if g.size == 1:
        return tf.identity(x)
    x = tf.convert_to_tensor(x)
    axis %= x.shape.rank
    block = comm.split(tf.stop_gradient(x), axis, g, name)  # no backward collective

    @tf.custom_gradient
    def _split(t):
        def grad(dy):
            n = tf.shape(dy)[axis]
            pad = [[0, 0]] * t.shape.rank
            pad[axis] = [g.index * n, (g.size - 1 - g.index) * n]
            full = tf.pad(dy, pad)
            full.set_shape(t.shape)          # dynamic paddings lose the static shape
            return full
        return tf.identity(block), grad

    return _split(x)


# -- the base layer ---------------------------------------------------------------

class PartitionedLayer(NoXLA, keras.layers.Layer):
    """Base of the parallel Dense/Conv2D layers: options, weights, config.

    Subclasses set ``INPUT_LAYOUTS``/``OUTPUT_LAYOUTS`` and implement
    ``_out_dim`` (full units/filters), ``_kernel_shape``, ``_linear``,
    ``_source_input_shape`` and the class attribute ``_SOURCE``.
    """

    INPUT_LAYOUTS = ()
    OUTPUT_LAYOUTS = ()
    _SOURCE = None

    def __init__(self, activation=None, use_bias=True, kernel_initializer="glorot_uniform",
                 bias_initializer="zeros", kernel_regularizer=None, bias_regularizer=None,
                 activity_regularizer=None, kernel_constraint=None, bias_constraint=None,
                 group="model", input_layout=IO_REPLICATED, output_layout=IO_REPLICATED, **kwargs):
        super().__init__(activity_regularizer=activity_regularizer, **kwargs)
        self.activation = activations.get(activation)
        self.use_bias = bool(use_bias)
        self.kernel_initializer = initializers.get(kernel_initializer)
        self.bias_initializer = initializers.get(bias_initializer)
        self.kernel_regularizer = regularizers.get(kernel_regularizer)
        self.bias_regularizer = regularizers.get(bias_regularizer)
        self.kernel_constraint = constraints.get(kernel_constraint)
        self.bias_constraint = constraints.get(bias_constraint)
        self.group = deserialize_group(group)
        check_choice(self.name, "input_layout", input_layout, self.INPUT_LAYOUTS)
        check_choice(self.name, "output_layout", output_layout, self.OUTPUT_LAYOUTS)
        self.input_layout = input_layout
        self.output_layout = output_layout
        self.kernel = None
        self.bias = None

    # -- group ------------------------------------------------------------
    @property
    def comm_group(self) -> Group:
        """The :class:`tfhybrid.process_grid.Group` this layer is partitioned over."""
        return resolve_group(self.group)

    def _cname(self, what):
        return collective_base(f"{self.name}.{what}")

    def _activation_name(self):
        return getattr(self.activation, "__name__", str(self.activation))

    def _check_elementwise_activation(self, why):
        if self._activation_name() in _CHANNEL_MIXING:
            raise ValueError(
                f"Layer '{self.name}': activation={self._activation_name()!r} mixes the "
                f"channel axis and cannot be applied to {why}; use output_layout="
                f"'{IO_REPLICATED}' or apply the activation after the gather/reduce.")

    # -- weights ------------------------------------------------------------
    def _add_weights(self, kernel_shape, kernel_layout, bias_shape, bias_layout):
        self.kernel = self.add_weight(
            name="kernel", shape=kernel_shape, initializer=self.kernel_initializer,
            regularizer=self.kernel_regularizer, constraint=self.kernel_constraint)
        set_layout(self.kernel, kernel_layout)
        if self.use_bias:
            self.bias = self.add_weight(
                name="bias", shape=bias_shape, initializer=self.bias_initializer,
                regularizer=self.bias_regularizer, constraint=self.bias_constraint)
            set_layout(self.bias, bias_layout)

    def _sharded(self, axis):
        return VariableLayout("sharded", layout_group(self.group), axis=axis)

    # -- config -------------------------------------------------------------
    def get_config(self):
        config = super().get_config()
        config.update({
            "activation": activations.serialize(self.activation),
            "use_bias": self.use_bias,
            "kernel_initializer": initializers.serialize(self.kernel_initializer),
            "bias_initializer": initializers.serialize(self.bias_initializer),
            "kernel_regularizer": regularizers.serialize(self.kernel_regularizer),
            "bias_regularizer": regularizers.serialize(self.bias_regularizer),
            "kernel_constraint": constraints.serialize(self.kernel_constraint),
            "bias_constraint": constraints.serialize(self.bias_constraint),
            "group": serialize_group(self.group),
            "input_layout": self.input_layout,
            "output_layout": self.output_layout,
        })
        return config

    # -- conversion from / to the plain Keras layer ---------------------------
    @classmethod
    def from_layer(cls, layer, group="model", **layout_kwargs):
        """Build this rank's part of a built Keras layer, slicing its weights.

        Args:
            layer: A built ``keras.layers.Dense`` / ``Conv2D`` (the class this
                parallel layer replaces).
            group: Group the weights are partitioned over.
            **layout_kwargs: ``input_layout`` / ``output_layout``.

        Returns:
            A built parallel layer with the same name and options, holding
            this rank's block of ``layer``'s weights.

        Raises:
            TypeError: if ``layer`` is not a ``cls._SOURCE``.
            ValueError: if ``layer`` is not built, or its sizes do not split
                over the group.
        """
        cls._check_source(layer)
        config = {k: v for k, v in layer.get_config().items() if k not in _SOURCE_ONLY_KEYS}
        config["dtype"] = layer.dtype_policy          # cls(**config): keep ValueErrors
        new = cls(**{**config, "group": group, **layout_kwargs})
        full_in = layer.kernel.shape[-2]
        new.build(new._source_input_shape(new._local_in_dim(full_in)))
        new._load_full_weights(layer.kernel, layer.bias if layer.use_bias else None)
        return new

    @classmethod
    def _check_source(cls, layer):
        if not isinstance(layer, cls._SOURCE):
            raise TypeError(f"{cls.__name__}.from_layer expects a keras.layers."
                            f"{cls._SOURCE.__name__}; received {type(layer).__name__} "
                            f"'{getattr(layer, 'name', layer)}'.")
        if not layer.built or getattr(layer, "kernel", None) is None:
            raise ValueError(
                f"{cls.__name__}.from_layer: layer '{layer.name}' is not built, so it has "
                "no weights to slice. Build it first (call it on an input or "
                "`layer.build(input_shape)`).")
        groups = getattr(layer, "groups", 1)
        if groups != 1:
            raise ValueError(f"{cls.__name__}.from_layer: layer '{layer.name}' has groups="
                             f"{groups}; only groups=1 convolutions can be partitioned.")

    def to_layer(self):
        """Gather the full weights into a plain Keras layer (collective).

        Every rank of the group must call it (it all-gathers the kernel
        blocks). The result has this layer's name and options.

        Returns:
            A built ``keras.layers.Dense`` / ``Conv2D`` with the full weights.
        """
        config = {k: v for k, v in self.get_config().items() if k not in _OWN_KEYS}
        layer = self._SOURCE.from_config(config)
        kernel, bias = self._full_weights()
        layer.build(self._source_input_shape(kernel.shape[-2]))
        layer.set_weights([kernel] + ([bias] if self.use_bias else []))
        return layer

    def _gather_weight(self, variable, axis, what):
        g = self.comm_group
        value = tf.convert_to_tensor(variable)
        return comm.gather(value, axis % value.shape.rank, g, self._cname(what)).numpy()


class FilterParallel(PartitionedLayer):
    """Output axis split: kernel ``(..., in, out/K)``, bias ``(out/K,)``.

    Input: ``"replicated"`` (wrapped in :func:`tfhybrid.comm.copy`, so the
    input gradient is all-reduced to R) or ``"replicated_partial_grad"``
    (no copy: the input gradient is left P for a producer that reduce-scatters
    it, such as ``ModuloLayer``/``ShardLayer``). Output: ``"replicated"``
    (:func:`~tfhybrid.comm.gather`: consumers are replicated),
    ``"replicated_partial_grad"`` (:func:`~tfhybrid.comm.shard`: consumers
    are partitioned) or ``"split"`` (own block, S(-1), for a following
    channel-parallel layer).
    """

    INPUT_LAYOUTS = (IO_REPLICATED, IO_PARTIAL_GRAD)
    OUTPUT_LAYOUTS = (IO_REPLICATED, IO_PARTIAL_GRAD, IO_SPLIT)

    def _init_partition(self):
        check_divisible(self.name, self._OUT_ARG, self._out_dim(), self.comm_group.size, self.group)
        if self.output_layout == IO_SPLIT:
            self._check_elementwise_activation("a block of the output channels")

    def _local_in_dim(self, full_in):
        return full_in

    def build(self, input_shape):
        k = self.comm_group.size
        in_dim = input_shape[-1]
        out = self._out_dim() // k
        self._add_weights(self._kernel_shape(in_dim, out), self._sharded(-1), (out,),
                          self._sharded(-1))
        self.built = True

    def call(self, inputs):
        g = self.comm_group
        x = inputs
        if self.input_layout == IO_REPLICATED:
            x = comm.copy(x, g, self._cname("copy"))
        y = self._linear(x, self.kernel)
        if self.use_bias:
            y = ops.add(y, self.bias)
        if self.output_layout == IO_REPLICATED:
            y = keep_grad_shape(y)
            y = with_channels(comm.gather(y, -1, g, self._cname("gather")), y, g.size)
        elif self.output_layout == IO_PARTIAL_GRAD:
            y = keep_grad_shape(y)
            y = with_channels(comm.shard(y, -1, g, self._cname("shard")), y, g.size)
        return self.activation(y)

    def _out_channels(self):
        k = 1 if self.output_layout != IO_SPLIT else self.comm_group.size
        return self._out_dim() // k

    def _load_full_weights(self, kernel, bias):
        g = self.comm_group
        self.kernel.assign(comm.split(tf.convert_to_tensor(kernel), -1, g, self._cname("load")))
        if bias is not None:
            self.bias.assign(comm.split(tf.convert_to_tensor(bias), 0, g, self._cname("load")))

    def _full_weights(self):
        kernel = self._gather_weight(self.kernel, -1, "kernel")
        bias = self._gather_weight(self.bias, 0, "bias") if self.use_bias else None
        return kernel, bias


class ChannelParallel(PartitionedLayer):
    """Input axis split: kernel ``(..., in/K, out)``, bias ``(out,)``.

    Input: ``"replicated"`` (:func:`tfhybrid.comm.split`, gradient
    all-gathered to R), ``"replicated_partial_grad"`` (split whose gradient
    is left P, no communication) or ``"split"`` (already S(-1), e.g. from a
    filter-parallel layer with ``output_layout="split"``). Output:
    ``"replicated"`` (:func:`~tfhybrid.comm.reduce`, then bias and
    activation) or ``"partial"`` (P: the bias is added on group index 0 only,
    so the sum over the group is exact; the bias is then tagged ``partial``
    so the optimizer sums its gradient over the group; no activation).
    """

    INPUT_LAYOUTS = (IO_REPLICATED, IO_PARTIAL_GRAD, IO_SPLIT)
    OUTPUT_LAYOUTS = (IO_REPLICATED, IO_PARTIAL)

    def _init_partition(self):
        if self.output_layout == IO_PARTIAL and self._activation_name() != "linear":
            raise ValueError(
                f"Layer '{self.name}': output_layout='partial' leaves the output as a "
                f"partial sum, to which activation={self._activation_name()!r} cannot be "
                "applied; use activation=None or output_layout='replicated'.")

    def _local_in_dim(self, full_in):
        if self.input_layout == IO_SPLIT:
            check_divisible(self.name, "input channels", full_in, self.comm_group.size,
                            self.group)
            return full_in // self.comm_group.size
        return full_in

    def build(self, input_shape):
        k = self.comm_group.size
        in_dim = input_shape[-1]
        if self.input_layout != IO_SPLIT:
            check_divisible(self.name, "input channels", in_dim, k, self.group)
            in_dim //= k
        bias_kind = "partial" if self.output_layout == IO_PARTIAL else "replicated"
        bias_layout = VariableLayout(bias_kind, layout_group(self.group))
        self._add_weights(self._kernel_shape(in_dim, self._out_dim()), self._sharded(-2),
                          (self._out_dim(),), bias_layout)
        self.built = True

    def call(self, inputs):
        g = self.comm_group
        x = inputs
        if self.input_layout == IO_REPLICATED:
            x = comm.split(keep_grad_shape(x), -1, g, self._cname("split"))
        elif self.input_layout == IO_PARTIAL_GRAD:
            x = split_partial_grad(x, -1, g, self._cname("split"))
        y = self._linear(x, self.kernel)
        if self.output_layout == IO_REPLICATED:
            y = comm.reduce(y, g, self._cname("reduce"))
            if self.use_bias:
                y = ops.add(y, self.bias)
            return self.activation(y)
        if self.use_bias:
            y = ops.add(y, self.bias * (1.0 if g.index == 0 else 0.0))
        return y

    def _out_channels(self):
        return self._out_dim()

    def _load_full_weights(self, kernel, bias):
        g = self.comm_group
        self.kernel.assign(comm.split(tf.convert_to_tensor(kernel), -2, g, self._cname("load")))
        if bias is not None:
            self.bias.assign(bias)

    def _full_weights(self):
        kernel = self._gather_weight(self.kernel, -2, "kernel")
        bias = self.bias.numpy() if self.use_bias else None
        return kernel, bias


__getattr__ = module_aliases(__name__, globals(), {
    "REPLICATED": "IO_REPLICATED", "PARTIAL_GRAD": "IO_PARTIAL_GRAD", "SPLIT": "IO_SPLIT",
    "PARTIAL": "IO_PARTIAL"})
