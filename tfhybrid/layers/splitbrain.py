"""SplitBrain's boundary layers: ``ShardLayer`` (Ls), ``ModuloLayer`` (Lm) and its inverse.

A SplitBrain network is data parallel over all ranks up to a
:class:`ModuloLayer`, model parallel inside groups of K ranks (partitioned
FC layers joined by :class:`ShardLayer`) up to a
:class:`ModuloInverseLayer`, and data parallel again for the loss::

    conv (DP, own B rows) -> ModuloLayer -> FilterParallelDense ... -> ModuloInverseLayer -> loss

The three schemes of SplitBrain §3.1 (after Krizhevsky's "one weird trick")
move the group's K*B rows through the model-parallel region differently:
"BK" all-gathers them (one pass on K*B rows), "B" lets the K ranks take
turns broadcasting their B rows (K passes on B rows each) and "B/K" has every
rank contribute B/K rows per micro-step (K passes on B rows each). All three
compute the same function and the same gradients.

Gradient scale (the rule this module implements). The objective is the mean
loss over the global batch, ``J = 1/N sum_r L_r`` (N ranks, ``L_r`` the
mean loss of rank r's rows). Between the two boundary layers every rank of a
model group computes on the group's K*B rows, and the computation there is
the *replicated* computation of the group's mean loss ``J_g = 1/K sum_{r in
g} L_r``: :class:`ModuloInverseLayer` scales the gradient entering the model
parallel region by ``1/K`` and :class:`ModuloLayer` scales the gradient
leaving it by ``K``. Consequently

* every variable inside the region (sharded FC kernels, replicated biases,
  plain Keras layers) holds the gradient of ``J_g`` and needs
  ``grad_scale=1``: the optimizer's rules (sharded: average over the data
  group; replicated: average over the world; partial: sum over the group)
  then yield ``dJ/dw`` exactly;
* every rank below the ModuloLayer holds the gradient of its own ``L_r``,
  as in plain data parallelism.

SplitBrain instead divides the FC gradients by K; scaling at the two
boundaries is equivalent for the FC weights and also makes every other
variable inside the region correct without tagging it.

Gradient layouts at the boundaries: :class:`ModuloLayer` and
:class:`ShardLayer` produce R tensors whose gradient they expect partial (P)
by default (``comm.batch_gather``/``comm.shard``: reduce-scatter), so the
next layer must leave its input gradient partial:
``FilterParallelDense(input_layout="replicated_partial_grad")``,
``ChannelParallelDense(input_layout="replicated_partial_grad")``. With
``output_layout="replicated"`` they expect an R gradient instead (consumers
that are replicated or all-reduce their input gradient). The inverse expects
an R gradient by default (producers ``comm.gather``, ``comm.reduce``,
``FilterParallelDense(output_layout="replicated")``,
``ChannelParallelDense``); ``input_layout="replicated_partial_grad"`` for a
:class:`ShardLayer` producer.
"""
from __future__ import annotations

import keras
import tensorflow as tf

from tfhybrid import comm, errors
from tfhybrid.comm import resolve_group
from tfhybrid.comm.backend import zeros_reading
from tfhybrid.layers.no_xla import NoXLA
from tfhybrid.layers.partitioned import (IO_PARTIAL_GRAD, IO_REPLICATED, check_choice,
                                         collective_base, deserialize_group,
                                         keep_grad_shape, scale_grad,
                                         serialize_group, split_partial_grad, with_channels)

_PACKAGE = "tfhybrid"
SCHEMES = ("BK", "B", "B/K")
_WITH_BODY = ("B", "B/K")   # schemes that run the region several times: body required


def _times(n, k):
    return None if n is None else n * k


class _GroupLayer(NoXLA, keras.layers.Layer):
    """A weightless layer acting over ``group``."""

    def __init__(self, group="model", **kwargs):
        super().__init__(**kwargs)
        self.group = deserialize_group(group)

    @property
    def comm_group(self):
        """The :class:`tfhybrid.process_grid.Group` of this layer."""
        return resolve_group(self.group)

    def get_config(self):
        return {**super().get_config(), "group": serialize_group(self.group)}


