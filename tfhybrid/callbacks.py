"""Keras 3 callbacks for distributed training with tfhybrid.

- :class:`BroadcastGlobalVariablesCallback`: at the start of training, makes
  every rank start from rank 0's weights and optimizer state (building the
  optimizer first, since Keras 3 creates its slots lazily), and prepares the
  model for a :class:`tfhybrid.DistributedOptimizer` (XLA off, replicated FC
  hooks).
- :class:`MetricAverageCallback`: averages the epoch-end logs over all ranks,
  so every rank (and checkpoint/early-stopping callbacks) sees global metrics.
- :class:`LearningRateWarmupCallback`: linear learning-rate warmup per batch
  (Goyal et al.: start at ``lr / p_data``, reach ``lr`` after the warmup).
- :class:`LearningRateScheduleCallback`: Horovod's epoch-wise multiplier of
  the learning rate (step decay, ``staircase=False`` per batch).
- Both work with a float learning rate (they set it) and with a Keras
  ``LearningRateSchedule`` (which Keras refuses to set): they install a
  :class:`ScaledSchedule`, ``schedule(step) x warmup x multiplier``, whose
  factors they set.
- :class:`RootProgbarLogger`: Keras' progress bar on rank 0 only.
- :func:`standard`: the usual list of the above.
- :class:`Profile` (:mod:`tfhybrid.profiling`): where a step's time goes,
  measured per phase beside the oracle's prediction.
- :class:`Checkpoint` (:mod:`tfhybrid.checkpoint`): checkpoints that resume on
  any world size and strategy.
"""
from __future__ import annotations

import hashlib

import keras
import numpy as np
import tensorflow as tf

from tfhybrid import runtime
from tfhybrid.comm import backend
from tfhybrid.layout import layout_of
from tfhybrid.optimizer.slots import link_slots, tracking_slots
from tfhybrid.watchdog import collective_api


def broadcastable(variable) -> bool:
    """False for random-seed state (Keras ``SeedGenerator``): replicas must keep
    their own seeds so dropout masks differ across data-parallel ranks."""
    return not getattr(variable, "name", "").startswith("seed_generator_state")


def _broadcast_variables(variables, root_rank, name, check=None):
    """Assign rank ``root_rank``'s value of each variable on every rank (eager).

    The variables of one process set, root and dtype travel in one broadcast
    (flattened and concatenated, then split back: bit-exact), so a model
    costs a few broadcasts, not one round trip per variable. Before that,
    one small allgather compares a 64-bit BLAKE2b digest of each such group's
    bytes on every rank with its root's: groups every rank already holds
    bit for bit (every ``fit`` after the first, a freshly transformed model)
    are not sent again.

    ``check``: the guards' start-of-fit structure check, whose
    ``check.riders`` (floats) travel in the same allgather;
    ``check.verify(gathered)`` (shape (world, len(riders))) runs before any
    broadcast and raises when the ranks disagree.
    """
    grid = runtime.current_grid()
    if grid.size == 1:
        return
    data = grid.group("data")
    block_root = _block_root(grid, grid.rank, root_rank)
    groups = {}
    for var in (v for v in variables if broadcastable(v)):
        if layout_of(var).kind == "sharded":      # a block: broadcast within the data group
            ranks, root = data.ranks, block_root
        else:
            ranks, root = tuple(range(grid.size)), root_rank
        if len(ranks) > 1:
            groups.setdefault((tuple(ranks), root, tf.as_dtype(var.dtype).name), []).append(var)
    # the same keys in the same order on every rank (built from the same variables)
    keys = list(groups)
    differ = _groups_differ(keys, [_digest(groups[k]) for k in keys], root_rank, grid, name,
                            check)
    for i, ((ranks, root, _), group) in enumerate(groups.items()):
        if not differ[i]:
            continue
        values = [tf.convert_to_tensor(v) for v in group]
        flat = (tf.reshape(values[0], [-1]) if len(values) == 1
                else tf.concat([tf.reshape(t, [-1]) for t in values], 0))
        out = backend.broadcast(flat, root, ranks, f"{name}.{i}")
        sizes = [int(np.prod(t.shape)) for t in values]
        for var, t, part in zip(group, values, tf.split(out, sizes) if len(values) > 1 else [out]):
            var.assign(tf.reshape(part, tf.shape(t)))


