"""The Keras callbacks that run the guards' checks during ``fit``/``evaluate``."""
from __future__ import annotations

import warnings

import keras
import numpy as np
import tensorflow as tf

from tfhybrid import runtime
from tfhybrid.guards.checksums import ConsistencyError, FIRST_STEPS, _world_gather
from tfhybrid.guards.consistency import (
    _refuse_late_copies, _warn_copies, check_step, check_weights, copies_of_rows, set_row_copies)


class GuardCallback(keras.callbacks.Callback):
    """Run the weight and batch checks at the start of ``fit`` and on guarded steps.

    Added by the ``fit`` of a transformed model, last in the list (after the
    broadcast callbacks). ``every``: period after the first steps (0: none).
    """

    def __init__(self, checksum_variable, every, due_variable=None, weights_due_variable=None):
        super().__init__()
        self._checksum = checksum_variable
        self._every = every
        self._due = due_variable
        self._due_value = None
        self._weights_due = weights_due_variable
        self._weights_due_value = None
        self._step = 0

    def _weights_scheduled(self, step):
        """Weights compared after ``step``: the last first step, then every ``every``."""
        return step == FIRST_STEPS or (bool(self._every) and step % self._every == 0)

    def _scheduled(self, step):
        """Batches compared after ``step``: every first step, and the weights' steps."""
        return step <= FIRST_STEPS or self._weights_scheduled(step)

    def _set_due(self, value, weights=False):
        """Tell ``train_step`` whether the next step's batch checksum is needed
        (one assign per change of value: at most two per period) and whether
        it gathers the weight checksums (:func:`gather_step_sums`; the
        step-sums variable is marked unwritten first)."""
        if self._due is not None and value != self._due_value:
            self._due.assign(value)
            self._due_value = value
        sums = getattr(self.model, "_tfhybrid_step_sums", None) if weights else None
        weights = sums is not None      # (the model's attribute lookup: only when due)
        if self._weights_due is not None and weights != self._weights_due_value:
            self._weights_due.assign(weights)
            self._weights_due_value = weights
        if weights:
            sums.assign(tf.fill(tf.shape(sums), tf.constant(np.nan, tf.float64)))

    def _gathered(self):
        """The step-sums matrix the step just gathered, or None when the step did
        not (all NaN: the same on every rank, so every rank then gathers eagerly)."""
        sums = getattr(self.model, "_tfhybrid_step_sums", None)
        if sums is None or self._weights_due is None:
            return None
        value = sums.numpy()
        return None if np.isnan(value).all() else value

    def on_train_begin(self, logs=None):
        self._step = 0
        self._due_value = None
        check = getattr(self.model, "_tfhybrid_start_check", None)
        if check is not None:      # no broadcast callback of this fit carried it
            object.__setattr__(self.model, "_tfhybrid_start_check", None)
            check.run_alone()
        self._weights_due_value = None
        self._set_due(True, self._weights_scheduled(1))
        # A broadcast callback of this fit (listed before this one) has just made
        # every replica rank 0's: nothing to compare (one allgather less per fit).
        if not getattr(self.model, "_tfhybrid_broadcast_in_fit", False):
            check_weights(self.model, "at the start of fit")

    def on_train_batch_end(self, batch, logs=None):
        self._step += 1
        weights = self._weights_scheduled(self._step)
        checked = self._scheduled(self._step)
        gathered = self._gathered() if weights else None
        checksum = float(self._checksum.numpy()) if checked else None
        # before the check, which may raise: no step outside fit gathers
        self._set_due(self._scheduled(self._step + 1), self._weights_scheduled(self._step + 1))
        if checked:
            # weights once replicas could have drifted (after the last first step: a
            # drift at step 1 persists); batches after every first step (each its rows)
            check_step(self.model, checksum, self._step, weights=weights, gathered=gathered)

    def on_train_end(self, logs=None):
        # a later train_step outside fit computes its checksum, and gathers nothing
        self._set_due(True, False)


class EvaluateRows(keras.callbacks.Callback):
    """Whether every data-parallel rank evaluates the same rows, from the first
    batch's checksums (one allgather, at the first batch of an ``evaluate``
    whose inputs are not in-memory arrays): then each row counts once in the
    metrics (:func:`sum_metric_states`), as in one process. Keras' ``Mean``
    of a loss and ratio metrics such as accuracy were already right; counts
    (``TruePositives``, ``Sum``) were multiplied by the ranks."""

    def __init__(self, checksum_variable, due_variable):
        super().__init__()
        self._checksum, self._due = checksum_variable, due_variable
        self._done = False

    def on_test_begin(self, logs=None):
        # fit lists one for its validations: it acts when the evaluate wrapper
        # found the inputs unknown (a dataset), not for validation arrays
        self._done = not getattr(self.model, "_tfhybrid_rows_unknown", False)
        if not self._done:
            self._due.assign(True)

    def on_test_batch_end(self, batch, logs=None):
        if self._done:
            return
        self._done = True
        self._due.assign(False)
        sums = _world_gather([float(self._checksum.numpy())], "guard.evaluate_rows")[:, 0]
        copies = copies_of_rows(self.model, sums)
        if copies and copies > 1:
            _refuse_late_copies(self.model, copies, "in evaluate")
            set_row_copies(self.model, copies)
            _warn_copies(self.model, copies, "in evaluate")

    def on_test_end(self, logs=None):
        if not self._done:
            self._due.assign(False)
        self._done = True


