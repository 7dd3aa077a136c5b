"""``tfhybrid.DistributedOptimizer``: Horovod data parallelism for Keras 3.

A small ``keras.optimizers.Optimizer`` subclass that delegates to the wrapped
(inner) optimizer through Keras 3's public ``apply(grads, variables)`` hook,
the way ``keras.optimizers.LossScaleOptimizer`` does. Before the inner
optimizer updates the weights, every gradient is reduced over the process
set its variable's layout asks for (:mod:`tfhybrid.optimizer.reduction`),
packed into fusion buckets with one grouped allreduce per bucket.

Overlap with back-propagation: inside the compiled train step
(``tf.function``) each bucket's allreduce depends only on its own gradients,
and Horovod's ops are asynchronous kernels, so TensorFlow's executor issues a
bucket's reduction as soon as its gradients exist while the gradients of
earlier layers are still being computed. Buckets are built from the last
layer backwards, i.e. in the order back-propagation produces them. Eagerly
(``run_eagerly=True`` or an undecorated GradientTape loop) buckets run one
after another, without overlap.
"""
from __future__ import annotations

import math
import os
import warnings

import keras
import numpy as np
import tensorflow as tf
from keras.src.utils import tracking

from tfhybrid import hooks, runtime
from tfhybrid.comm import backend
from tfhybrid.layout import layout_of
from tfhybrid.optimizer import clipping
from tfhybrid.optimizer.averaging import average_variables, averaging_bytes, schedules
from tfhybrid.optimizer.compression import BUILT_IN, as_compressor
from tfhybrid.optimizer.reduction import is_prereduced, plan_buckets, reduction_of
from tfhybrid.optimizer.slots import link_slots, tracking_slots

COMPRESSIONS = tuple(BUILT_IN)
OPS = ("average", "sum")
DEFAULT_BUCKET_BYTES = 25 * 2**20
MIN_AUTO_BUCKET_BYTES = 64 * 2**10
MIN_AUTO_BUCKETS = 4
MACHINE_ENV = "TFHYBRID_MACHINE"


def fusion_bytes(total_bytes, fixed_s, per_byte_s, cap=DEFAULT_BUCKET_BYTES):
    """The bucket size ``bucket_bytes="auto"`` picks on a measured link:
    sqrt(total x fixed / per_byte), at most a quarter of ``total_bytes``
    (``MIN_AUTO_BUCKETS``) and ``cap``, at least 64 KiB.

    ``total_bytes`` is what the step reduces, ``fixed_s`` one allreduce's fixed
    cost (latency) and ``per_byte_s`` its seconds per payload byte. Splitting
    the gradients into n buckets costs n x fixed more, and the last bucket, which
    back-propagation finishes last, still has (total / n) x per_byte to go when
    the backward pass ends; the size that balances the two minimises their sum.
    A slow link (large per_byte) wants small buckets, a fast one with costly
    collectives large ones.

    At most a quarter of the total: where the square root asks for one or two
    buckets (a fast link, a latency of milliseconds), half the bytes or more
    could only start once back-propagation has ended. The n x fixed above
    overstates what more buckets cost there: the latencies of all but the last
    pass during back-propagation, and buckets that become ready while the link
    is busy leave as one transfer (Horovod fuses what is queued at its next
    cycle). So at least four buckets: the last layers' gradients (often a large
    dense head) travel while the others are computed, and at most a quarter of
    the bytes is left when the backward pass ends. Between two test hosts at
    1 Gbit/s (a VGG-like model, 1.6 MB of gradients, 3.7 ms per allreduce),
    two buckets of half the bytes were 4-7% slower than 128 KiB buckets.

    Example:
        >>> fusion_bytes(1_675_176, 3e-3, 8.4e-8)   # 100 Mbit/s, 3 ms per collective
        244597
        >>> fusion_bytes(1_675_176, 1e-4, 0.0)      # a link that costs nothing per byte
        418794
    """
    size = cap if per_byte_s <= 0 else \
        math.sqrt(max(total_bytes, 1) * max(fixed_s, 0.0) / per_byte_s)
    most = max(total_bytes, 1) / MIN_AUTO_BUCKETS
    return int(max(MIN_AUTO_BUCKET_BYTES, min(cap, size, most)))