def _structure_digest(variables):
    """A digest of the variables' shapes and dtypes (not names: auto-names differ
    between ranks that built other models first), as two exact float64s."""
    h = hashlib.blake2b(digest_size=8)
    for v in variables:
        h.update(f"{tuple(v.shape)}:{tf.as_dtype(v.dtype).name};".encode())
    d = int.from_bytes(h.digest(), "little")
    return [float(d >> 32), float(d & 0xFFFFFFFF)]


def agree_on_root(variables, name, root_rank=0):
    """Make replicas that started apart take rank ``root_rank``'s values.

    For a model trained without tfhybrid.transform (Horovod style: a Keras model,
    ``DistributedOptimizer``, no broadcast callback): its weights were drawn on
    each rank by an unseeded initializer and would never agree, so training
    would silently differ per rank. One allgather of a structure digest and a
    value digest per rank; only when every rank holds the same structure (a
    pipeline stage or an ``ls`` worker holds other variables by design: left
    alone) and some value digest differs from the root's are the values
    broadcast (:func:`_broadcast_variables`, layout-aware). Eager (under
    ``tf.init_scope`` when called while tracing). Returns True when it
    broadcast.
    """
    grid = runtime.current_grid()
    variables = [v for v in variables if broadcastable(v)]
    if grid.size == 1 or not variables:
        return False
    with tf.init_scope():
        world = tuple(range(grid.size))
        part = _structure_digest(variables) + _digest(variables)
        rows = backend.allgather(tf.constant([part], tf.float64), world,
                                 f"{name}.agree").numpy()
        if (rows[:, :2] != rows[root_rank, :2]).any():    # other variables by design
            return False
        same = rows[:, 2:] == rows[root_rank, 2:]
        if same.all():
            return False
        if any(layout_of(v).kind == "sharded" for v in variables) and grid.model_size > 1:
            return False     # blocks differ within a model group by design: the guards' job
        _broadcast_variables(variables, root_rank, name)
        return True