def part_rows(model):
    """``(position, relations)`` of a p/ls model (``row_relations``), else None:
    this rank's block position among the ranks whose batches another rank
    feeds joined, and ``(rank, ranks)`` pairs: ``rank``'s batch must be the
    blocks of ``ranks`` joined in order (one rank: the same rows)."""
    relations = getattr(model, "row_relations", None)
    if relations is None or runtime.current_grid().size == 1:
        return None
    return relations()


def _check_part_rows(model, sums, where):
    for rank, ranks in part_rows(model)[1]:
        want = float(np.sum(sums[list(ranks)]))
        if abs(sums[rank] - want) <= 1e-9 * max(1.0, abs(want)):
            continue
        kind = model.tfhybrid_strategy
        role = (f"ranks {rank} and {ranks[0]} run stages of one pipeline and must feed the "
                "same rows" if kind == "p" else
                f"rank {rank} (an FC worker) must feed the rows of its CONV workers "
                f"{tuple(ranks)}, joined in order")
        raise ConsistencyError(
            f"tfhybrid guard: {where}, {role}, but they fed other rows (batch checksums "
            f"{sums[rank]:.6g} and {want:.6g}). Under strategy {kind!r} ranks play different "
            "parts, and each must feed the block of the global batch its part needs: a "
            "Horovod-style x[rank::size] or dataset.shard(size, rank) gives them other rows "
            "and trains another model. Feed tfhybrid.data.shard(dataset_or_arrays, "
            "model=model, batch_size=<global batch>) with batch_size="
            "tfhybrid.data.local_batch_size(<global batch>, model) for arrays, the same "
            "global data and order on every rank (shuffle with a seed, or shuffle=False).")


class PartRows(keras.callbacks.Callback):
    """p/ls: each rank fed the rows its part needs (the stages of a pipeline the
    same rows; an ls FC worker its CONV workers' rows joined), compared after
    the first ``FIRST_STEPS`` training steps of a fit and the first batch of an
    evaluate (one scalar allgather each): a Horovod-style per-rank slice of the
    data trained another model, silently."""

    def __init__(self, checksum_variable, due_variable):
        super().__init__()
        self._checksum, self._due = checksum_variable, due_variable
        self._steps = 0
        self._tested = False
        self._training = False

    def _compare(self, where):
        sums = _world_gather([float(self._checksum.numpy())], "guard.part_rows")[:, 0]
        _check_part_rows(self.model, sums, where)

    def on_train_begin(self, logs=None):
        self._steps = 0
        self._training = True
        self._due.assign(True)

    def on_train_batch_end(self, batch, logs=None):
        self._steps += 1
        if self._steps <= FIRST_STEPS:
            self._compare(f"at step {self._steps} of fit")
            if self._steps == FIRST_STEPS:
                self._due.assign(False)

    def on_train_end(self, logs=None):
        self._training = False
        self._due.assign(False)

    def on_test_begin(self, logs=None):
        self._tested = False
        self._due.assign(True)

    def on_test_batch_end(self, batch, logs=None):
        if not self._tested:
            self._tested = True
            self._compare("at the first batch of evaluate")
            self._due.assign(False)

    def on_test_end(self, logs=None):
        # a validation inside fit's first steps: the next training step still compares
        self._due.assign(self._training and self._steps < FIRST_STEPS)


class AgreeOnStop(keras.callbacks.Callback):
    """Every rank stops at the end of an epoch when one rank's callbacks set
    ``model.stop_training`` (one scalar allgather per epoch boundary; none
    after the last epoch).

    A callback deciding on this rank's own state (a wall-clock budget read
    from each rank's clock, a file flag, a rank-local check) stopped some
    ranks only: the others went on into the next epoch's first collective
    and waited there until the watchdog ended the job. Keras' own stopping
    callbacks read the logs, which are the same on every rank, and need no
    agreement. A stop set inside an epoch (``on_train_batch_end``) on some
    ranks only still diverges; the watchdog names it.
    """

    def on_epoch_end(self, epoch, logs=None):
        last = (self.params or {}).get("epochs")
        if last is not None and epoch + 1 >= last:
            return                                  # fit ends here on every rank anyway
        from tfhybrid.comm import backend

        grid = runtime.current_grid()
        mine = 1.0 if self.model.stop_training else 0.0
        votes = backend.allgather(tf.constant([[mine]], tf.float64), tuple(range(grid.size)),
                                  "guard.stop").numpy()[:, 0]
        if votes.any() and not self.model.stop_training:
            self.model.stop_training = True
        if votes.any() and not votes.all() and grid.rank == 0:
            ranks = [int(r) for r in np.flatnonzero(votes)]
            warnings.warn(
                f"tfhybrid: rank(s) {ranks} of {grid.size} set model.stop_training at the end "
                f"of epoch {epoch + 1} and the others did not; every rank stops here (a "
                "rank stopping alone would leave the others waiting in the next epoch's "
                "collectives).", UserWarning, stacklevel=2)