def _check_int(value, what, minimum):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"Received an invalid value for `{what}`: {what}={value!r}; "
                         f"expected an integer >= {minimum}.")
    return int(value)


def _check_choice(value, what, choices):
    if value not in choices:
        raise ValueError(f"Received an invalid value for `{what}`: {what}={value!r}; "
                         f"expected one of {choices}.")
    return value


def _inner(optimizer):
    if isinstance(optimizer, str):
        optimizer = keras.optimizers.get(optimizer)
    if isinstance(optimizer, type):
        raise TypeError(f"Received the class {optimizer.__name__} as `optimizer`; pass an "
                        f"instance, e.g. {optimizer.__name__}(learning_rate=0.01).")
    if isinstance(optimizer, DistributedOptimizer):
        raise ValueError("Received a tfhybrid.DistributedOptimizer as `optimizer`; wrap the "
                         "plain Keras optimizer once.")
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise TypeError(f"Received an invalid `optimizer`: {optimizer!r} (type "
                        f"{type(optimizer).__name__}); expected a Keras 3 optimizer instance "
                        "such as keras.optimizers.SGD(0.01) (tf.keras / Keras 2 optimizers "
                        "are not supported).")
    return optimizer


def in_xla_context() -> bool:
    """True while tracing a function compiled with XLA (``jit_compile=True``)."""
    if tf.executing_eagerly():
        return False
    from tensorflow.python.ops import control_flow_util  # no public equivalent

    return control_flow_util.GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph())


XLA_MESSAGE = (
    "tfhybrid.DistributedOptimizer: the train step is being compiled with XLA "
    "(model.compile(jit_compile=True), or jit_compile='auto' on a GPU machine), but "
    "Horovod collectives cannot run inside XLA. Pass jit_compile=False to "
    "model.compile(...), or pass tfhybrid.callbacks.standard() (or "
    "BroadcastGlobalVariablesCallback) to model.fit, which switches XLA off with a "
    "warning; in custom loops use tf.function(jit_compile=False).")


def disable_xla(model) -> bool:
    """Switch ``model``'s train step to plain ``tf.function``; True if it was XLA."""
    if not getattr(model, "compiled", False) or not model.jit_compile:
        return False
    warnings.warn(f"tfhybrid: turning off XLA for model {model.name!r} "
                  "(jit_compile=True -> False): Horovod collectives cannot run inside XLA.",
                  stacklevel=2)
    model.jit_compile = False
    return True