def _block_root(grid, rank, root_rank):
    """The root of ``rank``'s sharded-block broadcast. Horovod's root is a
    global rank: the member of ``root_rank``'s model group that holds the same
    block as ``rank`` (same model rank)."""
    return grid.data_group_ranks(rank % grid.model_size)[root_rank // grid.model_size]


def _digest(variables):
    """A 64-bit digest of the variables' shapes and bytes, as two float64
    numbers (each exact: 32 bits): each variable's bytes fingerprinted by
    TensorFlow (FarmHash64, on the variable's device, no copy to numpy), the
    shapes and fingerprints BLAKE2b'd together (cheaper than BLAKE2b of every
    variable's bytes, which needs them copied to numpy)."""
    h = hashlib.blake2b(digest_size=8)
    prints = []
    for v in variables:
        value = tf.convert_to_tensor(v)
        h.update(repr(tuple(value.shape)).encode())
        prints.append(tf.raw_ops.Fingerprint(data=tf.reshape(value, [1, -1]),
                                             method="farmhash64"))
    if prints:
        h.update(tf.concat(prints, 0).numpy().tobytes())
    d = int.from_bytes(h.digest(), "little")
    return [float(d >> 32), float(d & 0xFFFFFFFF)]


def _groups_differ(keys, digests, root_rank, grid, name, check=None):
    """Per broadcast group: does any rank's digest differ from its root's?
    (One world allgather; every rank takes the same decisions, so the
    broadcasts that follow are issued alike on every rank.) Runs ``check``
    (see :func:`_broadcast_variables`) on its gathered riders."""
    if not keys and check is None:
        return []
    world = tuple(range(grid.size))
    riders = [float(x) for x in check.riders] if check is not None else []
    # one 1-D part per rank, [length, riders..., digests...]: ranks whose models
    # differ (other group counts) still gather, and the riders' check reports it
    part = [1 + len(riders) + 2 * len(digests)] + riders + [x for d in digests for x in d]
    flat = backend.allgather(tf.constant(part, tf.float64), world, f"{name}.digest").numpy()
    rows, start = [], 0
    for _ in world:
        rows.append(flat[start:start + int(flat[start])])
        start += int(flat[start])
    if check is not None:
        check.verify(np.stack([r[1:1 + len(riders)] for r in rows]))
    if len({len(r) for r in rows}) > 1:    # other variables on some rank: send everything
        return [True] * len(keys)
    table = np.stack([r[1 + len(riders):] for r in rows]).reshape(grid.size, -1, 2)
    differ = []
    for i, (ranks, _, _) in enumerate(keys):
        sharded = ranks != world     # a block: each rank's root is its data group's member
        roots = [_block_root(grid, r, root_rank) if sharded else root_rank for r in world]
        differ.append(any((table[r, i] != table[roots[r], i]).any() for r in world))
    return differ


@collective_api("tfhybrid.callbacks.broadcast_model")
def broadcast_model(model, root_rank: int = 0):
    """Broadcast ``model``'s weights and (built) optimizer state from ``root_rank``.

    Random-seed state is not broadcast (see :func:`broadcastable`).

    Sharded variables (one block per model rank) and the optimizer slots of
    sharded variables (Adam's moments, momentum, ...: blocks too, see
    :mod:`tfhybrid.optimizer.slots`) are broadcast within each data group from
    the member of ``root_rank``'s model group; everything else over the world.

    Example:
        >>> tfhybrid.callbacks.broadcast_model(model)   # custom loops
    """
    _broadcast_state(model, root_rank)


def _broadcast_state(model, root_rank, check=None):
    """:func:`broadcast_model` with the guards' ``check`` in its allgather."""
    grid = runtime.current_grid()
    if isinstance(root_rank, bool) or not isinstance(root_rank, int) or not (
            0 <= root_rank < grid.size):
        raise ValueError(f"Received an invalid value for `root_rank`: root_rank={root_rank!r}; "
                         f"expected 0 <= root_rank < world size {grid.size}.")
    own = getattr(model, "broadcast_state", None)
    if own is not None:       # ls: each part from a rank that trains it, per role
        own(root_rank)
        return
    variables = list(model.variables)
    optimizer = getattr(model, "optimizer", None)
    if optimizer is not None:
        if not optimizer.built:
            with tracking_slots(optimizer):
                optimizer.build(model.trainable_variables)
        link_slots(optimizer.variables, model.trainable_variables)
        variables += list(optimizer.variables)
    _broadcast_variables(variables, root_rank, "broadcast.state", check)


def _check_root_rank(root_rank):
    """Refuse a root rank outside the world when the callback is made, not at fit."""
    if isinstance(root_rank, bool) or not isinstance(root_rank, int) or root_rank < 0:
        raise ValueError(f"Received an invalid value for `root_rank`: root_rank={root_rank!r}; "
                         "expected a global rank, an integer >= 0 (usually 0).")
    try:
        size = runtime.current_grid().size
    except RuntimeError:    # launched on several processes, init not called yet
        return
    if root_rank >= size:
        raise ValueError(f"Received an invalid value for `root_rank`: root_rank={root_rank!r}; "
                         f"expected 0 <= root_rank < world size {size}.")


class BroadcastGlobalVariablesCallback(keras.callbacks.Callback):
    """Start every rank from ``root_rank``'s weights and optimizer state.

    Also prepares the model for a :class:`tfhybrid.DistributedOptimizer`
    (:meth:`~tfhybrid.DistributedOptimizer.attach`: XLA off with a warning,
    replicated FC hooks).

    Args:
        root_rank: Global rank whose state is broadcast.

    Example:
        >>> model.fit(ds, callbacks=[BroadcastGlobalVariablesCallback(0)])
    """

    def __init__(self, root_rank: int = 0):
        super().__init__()
        _check_root_rank(root_rank)
        self.root_rank = root_rank
        self._done = False

    def on_train_begin(self, logs=None):
        if self._done:
            return
        attach = getattr(self.model.optimizer, "attach", None)
        if attach is not None:
            attach(self.model)
        # a transformed model's start-of-fit structure check rides in the same
        # allgather (one collective less per fit): see tfhybrid.guards
        check = getattr(self.model, "_tfhybrid_start_check", None)
        if check is not None:
            object.__setattr__(self.model, "_tfhybrid_start_check", None)
        _broadcast_state(self.model, self.root_rank, check)
        self._done = True
        # the guards' start-of-fit weight check has nothing to find (same values by
        # construction): tfhybrid.guards skips it in this fit
        object.__setattr__(self.model, "_tfhybrid_broadcast_in_fit", True)


class MetricAverageCallback(keras.callbacks.Callback):
    """Average the epoch-end logs (loss, metrics, val_*) over all ranks.

    Put it before callbacks that read the logs (checkpointing, early
    stopping); :func:`standard` does.

    Example:
        >>> model.fit(ds, callbacks=[MetricAverageCallback()])
    """

    def on_epoch_end(self, epoch, logs=None):
        if getattr(self.model, "_tfhybrid_logs_global", False):
            # a transformed model's epoch logs are already the global batch's
            # (tfhybrid.guards sums the metric states): nothing to average
            object.__setattr__(self.model, "_tfhybrid_logs_global", False)
            return
        _average_logs(logs, f"metric_average.{epoch}")

    def on_test_end(self, logs=None):
        """Average the evaluation logs seen by the callbacks after this one.

        Keras copies the logs before callbacks see them, so the values that
        ``model.evaluate`` of a plain Keras model returns stay local: pass
        them through :func:`average_logs`. (A transformed model's
        ``evaluate`` already returns the global metrics, see
        :func:`tfhybrid.guards.sum_metric_states`.)
        """
        _average_logs(logs, "metric_average.test")


def average_logs(logs: dict) -> dict:
    """Average a dict of scalar metrics over all ranks (in place; returned).

    Every rank must call it with the same keys.

    Example:
        >>> results = tfhybrid.callbacks.average_logs(
        ...     model.evaluate(tfhybrid.data.shard(test), return_dict=True, verbose=0))
    """
    _average_logs(logs, "metric_average.logs")
    return logs


def _average_logs(logs, name):
    """Replace each scalar entry of ``logs`` by its mean over all ranks."""
    if not logs or runtime.current_grid().size == 1:
        return
    keys = sorted(k for k, v in logs.items() if np.ndim(v) == 0)
    values = tf.constant([float(logs[k]) for k in keys], tf.float64)
    world = tuple(range(runtime.current_grid().size))
    mean = backend.allreduce(values, world, name, average=True)
    for key, value in zip(keys, mean.numpy()):
        logs[key] = float(value)


def _base_optimizer(optimizer):
    """The Keras optimizer holding the learning rate (unwraps DistributedOptimizer,
    LossScaleOptimizer)."""
    while getattr(optimizer, "inner_optimizer", None) is not None:
        optimizer = optimizer.inner_optimizer
    return optimizer


@keras.saving.register_keras_serializable(package="tfhybrid")
class ScaledSchedule(keras.optimizers.schedules.LearningRateSchedule):
    """``schedule(step) x warmup x multiplier``: a Keras schedule callbacks can scale.

    Keras refuses to set the learning rate of an optimizer built with a
    ``LearningRateSchedule`` (``TypeError: ... not settable``), so
    :class:`LearningRateWarmupCallback` and :class:`LearningRateScheduleCallback`
    wrap the schedule in this one (:func:`scalable_learning_rate`) and set its
    two factors, non-trainable variables read by the traced train step at
    every step. Serializable (the factors are saved as numbers).

    Args:
        schedule: A ``LearningRateSchedule`` or a zero-argument callable.
        warmup: Initial value of the warmup factor.
        multiplier: Initial value of the schedule-callback factor.

    Example:
        >>> lr = keras.optimizers.schedules.ExponentialDecay(0.1, 1000, 0.9)
        >>> opt = keras.optimizers.SGD(tfhybrid.callbacks.ScaledSchedule(lr))
        >>> opt.learning_rate.numpy() == lr(0).numpy()
    """

    FACTORS = ("warmup", "multiplier")

    def __init__(self, schedule, warmup=1.0, multiplier=1.0):
        if isinstance(schedule, dict):
            schedule = keras.saving.deserialize_keras_object(schedule)
        if isinstance(schedule, ScaledSchedule) or not callable(schedule):
            raise ValueError(f"Received an invalid `schedule`: {schedule!r}; expected a Keras "
                             "LearningRateSchedule (not already a ScaledSchedule) or a "
                             "zero-argument callable.")
        self.schedule = schedule
        self.factors = {name: tf.Variable(float(value), trainable=False, dtype=tf.float32,
                                          name=f"tfhybrid_lr_{name}")
                        for name, value in zip(self.FACTORS, (warmup, multiplier))}

    def set_factor(self, name, value):
        """Set factor ``name`` ("warmup" or "multiplier") to ``value`` (eager)."""
        self.factors[name].assign(float(value))

    def __call__(self, step):
        if isinstance(self.schedule, keras.optimizers.schedules.LearningRateSchedule):
            base = self.schedule(step)
        else:
            base = self.schedule()
        base = tf.convert_to_tensor(base)
        scale = self.factors["warmup"] * self.factors["multiplier"]
        return base * tf.cast(scale, base.dtype)

    def get_config(self):
        return {"schedule": keras.saving.serialize_keras_object(self.schedule),
                **{name: float(v.numpy()) for name, v in self.factors.items()}}


def scalable_learning_rate(model):
    """The :class:`ScaledSchedule` of ``model``'s optimizer, or None for a float rate.

    A ``LearningRateSchedule`` (or callable) learning rate is wrapped in a
    :class:`ScaledSchedule` the first time (eager, before the train step is
    traced; a train function traced before is rebuilt so that it reads the
    new schedule).

    Raises:
        ValueError: when the model has no compiled optimizer.

    Example:
        >>> tfhybrid.callbacks.scalable_learning_rate(model).set_factor("multiplier", 0.1)
    """
    optimizer = getattr(model, "optimizer", None)
    if optimizer is None:
        raise ValueError(f"Model {getattr(model, 'name', model)!r} has no optimizer: compile it "
                         "before fit with a learning-rate callback.")
    base = _base_optimizer(optimizer)
    lr = getattr(base, "_learning_rate", None)
    if isinstance(lr, ScaledSchedule):
        return lr
    if isinstance(lr, keras.Variable) or isinstance(lr, (int, float)) or tf.is_tensor(lr):
        return None
    if not callable(lr):
        return None
    scaled = ScaledSchedule(lr)
    base.learning_rate = scaled     # Keras accepts a new schedule (not a float)
    if getattr(model, "train_function", None) is not None and hasattr(model, "make_train_function"):
        model.make_train_function(force=True)
    return scaled


def _check_positive(value, name, what, optional=False):
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"Received an invalid value for `{name}`: {value!r}; expected {what}.")
    return float(value)


