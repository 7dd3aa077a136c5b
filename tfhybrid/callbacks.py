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
- :class:`RootProgbarLogger`: Keras' progress bar on rank 0 only.
- :func:`standard`: the usual list of the above.
"""
from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf

from tfhybrid import runtime
from tfhybrid.comm import backend
from tfhybrid.layout import layout_of
from tfhybrid.optimizer.slots import link_slots, tracking_slots


def broadcastable(variable) -> bool:
    """False for random-seed state (Keras ``SeedGenerator``): replicas must keep
    their own seeds so dropout masks differ across data-parallel ranks."""
    return not getattr(variable, "name", "").startswith("seed_generator_state")


def _broadcast_variables(variables, root_rank, name):
    """Assign rank ``root_rank``'s value of each variable on every rank (eager)."""
    grid = runtime.current_grid()
    if grid.size == 1:
        return
    data = grid.group("data")
    # Horovod's root is a global rank: the member of root_rank's model group that
    # holds the same block as this rank (same model rank).
    block_root = data.ranks[root_rank // grid.model_size]
    for i, var in enumerate(v for v in variables if broadcastable(v)):
        if layout_of(var).kind == "sharded":      # a block: broadcast within the data group
            ranks, root = data.ranks, block_root
        else:
            ranks, root = tuple(range(grid.size)), root_rank
        if len(ranks) > 1:
            value = backend.broadcast(tf.convert_to_tensor(var), root, ranks, f"{name}.{i}")
            var.assign(value)


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
    grid = runtime.current_grid()
    if isinstance(root_rank, bool) or not isinstance(root_rank, int) or not (
            0 <= root_rank < grid.size):
        raise ValueError(f"Received an invalid value for `root_rank`: root_rank={root_rank!r}; "
                         f"expected 0 <= root_rank < world size {grid.size}.")
    _broadcast_variables(model.variables, root_rank, "broadcast.model")
    optimizer = getattr(model, "optimizer", None)
    if optimizer is not None:
        if not optimizer.built:
            with tracking_slots(optimizer):
                optimizer.build(model.trainable_variables)
        link_slots(optimizer.variables, model.trainable_variables)
        _broadcast_variables(optimizer.variables, root_rank, "broadcast.optimizer")


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
        broadcast_model(self.model, self.root_rank)
        self._done = True


class MetricAverageCallback(keras.callbacks.Callback):
    """Average the epoch-end logs (loss, metrics, val_*) over all ranks.

    Put it before callbacks that read the logs (checkpointing, early
    stopping); :func:`standard` does.

    Example:
        >>> model.fit(ds, callbacks=[MetricAverageCallback()])
    """

    def on_epoch_end(self, epoch, logs=None):
        _average_logs(logs, f"metric_average.{epoch}")

    def on_test_end(self, logs=None):
        """Average the evaluation logs seen by the callbacks after this one.

        Keras copies the logs before callbacks see them, so the values that
        ``model.evaluate`` returns stay local: pass them through
        :func:`average_logs`.
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


class LearningRateWarmupCallback(keras.callbacks.Callback):
    """Linear learning-rate warmup over the first ``warmup_steps`` batches.

    Args:
        target_lr: Learning rate reached at the end of the warmup.
        warmup_steps: Number of training batches of the warmup (> 0).
        initial_lr: Learning rate of the first batch; default
            ``target_lr / p_data`` (Goyal et al.'s gradual warmup).

    Raises:
        ValueError: for a non-positive ``target_lr`` or ``warmup_steps``.

    Example:
        >>> LearningRateWarmupCallback(target_lr=0.1, warmup_steps=500)
    """

    def __init__(self, target_lr: float, warmup_steps: int, initial_lr: float | None = None):
        super().__init__()
        if isinstance(target_lr, bool) or not isinstance(target_lr, (int, float)) or target_lr <= 0:
            raise ValueError(f"Received an invalid value for `target_lr`: {target_lr!r}; "
                             "expected a positive number.")
        if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 1:
            raise ValueError(f"Received an invalid value for `warmup_steps`: {warmup_steps!r}; "
                             "expected a positive integer (batches).")
        self.target_lr = float(target_lr)
        self.warmup_steps = warmup_steps
        self.initial_lr = initial_lr
        self._step = 0

    def learning_rate_at(self, step: int) -> float:
        """Learning rate of batch ``step`` (0-based)."""
        start = (self.initial_lr if self.initial_lr is not None
                 else self.target_lr / runtime.current_grid().data_size)
        frac = min(1.0, step / self.warmup_steps)
        return start + (self.target_lr - start) * frac

    def on_train_batch_begin(self, batch, logs=None):
        if self._step <= self.warmup_steps:
            self.model.optimizer.learning_rate = self.learning_rate_at(self._step)
        self._step += 1


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
        target_lr: Its target learning rate (required with ``warmup_steps``).

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
                             "pass the learning rate to warm up to.")
        callbacks.append(LearningRateWarmupCallback(target_lr, warmup_steps))
    callbacks.append(RootProgbarLogger())
    return callbacks


from tfhybrid.checkpoint import Checkpoint  # noqa: E402  (tfhybrid.callbacks.Checkpoint)