@keras.saving.register_keras_serializable(package="tfhybrid")
class DistributedOptimizer(keras.optimizers.Optimizer):
    """Reduce gradients across the process grid, then apply the wrapped optimizer.

    Each gradient is reduced according to its variable's layout
    (:func:`tfhybrid.layout.layout_of`): replicated -> average over the world;
    partial -> world average x group size; sharded -> average over the data
    group; then x ``grad_scale``. After reduction every gradient equals the
    single-process gradient of the mean loss over the global batch.

    Args:
        optimizer: A Keras 3 optimizer instance (SGD, Adam, AdamW, ...) or its
            name ("adam").
        bucket_bytes: Upper bound of one fusion bucket's payload in bytes, or
            "auto" (the default). Smaller buckets start communicating earlier
            in back-propagation; larger ones issue fewer collectives. "auto":
            when the environment variable ``TFHYBRID_MACHINE`` names a machine
            file of ``tfhybrid calibrate`` (measured on the cluster's link),
            :func:`fusion_bytes` of the gradients' bytes and the calibrated
            allreduce latency and bandwidth of the reducing group; without one,
            25 MiB (``DEFAULT_BUCKET_BYTES``). With "auto" the size is a lower
            bound: a bucket closes once it holds that many bytes, so the
            small gradients between two large ones never travel alone, and
            a last bucket under 64 KiB joins the one before it.
            :meth:`communication_plan` shows the buckets chosen.
        compression: How gradients travel: "none", "fp16" (float32
            gradients travel as float16; halves the bytes, costs about 3
            significant digits), ``tfhybrid.optimizer.Compression.fp16`` or
            your own :class:`tfhybrid.optimizer.Compressor`.
        backward_passes_per_step: Accumulate this many local gradients and
            reduce/apply their mean every N-th call (a step on the union of
            the N micro-batches).
        op: "average" (the mean-loss gradient, the default) or "sum"
            (x the number of data-parallel replicas, Horovod's op=Sum).
        replicate_fc_gradients: Lee et al.'s f: the first f Dense layers
            all-gather activations and errors and compute their weight
            gradients locally instead of all-reducing them. Needs
            :meth:`attach` (done by ``tfhybrid.callbacks.standard()``).
        delay_fc_update: Lee et al.'s delayed FC update (Alg. 2): the Dense
            layers' (reduced) gradients of step t are applied at step t+1, so
            their exchange no longer gates their update: inside a step it
            overlaps the other layers' gradient exchange and updates (TF
            cannot keep a Horovod collective running across two compiled
            steps, so not the next forward pass as on the paper's GPUs).
            Off by default. **Not single-process training**: the FC weights
            step t+1's forward pass uses are those updated with step t-1's
            gradient; the first step applies a zero gradient to them (no
            change under SGD, momentum and Adam; AdamW still decays them).
            Needs :meth:`attach` (done by ``tfhybrid.callbacks.standard()``).
        name: Optional name (default "distributed_<inner name>").

    Raises:
        TypeError: if ``optimizer`` is not a Keras 3 optimizer instance.
        ValueError: for an invalid ``bucket_bytes``, ``compression``,
            ``backward_passes_per_step``, ``op``, ``replicate_fc_gradients``
            or ``delay_fc_update``.

    Example:
        >>> tfhybrid.init()
        >>> opt = tfhybrid.DistributedOptimizer(keras.optimizers.Adam(1e-3),
        ...                                     bucket_bytes=4 * 2**20)
        >>> model.compile(optimizer=opt, loss="mse", jit_compile=False)
        >>> model.fit(tfhybrid.data.shard(ds), callbacks=tfhybrid.callbacks.standard(),
        ...           verbose=tfhybrid.is_root())
    """

    def __init__(self, optimizer, bucket_bytes="auto", compression="none",
                 backward_passes_per_step=1, op="average", replicate_fc_gradients=0,
                 delay_fc_update=False, name=None):
        inner = _inner(optimizer)
        if not (isinstance(bucket_bytes, str) and bucket_bytes == "auto"):
            try:
                bucket_bytes = _check_int(bucket_bytes, "bucket_bytes", 1)
            except ValueError as err:
                raise ValueError(f"{err} Or 'auto' (the default: sized to the link "
                                 "calibrated in TFHYBRID_MACHINE).") from None
        compressor = as_compressor(compression)
        passes = _check_int(backward_passes_per_step, "backward_passes_per_step", 1)
        op = _check_choice(op, "op", OPS)
        fc = _check_int(replicate_fc_gradients, "replicate_fc_gradients", 0)
        if not isinstance(delay_fc_update, bool):
            raise ValueError(f"Received an invalid value for `delay_fc_update`: "
                             f"{delay_fc_update!r}; expected True (Lee et al.'s delayed FC "
                             "update) or False (the default: exact synchronous updates).")
        super().__init__(learning_rate=0.0, name=name or f"distributed_{inner.name}")
        self.inner_optimizer = inner
        self.bucket_bytes = bucket_bytes
        self.compressor = compressor
        self.compression = compressor.name
        self.backward_passes_per_step = passes
        self.op = op
        self.replicate_fc_gradients = fc
        self.delay_fc_update = delay_fc_update
        self._plan = None
        self._delayed = {}
        self.replicas_checked = False   # set by a transformed model's compile (its guards)

    # -- delegation to the inner optimizer --------------------------------

    @tracking.no_automatic_dependency_tracking
    def build(self, var_list):
        """Create the inner optimizer's slots (and gradient accumulators)."""
        var_list = list(var_list)
        self._check_fc_hooks(var_list)
        self._accumulators = []
        # Slots are linked to their variables: a slot of a sharded weight is a block.
        with tracking_slots(self), tracking_slots(self.inner_optimizer):
            if self.backward_passes_per_step > 1:
                self._micro_step = self.add_variable(shape=(), dtype="int32",
                                                     initializer="zeros", aggregation="none",
                                                     name="micro_step")
                self._accumulators = [self.add_variable_from_reference(v, name="grad_accumulator")
                                      for v in var_list]
            self.inner_optimizer.build(var_list)
            super().build(var_list)
            if schedules(var_list):   # gmp's periodic averaging: applied steps so far
                self._applied_steps = self.add_variable(shape=(), dtype="int64",
                                                        initializer="zeros",
                                                        aggregation="none",
                                                        name="applied_steps")
            if self.delay_fc_update:   # the last step's reduced gradient of each FC weight
                self._delayed = {self._get_variable_index(v): self.add_variable_from_reference(
                    v, name="delayed_fc_grad") for v in var_list if is_delayed_fc(v)}
        link_slots(self.variables, var_list)   # an inner optimizer built before wrapping

    def _agree_on_root(self, var_list):
        """Horovod-style scripts (no transform, no broadcast callback) start from
        each rank's own random weights: take rank 0's once, at the first
        ``apply`` (a collective: every rank trains; not at ``build``, which
        ``keras.saving.load_model`` on rank 0 alone also calls), and say so."""
        if self.replicas_checked:
            return
        self.replicas_checked = True
        agreed = hooks.call("agree_on_root", var_list, f"{self.name}.initial")  # callbacks
        if agreed and runtime.is_root():
            warnings.warn(
                "tfhybrid: the model's weights differed between ranks at the "
                "DistributedOptimizer's first step (each rank initialised its own); they "
                "were set to rank 0's so the replicas train as one. Pass "
                "tfhybrid.callbacks.standard() to fit (it broadcasts rank 0's state at "
                "the start), or transform the model with tfhybrid.transform(model, 'd').",
                stacklevel=2)

    def _check_fc_hooks(self, var_list):
        if self.replicate_fc_gradients and not any(is_prereduced(v) for v in var_list):
            raise ValueError(
                f"DistributedOptimizer(replicate_fc_gradients={self.replicate_fc_gradients}) "
                "found no hooked Dense layer among the trainable variables. Call "
                "optimizer.attach(model) before training, or pass "
                "tfhybrid.callbacks.standard() to model.fit.")
        if self.delay_fc_update and not any(is_delayed_fc(v) for v in var_list):
            raise ValueError(
                "DistributedOptimizer(delay_fc_update=True) found no Dense layer marked for "
                "the delayed update among the trainable variables. Call "
                "optimizer.attach(model) before training, or pass "
                "tfhybrid.callbacks.standard() to model.fit.")

    @property
    def variables(self):
        return self._variables + self.inner_optimizer.variables

    @property
    def iterations(self):
        return self.inner_optimizer.iterations

    @property
    def learning_rate(self):
        return self.inner_optimizer.learning_rate

    @learning_rate.setter
    def learning_rate(self, learning_rate):
        self.inner_optimizer.learning_rate = learning_rate

    def scale_loss(self, loss):
        return self.inner_optimizer.scale_loss(loss)

    def finalize_variable_values(self, var_list):
        self.inner_optimizer.finalize_variable_values(var_list)

    def attach(self, model):
        """Prepare ``model`` for this optimizer: XLA off, replicated FC hooks.

        Called by ``tfhybrid.callbacks.standard()`` at the start of training;
        call it yourself in custom loops. Returns True when the model's train
        function had to be rebuilt.

        Example:
            >>> opt = tfhybrid.DistributedOptimizer(keras.optimizers.SGD(0.1),
            ...                                     replicate_fc_gradients=1)
            >>> opt.attach(model)
        """
        from tfhybrid.optimizer.replicated_fc import replicate_fc_gradients

        changed = disable_xla(model)
        if self.replicate_fc_gradients:
            changed = replicate_fc_gradients(model, self.replicate_fc_gradients) > 0 or changed
        if self.delay_fc_update:
            mark_delayed_fc(model)
        if changed and getattr(model, "train_function", None) is not None:
            model.make_train_function(force=True)
        return changed

    # -- the apply hook -------------------------------------------------------

    def apply(self, grads, trainable_variables=None):
        """Reduce ``grads`` across ranks, then apply them with the inner optimizer."""
        variables = list(trainable_variables if trainable_variables is not None
                         else self._trainable_variables)
        if runtime.current_grid().size > 1 and in_xla_context():
            raise RuntimeError(XLA_MESSAGE)
        if not self.built:
            with keras.name_scope(self.name, caller=self):
                self.build(variables)
        self._agree_on_root(variables)
        # Embedding gradients stay IndexedSlices where nothing else needs them dense:
        # Keras' optimizers update rows of sparse gradients their own way (Adam on
        # the densified gradient differed from one process by 5e-2 after 8 steps).
        sparse_ok = (self.backward_passes_per_step == 1 and not self._delayed
                     and self.compressor.is_identity)
        grads = [None if g is None else g if sparse_ok and isinstance(g, tf.IndexedSlices)
                 else tf.convert_to_tensor(g) for g in grads]
        if self.backward_passes_per_step == 1:
            self._reduce_and_apply(grads, variables)
        else:
            self._accumulate_and_maybe_apply(grads, variables)

    def _reduce_and_apply(self, grads, variables):
        reduced = self.reduce_gradients(grads, variables)
        if self._delayed:
            reduced = [self._swap_delayed(local, g, v)
                       for local, g, v in zip(grads, reduced, variables)]
        self._apply_inner(reduced, variables)
        self._maybe_average(variables)

    def _apply_inner(self, grads, variables):
        """The inner optimizer's update, with ``clipnorm``/``global_clipnorm``
        computed on whole weights where a rank holds blocks (see
        :mod:`tfhybrid.optimizer.clipping`)."""
        grid = runtime.current_grid()
        if grid.model_size == 1 or not any(clipping.clip_norms(self.inner_optimizer)):
            self.inner_optimizer.apply(grads, variables)
            return
        grads = [g if g is None else tf.convert_to_tensor(g) for g in grads]
        groups, weights = [], []
        model = grid.group("model")
        for v in variables:
            layout = layout_of(v)
            if layout.kind != "sharded" or is_prereduced(v):   # whole after reduction
                groups.append(None)
                weights.append(1.0 / model.size)
            else:                                             # a block: sum over its group
                ranks = tuple(layout.group.ranks if hasattr(layout.group, "ranks")
                              else grid.group(layout.group).ranks)
                groups.append(ranks if len(ranks) > 1 else None)
                weights.append(len(ranks) / model.size)
        name = f"{self.name}.clip"

        def per_variable(squares):
            return clipping.summed_over(squares, groups, name)

        clipped = clipping.clip(grads, self.inner_optimizer, per_variable,
                                clipping.global_total_over(model.ranks, weights, name), name)
        with clipping.keras_clipping_off(self.inner_optimizer):
            self.inner_optimizer.apply(clipped, variables)

    def _maybe_average(self, variables):
        """gmp's periodic model averaging (:mod:`tfhybrid.optimizer.averaging`):
        every ``every``-th applied step, group-local variables are averaged over
        the model groups (all ranks take the same branch: the count is global)."""
        plans = schedules(variables)
        if not plans or runtime.current_grid().data_size == 1:
            return
        count = self._applied_steps.assign_add(1)
        for number, (schedule, indices) in enumerate(sorted(
                plans.items(), key=lambda kv: (kv[0].every, kv[0].method))):
            chosen = [variables[i] for i in indices]

            def average(chosen=chosen, schedule=schedule, number=number):
                average_variables(chosen, schedule.method, runtime.current_grid(),
                                  f"{self.name}.average{number}")
                return tf.constant(True)

            tf.cond(tf.equal(count % schedule.every, 0), average, lambda: tf.constant(False))

    def averaging_plan(self, variables=None):
        """What gmp's periodic averaging moves per averaging (analytic).

        Returns:
            ``[{"every", "method", "variables", "payload", "sent", "groups"}]``,
            one entry per schedule (``sent``: bytes this rank sends per
            averaging, see :func:`tfhybrid.optimizer.averaging.averaging_bytes`);
            empty without group-local variables.
        """
        variables = list(variables if variables is not None else self._trainable_variables)
        out = []
        for schedule, indices in schedules(variables).items():
            chosen = [variables[i] for i in indices]
            out.append({"every": schedule.every, "method": schedule.method,
                        "variables": len(chosen),
                        **averaging_bytes(chosen, schedule.method, runtime.current_grid())})
        return out

    def _swap_delayed(self, local, grad, variable):
        """Lee's delayed FC update: return the previous step's gradient, keep this one.

        The update must not run before this step's forward pass has read the
        weight: nothing else orders them (TensorFlow does not order a read
        before a later write of the same variable inside one step), so the
        previous gradient is read after the weight's local gradient exists,
        which the forward read precedes. The reduction of this step's
        gradient gates nothing but the buffer.
        """
        buffer = self._delayed.get(self._get_variable_index(variable))
        if buffer is None or grad is None:
            return grad
        with tf.control_dependencies([local]):
            previous = tf.identity(buffer.value)
        with tf.control_dependencies([previous]):
            buffer.assign(tf.cast(grad, buffer.dtype))
        return previous

    def _accumulate_and_maybe_apply(self, grads, variables):
        n = self.backward_passes_per_step
        slots = [self._accumulators[self._get_variable_index(v)] for v in variables]
        for g, slot in zip(grads, slots):
            if g is not None:
                slot.assign_add(tf.cast(g, slot.dtype))
        self._micro_step.assign_add(1)

        def reduce_and_apply():
            mean = [None if g is None else tf.convert_to_tensor(s) / n
                    for g, s in zip(grads, slots)]
            self._reduce_and_apply(mean, variables)
            for slot in slots:
                slot.assign(tf.zeros_like(slot))

        tf.cond(tf.equal(self._micro_step.value % n, 0), reduce_and_apply, lambda: None)

    def saved_accumulators(self, variables):
        """``{id(accumulator): value}`` of the ``backward_passes_per_step``
        accumulators as a checkpoint records them (collective: every rank, same
        ``variables``; empty without accumulation).

        Each accumulator holds this rank's local gradients since the last
        reduction, so the replicas of a variable differ. The reduction is a
        sum times a factor, linear in the accumulators: recording their mean
        over the ranks the gradient is reduced over (the replicas) and
        resuming every replica from it gives the same reduced gradient at
        the end of the cycle, and the recorded value is the same whichever
        replica a checkpoint reads. The live accumulators are not changed.
        """
        if self.backward_passes_per_step == 1 or not self._accumulators:
            return {}
        grid = runtime.current_grid()
        out = {}
        for i, v in enumerate(variables):
            slot = self._accumulators[self._get_variable_index(v)]
            ranks = reduction_of(v, grid).ranks
            value = tf.convert_to_tensor(slot)
            if ranks:
                value = backend.allreduce(value, ranks, f"{self.name}.saved_acc{i}",
                                          average=True)
            out[id(slot)] = value
        return out

    # -- reduction ------------------------------------------------------------

    def reduce_gradients(self, grads, variables):
        """The reduced gradients (no update). Usable in custom loops.

        Args:
            grads: Local gradients, one per variable (None allowed).
            variables: The variables, in forward order.

        Returns:
            A list of reduced gradients (None where ``grads`` had None).
        """
        grid = runtime.current_grid()
        specs = [reduction_of(v, grid, self.op) for v in variables]
        grads = [None if g is None else g if isinstance(g, tf.IndexedSlices)
                 else tf.convert_to_tensor(g) for g in grads]
        sparse = {i for i, g in enumerate(grads) if isinstance(g, tf.IndexedSlices)}
        items = [((), 0) if g is None or i in sparse else (s.ranks, self._wire_bytes(g, v))
                 for i, (g, s, v) in enumerate(zip(grads, specs, variables))]
        # "auto": the size is a lower bound (no bucket of biases alone pays a latency),
        # and a last bucket under the 64 KiB floor joins the one before it
        auto = self.bucket_bytes == "auto"
        buckets = plan_buckets(items, self._bucket_size(items), at_least=auto,
                               min_last=MIN_AUTO_BUCKET_BYTES if auto else 0)
        communicated = {i for bucket in buckets for i in bucket.indices}
        # only dense gradients reduced by no bucket are scaled here (no dead ops in the
        # step: scaling IndexedSlices would densify them; _reduce_slices scales them)
        out = [None if g is None or i in communicated or i in sparse else _scaled(g, s.factor)
               for i, (g, s) in enumerate(zip(grads, specs))]
        for number, bucket in enumerate(buckets):
            reduced = self._reduce_bucket([grads[i] for i in bucket.indices],
                                          [specs[i].factor for i in bucket.indices],
                                          bucket.ranks, number)
            for i, g in zip(bucket.indices, reduced):
                out[i] = g
        for i in sorted(sparse, reverse=True):   # back-propagation order, as the buckets
            out[i] = self._reduce_slices(grads[i], specs[i], i)
        self._plan = buckets
        return out

    def _bucket_size(self, items):
        """``bucket_bytes``, or for "auto" the size :func:`fusion_bytes` picks on
        the calibrated link of the largest reducing group (see the argument)."""
        if self.bucket_bytes != "auto":
            return self.bucket_bytes
        path = os.environ.get(MACHINE_ENV)
        groups = {}
        for ranks, nbytes in items:
            if ranks:
                groups[ranks] = groups.get(ranks, 0) + nbytes
        if not path or not groups:
            return DEFAULT_BUCKET_BYTES
        ranks, total = max(groups.items(), key=lambda kv: (len(kv[0]), kv[1]))
        fixed_s, per_byte_s = hooks.call("allreduce_link", path, len(ranks),
                                         max(ranks) - min(ranks) + 1)
        return fusion_bytes(total, fixed_s, per_byte_s)

    def _reduce_slices(self, g, spec, index):
        """An IndexedSlices gradient (Embedding) reduced as Horovod does: the rows
        of every rank gathered (the same multiset of rows one process holds for
        the global batch), values x the reduction's factor."""
        values, indices = g.values, g.indices
        if spec.ranks:
            name = f"{self.name}.sparse{index}"
            values = backend.allgather(values, spec.ranks, name + ".values")
            indices = backend.allgather(indices, spec.ranks, name + ".indices")
        return tf.IndexedSlices(_scaled(values, spec.factor), indices, g.dense_shape)

    def _wire_bytes(self, g, variable):
        """Bytes of ``g`` on the wire, sized from the variable (the gradient's
        static shape may be partly unknown inside a traced step)."""
        itemsize = self.compressor.wire_itemsize(g.dtype)
        return int(np.prod(tuple(variable.shape) or (1,))) * itemsize

    def _reduce_bucket(self, grads, factors, ranks, number):
        name = f"{self.name}.bucket{number}"
        if not self.compressor.is_identity:   # scale first: a float16 sum cannot overflow
            wire = [self.compressor.compress(_scaled(g, f)) for g, f in zip(grads, factors)]
            summed = backend.grouped_allreduce([w for w, _ in wire], ranks, name)
            return [self.compressor.decompress(s, ctx) for s, (_, ctx) in zip(summed, wire)]
        if len(set(factors)) == 1:       # Horovod scales the fused buffer itself
            return backend.grouped_allreduce(grads, ranks, name, postscale=factors[0])
        summed = backend.grouped_allreduce(grads, ranks, name)
        return [_scaled(s, f) for s, f in zip(summed, factors)]

    def communication_plan(self):
        """Buckets of the last traced/executed step and the bytes they move.

        Returns:
            dict with ``buckets`` (list of ``{"ranks", "gradients", "bytes"}``),
            ``payload_bytes`` and ``ring_bytes`` (bytes each rank sends per
            step with a ring allreduce: sum of 2(k-1)/k x bucket bytes).
        """
        plan = self._plan or []
        return {"buckets": [{"ranks": list(b.ranks), "gradients": len(b.indices),
                             "bytes": b.nbytes} for b in plan],
                "payload_bytes": sum(b.nbytes for b in plan),
                "ring_bytes": sum(b.ring_bytes() for b in plan)}

    # -- serialization ----------------------------------------------------------

    def get_config(self):
        return {"name": self.name,
                "optimizer": keras.saving.serialize_keras_object(self.inner_optimizer),
                "bucket_bytes": self.bucket_bytes, "compression": self._compression_config(),
                "backward_passes_per_step": self.backward_passes_per_step, "op": self.op,
                "replicate_fc_gradients": self.replicate_fc_gradients,
                "delay_fc_update": self.delay_fc_update}

    def _compression_config(self):
        """The built-in compressor's name; a user-defined one is serialised as a
        Keras object (register it with ``keras.saving.register_keras_serializable``)."""
        if BUILT_IN.get(self.compressor.name) is self.compressor:
            return self.compressor.name
        return keras.saving.serialize_keras_object(self.compressor)

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        config["optimizer"] = keras.saving.deserialize_keras_object(
            config["optimizer"], custom_objects=custom_objects)
        if isinstance(config.get("compression"), dict):
            config["compression"] = keras.saving.deserialize_keras_object(
                config["compression"], custom_objects=custom_objects)
        return cls(**config)


_DELAYED = "_tfhybrid_delayed_fc"


def mark_delayed_fc(model):
    """Mark the trainable weights of ``model``'s Dense layers (nested models too,
    tfhybrid's parallel Dense layers included) for the delayed FC update.
    Returns the number of weights marked.

    Example:
        >>> mark_delayed_fc(model)      # done by DistributedOptimizer.attach
        4
    """
    from tfhybrid.optimizer.replicated_fc import dense_layers

    marked = 0
    for layer in dense_layers(model, include_parallel=True):
        for variable in layer.trainable_variables:
            setattr(variable, _DELAYED, True)
            marked += 1
    return marked


def is_delayed_fc(variable) -> bool:
    """True when ``variable`` belongs to a Dense layer whose update is delayed."""
    return bool(getattr(variable, _DELAYED, False))


def _scaled(g, factor):
    return g if factor == 1.0 else g * tf.cast(factor, g.dtype)
