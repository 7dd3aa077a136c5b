r"""Consistency guards: catch silent wrong training before it costs a run.

SPMD training is only exact when the ranks agree on what they compute. The
ways they stop agreeing are silent: an unseeded shuffle feeds the ranks of a
model group different rows, a plain Keras optimizer lets replicas drift,
weights restored on some ranks only after ``transform`` never reach the
others, auto-named layers drift between ranks and pair the wrong
collectives. :func:`install` (called by :func:`tfhybrid.transform`) makes a
transformed model check for them itself:

- ``compile``: a non-distributed optimizer is wrapped in
  :class:`tfhybrid.DistributedOptimizer`, with a warning (multi-process jobs);
- ``fit``: before the first collective, every rank compares a digest of the
  model's structure (layer names and classes, variable paths and shapes)
  and the number of steps its data gives (``fit`` and ``evaluate``: ranks
  fed data of different lengths would hang at the end of the epoch);
  after each of the first :data:`FIRST_STEPS` steps and every
  ``Config.guard_every_steps`` steps, ranks compare a checksum of their
  batch (the ranks of a model group must feed the same rows); at the start
  of training (after the broadcast callbacks; skipped when one of them
  broadcast this fit's weights), after step
  :data:`FIRST_STEPS` (a drift at an earlier step persists) and every
  ``guard_every_steps`` steps, of their trainable weights (replicated and
  partial weights agree over the world, sharded blocks over the data group);
  one allgather per guarded step carries both.
  A mismatch raises :class:`ConsistencyError` on every rank (every rank sees
  the same gathered checksums), naming the cause and the fix;
- ``fit``/``evaluate``/``predict`` also get the hang watchdog's callback
  (:class:`tfhybrid.watchdog.WatchdogCallback`);
- ``evaluate`` (and ``fit``'s validation) returns the metrics of the global
  data set on every rank (:func:`sum_metric_states`; ``Config(average_metrics=
  False)`` keeps Keras' per-rank values);
- ``summary`` adds a line saying the counts are this rank's (per-rank blocks).

A guarded step costs one small allgather (a few floats per rank): eager
after the first steps' batch checks; inside the traced step, after the
update, where it carries the weight checksums (one pass over the weights in
traced ops, :func:`gather_step_sums`). Other steps add ``tf.cond``\ s on
flags to the traced step: the batch checksum (one reduction per input
tensor) runs only on guarded steps, and only where ranks of a model group
must feed the same rows (not under pure data parallelism, nor in one
process, where there is nothing to compare). ``Config(guards=False)``
turns the checks off (the optimizer wrapping stays).

The companion to the batch check: :func:`tfhybrid.init` broadcasts one seed
from rank 0 and sets it as TensorFlow's global seed when the script has not
set one, so an unseeded ``dataset.shuffle()`` or ``fit(shuffle=True)`` built
after ``init`` shuffles identically on every rank.

The parts, by concern: :mod:`~tfhybrid.guards.checksums` (the error and what ranks
compare), :mod:`~tfhybrid.guards.consistency` (the checks),
:mod:`~tfhybrid.guards.step_callbacks` (the callbacks that run them),
:mod:`~tfhybrid.guards.metrics` (metric summing), :mod:`~tfhybrid.guards.keras_hooks`
(Keras' checkpoint and backup callbacks, logs), :mod:`~tfhybrid.guards.optimizers`
(optimizer wrapping), :mod:`~tfhybrid.guards.fast_path` (the lean train step) and
:mod:`~tfhybrid.guards.install` (the wrapped ``compile``/``fit``/``evaluate``/``predict``).
"""
from __future__ import annotations

import importlib

from tfhybrid.comm.variables import sum_variables
from tfhybrid.runtime import set_consistent_seed
from tfhybrid.guards.checksums import (
    batch_checksum, CHECKSUM_SMALL_ROW, ConsistencyError, FINGERPRINT_ROWS,
    FINGERPRINT_WHOLE_BYTES, FIRST_STEPS, gather_step_sums, input_fingerprint, RTOL,
    step_sums_variable, structure_digest, weight_checksums, weight_checksums_in_step)
from tfhybrid.guards.consistency import (
    check_batch, check_step, check_steps, check_structure, check_weights, copies_of_rows,
    local_blocks, planned_steps, row_copies, row_weighting, set_row_copies, set_row_weighting,
    StartCheck)
from tfhybrid.guards.step_callbacks import (
    AgreeOnStop, EvaluateRows, GuardCallback, part_rows, PartRows)
from tfhybrid.guards.metrics import metric_ranks, sum_metric_states, summary_note
from tfhybrid.guards.optimizers import (
    carry_weight_decay_exclusions, follow_source_flags, refuse_horovod_optimizer,
    refuse_part_options)
from tfhybrid.guards.keras_hooks import (
    drop_validation_iterator, LOG_WRITERS, refuse_horovod_callbacks, RootBackup)
from tfhybrid.guards.fast_path import after_reading, lean_train_function
from tfhybrid.guards.install import install

_PARTS = ('checksums', 'consistency', 'step_callbacks', 'metrics', 'optimizers', 'keras_hooks', 'fast_path', 'install')


def __getattr__(name):
    """The parts' private names as attributes of the package (``tfhybrid.guards._flat_caller``)."""
    for part in _PARTS:
        module = importlib.import_module(f"tfhybrid.guards.{part}")
        if name in vars(module):
            return vars(module)[name]
    raise AttributeError(f"module 'tfhybrid.guards' has no attribute {name!r}")


__all__ = ['after_reading', 'AgreeOnStop', 'batch_checksum', 'carry_weight_decay_exclusions',
           'check_batch', 'check_step', 'check_steps', 'check_structure', 'check_weights',
           'CHECKSUM_SMALL_ROW', 'ConsistencyError', 'copies_of_rows',
           'drop_validation_iterator', 'EvaluateRows', 'FINGERPRINT_ROWS',
           'FINGERPRINT_WHOLE_BYTES', 'FIRST_STEPS', 'follow_source_flags', 'gather_step_sums',
           'GuardCallback', 'input_fingerprint', 'install', 'lean_train_function',
           'local_blocks', 'LOG_WRITERS', 'metric_ranks', 'part_rows', 'PartRows',
           'planned_steps', 'refuse_horovod_callbacks', 'refuse_horovod_optimizer',
           'refuse_part_options', 'RootBackup', 'row_copies', 'row_weighting', 'RTOL',
           'set_consistent_seed', 'set_row_copies', 'set_row_weighting', 'StartCheck',
           'step_sums_variable', 'structure_digest', 'sum_metric_states', 'sum_variables',
           'summary_note', 'weight_checksums', 'weight_checksums_in_step']