class LearningRateWarmupCallback(keras.callbacks.Callback):
    """Linear learning-rate warmup over the first ``warmup_steps`` batches.

    With a float learning rate it sets the rate of each batch, from
    ``initial_lr`` to ``target_lr``. With a Keras ``LearningRateSchedule``
    (which Keras does not let anyone set) it scales the schedule instead
    (:class:`ScaledSchedule`): batch ``t`` uses ``schedule(t) x f(t)``, ``f``
    going linearly from ``initial_scale`` to 1.

    Args:
        target_lr: Learning rate reached at the end of the warmup (float
            rates); default: the optimizer's learning rate when training
            starts. Must be None with a schedule (the schedule is the target).
        warmup_steps: Number of training batches of the warmup (> 0).
        initial_lr: Learning rate of the first batch (float rates); default
            ``initial_scale x target_lr``.
        initial_scale: Fraction of the target used on the first batch;
            default ``1 / p_data`` (Goyal et al.'s gradual warmup).

    Raises:
        ValueError: for a non-positive ``target_lr``, ``warmup_steps``,
            ``initial_lr`` or ``initial_scale``; at the start of ``fit``, for
            ``target_lr`` or ``initial_lr`` with a schedule optimizer.

    Example:
        >>> LearningRateWarmupCallback(target_lr=0.1, warmup_steps=500)
        >>> sched = keras.optimizers.schedules.CosineDecay(0.1, 10000)
        >>> model.compile(optimizer=tfhybrid.DistributedOptimizer(keras.optimizers.SGD(sched)), ...)
        >>> model.fit(ds, callbacks=[*tfhybrid.callbacks.standard(),
        ...                          LearningRateWarmupCallback(warmup_steps=500)])
    """

    def __init__(self, target_lr: float | None = None, warmup_steps: int | None = None,
                 initial_lr: float | None = None, initial_scale: float | None = None):
        super().__init__()
        self.target_lr = _check_positive(target_lr, "target_lr", "a positive number, or None "
                                         "(the optimizer's learning rate)", optional=True)
        if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 1:
            raise ValueError(f"Received an invalid value for `warmup_steps`: {warmup_steps!r}; "
                             "expected a positive integer (batches).")
        self.warmup_steps = warmup_steps
        self.initial_lr = _check_positive(initial_lr, "initial_lr", "a positive number or None",
                                          optional=True)
        self.initial_scale = _check_positive(initial_scale, "initial_scale",
                                             "a positive fraction of the target, e.g. 0.1",
                                             optional=True)
        self._step = 0
        self._schedule = None

    def _start_scale(self):
        if self.initial_scale is not None:
            return self.initial_scale
        return 1.0 / runtime.current_grid().data_size

    def learning_rate_at(self, step: int) -> float:
        """Learning rate of batch ``step`` (0-based), for a float learning rate."""
        start = (self.initial_lr if self.initial_lr is not None
                 else self.target_lr * self._start_scale())
        frac = min(1.0, step / self.warmup_steps)
        return start + (self.target_lr - start) * frac

    def scale_at(self, step: int) -> float:
        """Warmup factor of batch ``step`` (0-based), for a schedule learning rate."""
        start = self._start_scale()
        return start + (1.0 - start) * min(1.0, step / self.warmup_steps)

    def on_train_begin(self, logs=None):
        self._schedule = scalable_learning_rate(self.model)
        if self._schedule is None:
            if self.target_lr is None:
                self.target_lr = float(keras.ops.convert_to_numpy(
                    self.model.optimizer.learning_rate))
            return
        given = [f"{k}={v}" for k, v in (("target_lr", self.target_lr),
                                         ("initial_lr", self.initial_lr)) if v is not None]
        if given:
            raise ValueError(
                f"LearningRateWarmupCallback received {', '.join(given)}, but the optimizer's "
                f"learning_rate is a {type(self._schedule.schedule).__name__} schedule, "
                "which is the target: pass LearningRateWarmupCallback(warmup_steps="
                f"{self.warmup_steps}) (optionally initial_scale=...), which scales the "
                "schedule's own values, or compile with a float learning rate.")

    def on_train_batch_begin(self, batch, logs=None):
        if self._step <= self.warmup_steps:
            if self._schedule is not None:
                self._schedule.set_factor("warmup", self.scale_at(self._step))
            else:
                self.model.optimizer.learning_rate = self.learning_rate_at(self._step)
        self._step += 1