@keras.saving.register_keras_serializable(package=_PACKAGE)
class ShardLayer(_GroupLayer):
    """SplitBrain's shard layer Ls: S(axis) -> R between partitioned layers.

    Forward all-gathers the blocks along ``axis``; backward reduce-scatters
    (sums) the gradient, which must be partial: the consumer is a
    partitioned layer with ``input_layout="replicated_partial_grad"``. (For
    replicated consumers use ``FilterParallelDense(output_layout="replicated")``
    or ``comm.gather``.)

    Args:
        axis: The split axis (default the feature axis, -1).
        group: The group the tensor is split over.
        **kwargs: Base layer arguments.

    Example:
        >>> h = FilterParallelDense(64, output_layout="split")(x)
        >>> h = ShardLayer()(h)                 # full 64 features on every rank
        >>> y = FilterParallelDense(32, input_layout="replicated_partial_grad")(h)
    """

    def __init__(self, axis=-1, group="model", **kwargs):
        super().__init__(group=group, **kwargs)
        if isinstance(axis, bool) or not isinstance(axis, int):
            raise ValueError(f"Layer '{self.name}': received an invalid value for `axis`, "
                             f"expected an integer. Received: axis={axis!r}")
        self.axis = axis

    def call(self, inputs):
        g = self.comm_group
        full = comm.shard(keep_grad_shape(inputs), self.axis, g,
                          collective_base(f"{self.name}.shard"))
        return with_channels(full, inputs, g.size, self.axis)

    def compute_output_shape(self, input_shape):
        shape = list(input_shape)
        shape[self.axis] = _times(shape[self.axis], self.comm_group.size)
        return tuple(shape)

    def get_config(self):
        return {**super().get_config(), "axis": self.axis}


def _enter(x, g, output_layout, name):
    """Own rows -> the group's rows (R); gradient scaled by K (see module doc)."""
    x, name = scale_grad(x, float(g.size)), collective_base(name)
    if output_layout == IO_PARTIAL_GRAD:
        return comm.batch_gather(x, g, name)
    return comm.gather(x, 0, g, name)


def _leave(y, g, input_layout, name):
    """The group's rows (R) -> own rows; gradient scaled by 1/K (see module doc).

    When ``y`` is a softmax/sigmoid output carrying Keras' ``_keras_logits``
    (which Keras' crossentropy losses use instead of the clipped
    probabilities), the logits' own rows are carried along, so the loss of
    the transformed model is the original's even where a probability falls
    below Keras' epsilon (1e-7).
    """
    out = _own_rows(y, g, input_layout, name)
    logits = getattr(y, "_keras_logits", None)
    if logits is not None:
        _attach_logits(out, _own_rows(logits, g, input_layout, f"{name}.logits"))
    return out


def _own_rows(y, g, input_layout, name):
    name, rows = collective_base(name), y.shape[0]
    if input_layout == IO_PARTIAL_GRAD:
        out = split_partial_grad(y, 0, g, name)
    else:
        out = comm.batch_scatter(y, g, name)
    # comm slices a dynamic batch with dynamic offsets, which loses every static
    # dimension; restore them (Keras losses and optimizers need the static shape).
    out.set_shape([None if rows is None else rows // g.size] + y.shape[1:].as_list())
    return scale_grad(out, 1.0 / g.size)


def _attach_logits(y, logits):
    """``y._keras_logits = logits`` (as keras.activations.softmax does)."""
    try:
        y._keras_logits = logits
    except AttributeError:  # a C-type tensor (as Keras itself tolerates)
        pass


def _stack_logits(y):
    """``y`` and, when it carries them, its Keras logits, stacked along a new axis 0.

    One tensor, so ``tf.recompute_grad`` (which drops Python attributes)
    returns both. (The backward then also runs the unused half's collective,
    on zeros: one extra all-gather of the output's size per micro-step.)
    """
    logits = getattr(y, "_keras_logits", None)
    return tf.stack([y] if logits is None else [y, logits])


@keras.saving.register_keras_serializable(package=_PACKAGE)
class ModuloLayer(_GroupLayer):
    """SplitBrain's modulo layer Lm: the data -> model parallel boundary.

    Each rank brings its B local rows; the K ranks of ``group`` then run the
    model-parallel layers that follow on the group's rows.

    * ``scheme="BK"`` without ``body``: all-gathers the group's K local
      batches (``comm.batch_gather``): the output has K*B rows, identical on
      the group's ranks. Pair it with a :class:`ModuloInverseLayer` before
      the loss.
    * ``scheme="B/K"`` (``body`` required): K micro-steps; in micro-step k
      every rank contributes its k-th chunk of B/K rows, ``body`` (the
      model-parallel sub-network) runs on the gathered B rows, and each rank
      keeps the rows of its own chunk. Each micro-step is recomputed in the
      backward pass (gradient checkpointing), so the region holds the
      activations of B rows at a time instead of K*B, and the gradients of
      ``body``'s weights are accumulated over the K micro-steps: exactly the
      synchronous gradient of the whole batch. The output is this rank's B
      rows (the inverse is built in).
    * ``scheme="B"`` (``body`` required): K rounds; in round k, rank k of
      the group broadcasts its B rows (:func:`tfhybrid.comm.broadcast`),
      every rank runs ``body`` on them with its shard of the weights, and
      rank k keeps the B output rows. Backward per round: the gradient of
      the round's outputs is broadcast from rank k
      (:func:`tfhybrid.comm.to_root`; none with
      ``inverse_input_layout="replicated_partial_grad"``), ``body``
      back-propagates, and the input gradient is summed to rank k (the
      adjoint of the broadcast; rank k's own with
      ``output_layout="replicated"``). Same rows, FLOPs and bytes received
      as "BK" (K*B rows), with the region's activations of B rows at a
      time when ``recompute`` (default), and no divisibility condition on
      the local batch.
    * ``scheme="BK"`` with ``body``: gather, ``body``, own rows, in one step.

    The gradient that leaves the layer is multiplied by K (and the inverse's
    by 1/K); weights inside the region need no ``grad_scale`` (module doc).

    Args:
        scheme: ``"BK"``, ``"B"`` or ``"B/K"``.
        group: The model group (default "model").
        body: Keras layer/model of the model-parallel region (maps R rows to
            R rows); required for ``"B"`` and ``"B/K"``.
        output_layout: Layout of the gradient expected at the gathered
            output: ``"replicated_partial_grad"`` (default; the consumer is a
            partitioned layer leaving its input gradient partial,
            reduce-scattered here) or ``"replicated"`` (the consumer's input
            gradient is R; this rank's rows are kept).
        inverse_input_layout: With ``body``: layout of the gradient at
            ``body``'s output (see :class:`ModuloInverseLayer`).
        recompute: ``"B"`` and ``"B/K"``: recompute each round/micro-step in
            the backward pass (default True; False keeps K*B rows of
            activations).
        **kwargs: Base layer arguments.

    Raises:
        ValueError: for an unknown scheme/layout, ``"B"``/``"B/K"`` without ``body``,
            or (``"B/K"``) a local batch not divisible by K.

    Example:
        >>> tfhybrid.init(model_parallel=2)
        >>> h = ModuloLayer("BK")(features)       # 2*B rows on both ranks
        >>> h = FilterParallelDense(10, input_layout="replicated_partial_grad")(h)
        >>> logits = ModuloInverseLayer()(h)      # own B rows again
        >>> mp = keras.Sequential([FilterParallelDense(64, activation="relu",
        ...      input_layout="replicated_partial_grad"), ChannelParallelDense(10)])
        >>> logits = ModuloLayer("B/K", body=mp)(features)   # memory of B rows
        >>> logits = ModuloLayer("B", body=mp)(features)     # K broadcast rounds
    """

    def __init__(self, scheme="BK", group="model", body=None,
                 output_layout=IO_PARTIAL_GRAD, inverse_input_layout=IO_REPLICATED,
                 recompute=True, **kwargs):
        super().__init__(group=group, **kwargs)
        check_choice(self.name, "scheme", scheme, SCHEMES)
        check_choice(self.name, "output_layout", output_layout, (IO_PARTIAL_GRAD, IO_REPLICATED))
        check_choice(self.name, "inverse_input_layout", inverse_input_layout,
                     (IO_REPLICATED, IO_PARTIAL_GRAD))
        if isinstance(body, dict):
            body = keras.saving.deserialize_keras_object(body)
        if scheme in _WITH_BODY and body is None:
            raise ValueError(
                f"Layer '{self.name}': scheme={scheme!r} runs the model-parallel region K "
                "times, so it needs that region: pass body=<the layers between the "
                "ModuloLayer and the loss> (a keras Layer or Model), or use scheme='BK'.")
        self.scheme = scheme
        self.body = body
        self.output_layout = output_layout
        self.inverse_input_layout = inverse_input_layout
        self.recompute = bool(recompute)

    def build(self, input_shape):
        if self.body is not None and not self.body.built:
            self.body.build(self._region_shape(input_shape))
        self.built = True

    def _region_shape(self, input_shape):
        k = self.comm_group.size
        b = input_shape[0]
        rows = _times(b, k) if self.scheme == "BK" else b
        return (rows,) + tuple(input_shape[1:])

    def call(self, inputs, training=None):
        g = self.comm_group
        if self.body is None:
            return _enter(inputs, g, self.output_layout, f"{self.name}.gather")
        if self.scheme == "BK":
            return self._step(inputs, training, 0)
        if self.scheme == "B":
            return self._rounds(inputs, training)
        return self._micro_steps(inputs, training)

    def _step(self, chunk, training, k):
        g = self.comm_group
        h = _enter(chunk, g, self.output_layout, f"{self.name}.gather{k}")
        h = self.body(h, training=training)
        return _leave(h, g, self.inverse_input_layout, f"{self.name}.scatter{k}")

    def _micro_steps(self, inputs, training):
        k = self.comm_group.size
        b = inputs.shape[0]
        if b is not None and b % k:
            raise errors.not_divisible("local batch", b, k, "ranks of the model group (K)",
                                       where=f"Layer '{self.name}': scheme='B/K' needs a "
                                       "local batch divisible by K", fix="or scheme='BK'")
        if b is None:
            tf.debugging.assert_equal(tf.shape(inputs)[0] % k, 0, message=(
                f"Layer '{self.name}': scheme='B/K' needs a local batch divisible by {k}"))
        parts = []
        for i, chunk in enumerate(tf.split(inputs, k, axis=0)):
            step = lambda c, i=i: _stack_logits(self._step(c, training, i))  # noqa: E731
            if self.recompute and k > 1:
                step = tf.recompute_grad(step)
            parts.append(step(chunk))
        out = tf.concat([p[0] for p in parts], axis=0)
        if parts[0].shape[0] == 2:   # the body's output carried Keras logits (see _leave)
            _attach_logits(out, tf.concat([p[1] for p in parts], axis=0))
        return out

    def _round(self, x, training, root):
        """Round ``root`` of scheme "B": rank ``root``'s rows through ``body`` (R)."""
        g = self.comm_group
        h = comm.broadcast(x, root, g, collective_base(f"{self.name}.bcast{root}"),
                           partial_grad=self.output_layout == IO_PARTIAL_GRAD)
        y = self.body(h, training=training)
        if self.inverse_input_layout == IO_PARTIAL_GRAD:
            return _stack_logits(y)      # P gradient: rank root's, zeros elsewhere
        logits = getattr(y, "_keras_logits", None)
        y = comm.to_root(y, root, g, collective_base(f"{self.name}.root{root}"))
        if logits is not None:
            _attach_logits(y, comm.to_root(logits, root, g,
                                           collective_base(f"{self.name}.root{root}.logits")))
        return _stack_logits(y)

    def _rounds(self, inputs, training):
        """Scheme "B": K broadcast rounds; this rank keeps the outputs of its own."""
        g = self.comm_group
        k = g.size
        x = scale_grad(inputs, float(k))
        rounds = []
        for root in range(k):
            step = lambda c, root=root: self._round(c, training, root)  # noqa: E731
            if self.recompute and k > 1:
                step = tf.recompute_grad(step)
            # round k reads (a zero of) round k-1's output: the rounds run one after
            # the other, forward and backward, in the same order on every rank
            chained = x if not rounds else x + tf.reduce_sum(zeros_reading(rounds[-1]))
            rounds.append(step(chained))
        mine = scale_grad(_pick(rounds, g.index), 1.0 / k)
        out = mine[0]
        if mine.shape[0] == 2:   # the body's output carried Keras logits (see _leave)
            _attach_logits(out, mine[1])
        return out

    def compute_output_shape(self, input_shape):
        if self.body is None:
            k = self.comm_group.size
            return (_times(input_shape[0], k),) + tuple(input_shape[1:])
        out = self.body.compute_output_shape(self._region_shape(input_shape))
        return (input_shape[0],) + tuple(out[1:])

    def get_config(self):
        body = None if self.body is None else keras.saving.serialize_keras_object(self.body)
        return {**super().get_config(), "scheme": self.scheme, "body": body,
                "output_layout": self.output_layout,
                "inverse_input_layout": self.inverse_input_layout,
                "recompute": self.recompute}


def _pick(tensors, index):
    """``tensors[index]``; the others get a zero gradient (not none), so the
    backward of every round runs, and with it the round's collectives.

    The same operations on every rank (only the constant ``index`` and the
    masks differ): the gradient tape back-propagates the rounds in an order
    that follows the graph's structure, and the collectives inside the
    rounds (named in the order they are traced) must pair up across ranks.
    """
    if len(tensors) == 1:
        return tf.identity(tensors[0])

    @tf.custom_gradient
    def _select(*ts):
        def grad(dy):
            zeros = zeros_reading(dy)      # not folded away: every round's backward runs
            return [tf.where(tf.constant(i == index), dy, zeros) for i in range(len(ts))]
        return tf.gather(tf.stack(ts), index), grad

    return _select(*tensors)


@keras.saving.register_keras_serializable(package=_PACKAGE)
class ModuloInverseLayer(_GroupLayer):
    """The model -> data parallel boundary: each rank keeps its own rows.

    Inverse of ``ModuloLayer(scheme="BK")``: from the group's K*B rows (R),
    rank i keeps rows ``[i*B, (i+1)*B)``, its own examples, so the loss is
    computed against its own labels. The gradient entering the
    model-parallel region is multiplied by 1/K (see the module docstring).

    Args:
        group: The model group.
        input_layout: Layout of the gradient the producer expects:
            ``"replicated"`` (default; the gradient is all-gathered along the
            batch, e.g. after ``FilterParallelDense(output_layout=
            "replicated")`` or ``ChannelParallelDense``) or
            ``"replicated_partial_grad"`` (the producer, e.g. a
            :class:`ShardLayer`, sums it; no communication here).
        **kwargs: Base layer arguments.

    Example:
        >>> logits = ModuloInverseLayer()(ChannelParallelDense(10)(h))
    """

    def __init__(self, group="model", input_layout=IO_REPLICATED, **kwargs):
        super().__init__(group=group, **kwargs)
        check_choice(self.name, "input_layout", input_layout, (IO_REPLICATED, IO_PARTIAL_GRAD))
        self.input_layout = input_layout

    def call(self, inputs):
        return _leave(inputs, self.comm_group, self.input_layout, f"{self.name}.scatter")

    def compute_output_shape(self, input_shape):
        b = input_shape[0]
        return (None if b is None else b // self.comm_group.size,) + tuple(input_shape[1:])

    def get_config(self):
        return {**super().get_config(), "input_layout": self.input_layout}


__all__ = ["ShardLayer", "ModuloLayer", "ModuloInverseLayer"]