class LearningRateScheduleCallback(keras.callbacks.Callback):
    """Multiply the learning rate by ``multiplier(epoch)`` for epochs in
    ``[start_epoch, end_epoch)`` (Horovod's callback of the same name).

    With a float learning rate the rate becomes ``initial_lr x multiplier``;
    with a Keras ``LearningRateSchedule`` the schedule's values are
    multiplied (:class:`ScaledSchedule`). Several callbacks with disjoint
    epoch ranges make a step schedule.

    Args:
        initial_lr: The base rate (float rates); default: the optimizer's
            rate when training starts. Must be None with a schedule.
        multiplier: A number, or a function of the epoch (an int, or with
            ``staircase=False`` a float: epoch + fraction of the epoch done).
        start_epoch: First epoch (0-based) the multiplier applies to.
        end_epoch: First epoch it no longer applies to (None: to the end).
        staircase: True: set once per epoch; False: per batch with a
            fractional epoch (needs ``steps_per_epoch`` or a dataset of known
            length).
        steps_per_epoch: Batches per epoch (``staircase=False``); default:
            Keras' ``params["steps"]``.

    Raises:
        ValueError: for a bad argument; at the start of ``fit``, for
            ``initial_lr`` with a schedule optimizer or ``staircase=False``
            without a known number of steps per epoch.

    Example:
        >>> callbacks = tfhybrid.callbacks.standard() + [
        ...     LearningRateScheduleCallback(multiplier=1.0, start_epoch=0, end_epoch=30),
        ...     LearningRateScheduleCallback(multiplier=0.1, start_epoch=30, end_epoch=60),
        ...     LearningRateScheduleCallback(multiplier=0.01, start_epoch=60)]
    """

    def __init__(self, initial_lr: float | None = None, multiplier=1.0, start_epoch: int = 0,
                 end_epoch: int | None = None, staircase: bool = True,
                 steps_per_epoch: int | None = None):
        super().__init__()
        self.initial_lr = _check_positive(initial_lr, "initial_lr", "a positive number or "
                                          "None (the optimizer's learning rate)", optional=True)
        if not callable(multiplier):
            _check_positive(multiplier, "multiplier", "a positive number or a function of "
                            "the epoch")
        self.multiplier = multiplier
        for name, value in (("start_epoch", start_epoch), ("end_epoch", end_epoch),
                            ("steps_per_epoch", steps_per_epoch)):
            if value is None and name != "start_epoch":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"Received an invalid value for `{name}`: {value!r}; expected "
                                 "a non-negative integer" + (" or None." if name != "start_epoch"
                                                             else "."))
        if end_epoch is not None and end_epoch <= start_epoch:
            raise ValueError(f"Received end_epoch={end_epoch} <= start_epoch={start_epoch}; "
                             "expected an empty end (None) or an epoch after start_epoch.")
        self.start_epoch, self.end_epoch = start_epoch, end_epoch
        self.staircase, self.steps_per_epoch = bool(staircase), steps_per_epoch
        self._schedule = None
        self._epoch = 0

    def _value(self, epoch):
        return float(self.multiplier(epoch) if callable(self.multiplier) else self.multiplier)

    def _active(self, epoch):
        return epoch >= self.start_epoch and (self.end_epoch is None or epoch < self.end_epoch)

    def _apply(self, epoch):
        if self._schedule is not None:
            self._schedule.set_factor("multiplier", self._value(epoch))
        else:
            self.model.optimizer.learning_rate = self.initial_lr * self._value(epoch)

    def on_train_begin(self, logs=None):
        self._schedule = scalable_learning_rate(self.model)
        if self._schedule is not None and self.initial_lr is not None:
            raise ValueError(
                f"LearningRateScheduleCallback received initial_lr={self.initial_lr}, but the "
                f"optimizer's learning_rate is a {type(self._schedule.schedule).__name__} "
                "schedule: pass initial_lr=None, and the callback multiplies the schedule's "
                "own values, or compile with a float learning rate.")
        if self._schedule is None and self.initial_lr is None:
            self.initial_lr = float(keras.ops.convert_to_numpy(self.model.optimizer.learning_rate))
        if not self.staircase and not (self.steps_per_epoch or (self.params or {}).get("steps")):
            raise ValueError("LearningRateScheduleCallback(staircase=False) needs the number of "
                             "batches per epoch: pass steps_per_epoch=N (or fit with "
                             "steps_per_epoch=N / a dataset of known length).")

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch
        if self._active(epoch):
            self._apply(epoch)

    def on_train_batch_begin(self, batch, logs=None):
        if self.staircase or not self._active(self._epoch):
            return
        steps = self.steps_per_epoch or self.params["steps"]
        self._apply(self._epoch + batch / steps)


class RootProgbarLogger(keras.callbacks.ProgbarLogger):
    """Keras' progress bar, silent on every rank but global rank 0.

    Keras uses a ``ProgbarLogger`` found in ``callbacks`` instead of adding
    its own, so including this one silences the other ranks even when
    ``fit`` is called with the default ``verbose="auto"``.
    """

    def set_params(self, params):
        super().set_params(params)
        if not runtime.is_root():
            self.verbose = 0


def standard(root_rank: int = 0, warmup_steps: int = 0, target_lr: float | None = None):
    """The usual callbacks: broadcast, metric averaging, rank-0 progress bar.

    Args:
        root_rank: Rank whose initial state is broadcast.
        warmup_steps: If > 0, add a :class:`LearningRateWarmupCallback`.
        target_lr: Its target learning rate (required with ``warmup_steps``;
            for an optimizer with a ``LearningRateSchedule``, add
            ``LearningRateWarmupCallback(warmup_steps=N)`` yourself instead).

    Returns:
        A list of callbacks to pass to ``model.fit``.

    Raises:
        ValueError: if ``warmup_steps`` > 0 without ``target_lr``.

    Example:
        >>> model.fit(tfhybrid.data.shard(ds), epochs=3,
        ...           callbacks=tfhybrid.callbacks.standard())
    """
    callbacks = [BroadcastGlobalVariablesCallback(root_rank), MetricAverageCallback()]
    if warmup_steps:
        if target_lr is None:
            raise ValueError(f"Received warmup_steps={warmup_steps} without `target_lr`; "
                             "pass the learning rate to warm up to (with a LearningRateSchedule "
                             "optimizer, add tfhybrid.callbacks.LearningRateWarmupCallback("
                             f"warmup_steps={warmup_steps}) to the callbacks instead: it warms "
                             "up the schedule).")
        callbacks.append(LearningRateWarmupCallback(target_lr, warmup_steps))
    callbacks.append(RootProgbarLogger())
    return callbacks




from tfhybrid.checkpoint import Checkpoint  # noqa: E402, F401  (tfhybrid.callbacks.Checkpoint)
from tfhybrid.profiling import Profile  # noqa: E402, F401  (tfhybrid.callbacks.Profile)
