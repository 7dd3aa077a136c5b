"""Consistency guards: catch silent wrong training before it costs a run.

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
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import inspect
import os
import types
import warnings
import weakref

import keras
import numpy as np
import tensorflow as tf

from tfhybrid import batch_losses, runtime
from tfhybrid.layers.spatial.output import full_labels_to_blocks, whole_predictions
from tfhybrid.layout import layout_of
from tfhybrid.watchdog import collective_api

#: Steps checked at the start of every ``fit`` (then every ``guard_every_steps``).
FIRST_STEPS = 2
#: Relative tolerance of the weight checksums (replicas are bitwise equal when exact).
RTOL = 1e-6


class ConsistencyError(RuntimeError):
    """Ranks that must agree (rows fed, replicated weights, model structure) do not."""


def _config():
    from tfhybrid.config import Config

    return runtime._STATE.get("config") or Config()


def _world_gather(values, name):
    """``values`` (1-D float64) of every rank, stacked: shape (world, n)."""
    from tfhybrid.comm import backend

    grid = runtime.current_grid()
    row = tf.constant(np.asarray(values, np.float64)[None, :])
    return backend.allgather(row, tuple(range(grid.size)), name).numpy()


# -- what is compared ---------------------------------------------------------

def structure_digest(model) -> float:
    """A number identifying the model's layer names/classes and variable paths/shapes."""
    parts = [f"{layer.name}:{type(layer).__name__}" for layer in model.layers]
    parts += [f"{v.path}:{tuple(v.shape)}" for v in model.variables]
    digest = hashlib.sha256("|".join(parts).encode()).digest()
    return float(int.from_bytes(digest[:6], "little"))   # exact in float64


#: Period of the weight checksums' position weights ``1 + (i mod P)/P``.
_POSITION_PERIOD = 97


@functools.lru_cache(maxsize=128)
def _position_weights(size: int) -> np.ndarray:
    return 1.0 + (np.arange(size) % _POSITION_PERIOD) / _POSITION_PERIOD


def weight_checksums(variables) -> np.ndarray:
    """Position-weighted sums of each variable (order and value sensitive).

    The position weights are cached per size: the checks run at the start
    of every ``fit`` and after its first steps, and building the weights is
    most of a call's cost.
    """
    out = []
    for v in variables:
        flat = np.asarray(v.numpy()).ravel()
        out.append(float(np.dot(flat.astype(np.float64, copy=False),
                                _position_weights(flat.size))))
    return np.asarray(out)


def weight_checksums_in_step(variables):
    """:func:`weight_checksums` as traced ops (float64, one per variable): the
    guards' weight check runs inside the training step it follows
    (:func:`gather_step_sums`), with no eager pass over the weights in numpy.
    Same position weights (``1 + (i mod P)/P``, :data:`_POSITION_PERIOD`): the
    variable, zero-padded to a multiple of P, viewed as rows of P times a
    column of the P weights (no weight vector as large as the variable).

    Six graph nodes per variable: tracing them is part of every ``fit``'s
    first step. The earlier slice-the-tail form took 28 and 8-9 s to trace
    for 315 ResNet-like variables, 2-3 s in this form (same sums to 1e-12).
    """
    period = _POSITION_PERIOD
    cols = tf.constant(_position_weights(period)[:, None])
    out = []
    for v in variables:
        size = int(np.prod(v.shape))
        flat = tf.reshape(tf.cast(v, tf.float64), [-1])
        if size % period:
            flat = tf.pad(flat, [[0, period - size % period]])
        out.append(tf.reduce_sum(tf.matmul(tf.reshape(flat, [-1, period]), cols)))
    return tf.stack(out) if out else tf.zeros([0], tf.float64)


def gather_step_sums(model, checksum, due):
    """In ``train_step``, after the update: when ``due`` (a traced bool, set by the
    :class:`GuardCallback` before the steps whose weights it compares), gather
    this step's batch checksum and weight checksums over the world and keep
    them in the model's step-sums variable for the callback to verify. The
    allgather then runs in the traced step, instead of an eager pass over the
    weights in numpy and an eager allgather between two steps. Nothing
    when the variable is missing or sized for other variables (a train
    function traced before ``fit`` made it): the callback then finds it
    unwritten and runs the eager check."""
    sums = getattr(model, "_tfhybrid_step_sums", None)
    variables = model.trainable_variables
    if sums is None or sums.shape[1] != 1 + len(variables):
        return
    from tfhybrid.comm import backend

    world = tuple(range(runtime.current_grid().size))

    def gather():
        values = tf.concat([tf.reshape(checksum.read_value(), [1]),
                            weight_checksums_in_step(variables)], 0)
        sums.assign(backend.allgather(values[None, :], world, "guard.step_sums"))
        return tf.constant(True)

    tf.cond(due, gather, lambda: tf.constant(False))


def step_sums_variable(model):
    """The model's step-sums variable (world x (1 + trainable variables), float64),
    made or remade eagerly at the start of ``fit`` (before Keras traces its
    train function) when missing or sized for other variables."""
    width = 1 + len(model.trainable_variables)
    sums = getattr(model, "_tfhybrid_step_sums", None)
    if sums is None or tuple(sums.shape) != (runtime.current_grid().size, width):
        with tf.init_scope():
            sums = tf.Variable(np.full((runtime.current_grid().size, width), np.nan),
                               trainable=False, name="tfhybrid_step_sums", dtype=tf.float64)
        object.__setattr__(model, "_tfhybrid_step_sums", sums)
    return sums


# batch_checksum's rows up to this many items use one matrix-vector product
# (fewer traced ops: every guarded train step traces it); longer rows use slices
CHECKSUM_SMALL_ROW = 4096


def batch_checksum(data, position=None):
    """A traced float64 checksum of a batch, sensitive to row order and values.

    ``position`` (a traced int, p/ls): this batch is block ``position`` of
    equal blocks that another rank feeds as one batch; its rows are weighted
    as rows ``position x rows ...`` of that batch, so the blocks' checksums
    sum to the joined batch's.

    Each row's sum weighs column ``j`` by ``1 + (j % 7) / 7``. Rows of up to
    :data:`CHECKSUM_SMALL_ROW` items take one float64 matrix-vector product
    (a weight vector TensorFlow folds into a constant: small). Longer rows
    (volumes) are summed as seven strided column slices in float64, one after
    the other: no row-long weight constant kept for the traced step's
    lifetime and no float64 copy of the whole batch, a few sevenths of the
    batch's size at most."""
    total = tf.constant(0.0, tf.float64)
    for t in tf.nest.flatten(data):
        if t is None or not tf.is_tensor(t) or not (t.dtype.is_floating or t.dtype.is_integer
                                                     or t.dtype.is_bool):
            continue
        if t.shape.rank == 0:
            total += tf.cast(t, tf.float64)
            continue
        rows = tf.reshape(t, [tf.shape(t)[0], -1])
        width = rows.shape[1]
        if width is not None and width <= CHECKSUM_SMALL_ROW:
            cols = 1.0 + tf.cast(tf.range(width) % 7, tf.float64) / 7.0
            per_row = tf.linalg.matvec(tf.cast(rows, tf.float64), cols)
        else:
            per_row = tf.zeros([tf.shape(rows)[0]], tf.float64)
            for r in range(7):
                # one slice at a time: the previous float64 copy is freed before the next
                with tf.control_dependencies([per_row] if r else []):
                    part = tf.cast(rows[:, r::7], tf.float64)
                per_row += tf.reduce_sum(part, axis=1) * (1.0 + r / 7.0)
        row_w = 1.0 + tf.cast(tf.range(tf.shape(rows)[0]), tf.float64)
        if position is not None:
            row_w += tf.cast(position * tf.shape(rows)[0], tf.float64)
        total += tf.reduce_sum(per_row * row_w)
    return total


# input_fingerprint hashes an array whole up to this size, else FINGERPRINT_ROWS
# evenly spaced rows of it (BLAKE2b hashes on the order of 1 GB/s, so the whole-array
# bound keeps a fingerprint to tens of milliseconds).
FINGERPRINT_WHOLE_BYTES = 32 * 2**20
FINGERPRINT_ROWS = 1024


def input_fingerprint(*sources) -> float:
    """A cheap digest of in-memory inputs (numpy arrays or eager tensors, nested in
    lists, tuples or dicts): shapes, dtypes and the bytes of each array (whole up
    to ``FINGERPRINT_WHOLE_BYTES``, else ``FINGERPRINT_ROWS`` evenly spaced
    rows), as a float64 holding 48 bits of BLAKE2b. NaN when any source is
    something else (a dataset, a generator, a PyDataset): not known before a step.
    ``None`` sources are skipped.

    Per-rank arrays of different rows differ in (nearly) every row, so the
    sample tells them apart; two large arrays equal in every sampled row but
    not elsewhere would be taken as copies (``fit``'s step-2 batch check then
    corrects it)."""
    flat = [a for a in tf.nest.flatten([s for s in sources if s is not None])
            if a is not None]
    if not flat:
        return float("nan")
    h = hashlib.blake2b(digest_size=6)
    for a in flat:
        if not (isinstance(a, np.ndarray) or (tf.is_tensor(a) and tf.executing_eagerly())):
            return float("nan")
        shape = tuple(int(d) for d in a.shape)
        h.update(f"{shape}|{a.dtype}|".encode())
        nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(a.dtype.name if tf.is_tensor(a)
                                                               else a.dtype).itemsize
        if shape and shape[0] and nbytes <= FINGERPRINT_WHOLE_BYTES:
            h.update(np.ascontiguousarray(a if isinstance(a, np.ndarray) else a.numpy()).tobytes())
        elif shape and shape[0]:
            rows = np.unique(np.linspace(0, shape[0] - 1,
                                         min(shape[0], FINGERPRINT_ROWS)).astype(np.int64))
            sample = a[rows] if isinstance(a, np.ndarray) else tf.gather(a, rows).numpy()
            h.update(np.ascontiguousarray(sample).tobytes())
        elif not shape:
            h.update(np.asarray(a).tobytes())
    return float(int.from_bytes(h.digest(), "little"))


def copies_of_rows(model, values):
    """How many ranks of each row-block group fed the very same rows, from each
    rank's ``values`` (fingerprints or batch checksums, world-long): the group's
    size when every group's members agree (whole arrays or one unsharded
    dataset on every rank), 1 when they differ, None when unknown (NaN)."""
    values = np.asarray(values, np.float64)
    if not np.all(np.isfinite(values)):
        return None
    groups = _row_block_groups(model)
    if len(groups[0]) < 2:
        return 1
    for ranks in groups:
        vals = values[list(ranks)]
        if np.max(vals) - np.min(vals) > 1e-12 * max(1.0, float(np.max(np.abs(vals)))):
            return 1
    return len(groups[0])


def row_copies(model) -> int:
    """The copies of each row the ranks of ``model`` feed now (1: each its own rows)."""
    copies = getattr(model, "_tfhybrid_row_copies", None)
    return 1 if copies is None else int(round(float(copies.numpy())))


def set_row_copies(model, copies):
    variable = getattr(model, "_tfhybrid_row_copies", None)
    if variable is not None and row_copies(model) != int(copies):
        variable.assign(float(copies))


def _sum_losses(model):
    """The names of ``model``'s compiled losses of reduction ``sum`` (row-block wrapped)."""
    compiled = getattr(model, "_compile_loss", None)
    # a split output's sum loss is the ``block`` of its wrapper (spatial.output)
    losses = [getattr(entry.loss, "block", entry.loss)
              for entry in getattr(compiled, "_flat_losses", None) or ()]
    return [getattr(loss, "name", "loss") for loss in losses
            if isinstance(loss, batch_losses.BlockRowsLoss) and loss.reduction == "sum"]


def _refuse_late_copies(model, copies, where):
    """Duplicate rows found after a ``sum`` loss already counted them ``copies`` times."""
    names = _sum_losses(model)
    if names:
        raise ConsistencyError(
            f"tfhybrid guard: all {copies} data-parallel ranks fed identical rows {where}, "
            f"and loss {names[0]!r} has reduction='sum': each row was counted {copies} "
            f"times (loss and gradients {copies}x those of one process). tfhybrid finds "
            "whole numpy arrays before the first step, but not an unsharded dataset. Give "
            "each rank its rows with tfhybrid.data.shard(dataset, model=model), or pass the "
            "arrays themselves.")


def _warn_copies(model, copies, where):
    if getattr(model, "_tfhybrid_duplicates_warned", False):
        return
    object.__setattr__(model, "_tfhybrid_duplicates_warned", True)
    if runtime.is_root():
        warnings.warn(
            f"tfhybrid: all {copies} data-parallel ranks fed identical rows {where}: each "
            "rank computes the whole batch, so data parallelism saves no time. The numbers "
            "are still those of one process (tfhybrid counts each row once in losses, "
            "gradients and metrics). Give each rank its rows: "
            "tfhybrid.data.shard(dataset, model=model) for a tf.data pipeline of global "
            "batches, or, for arrays under d or gmp, Horovod's way: "
            "fit(x[tfhybrid.rank()::tfhybrid.size()], ...) with the per-rank batch size.",
            UserWarning, stacklevel=3)


# -- the checks ---------------------------------------------------------------

def planned_steps(arguments, steps_key) -> int:
    """Steps per epoch a fit/evaluate call will run on this rank, -1 when not known here.

    From ``steps_per_epoch``/``steps``, a ``tf.data.Dataset``'s cardinality,
    or the length of numpy arrays and ``batch_size`` (Keras' default 32).
    """
    if arguments.get(steps_key):
        return int(arguments[steps_key])
    x = arguments.get("x")
    if isinstance(x, tf.data.Dataset):
        count = int(x.cardinality().numpy()) if tf.executing_eagerly() else -1
        return count if count >= 0 else -1
    if arguments.get("validation_split") or x is None:
        return -1
    flat = tf.nest.flatten(x)
    if flat and all(isinstance(a, np.ndarray) or tf.is_tensor(a) for a in flat):
        rows = int(flat[0].shape[0]) if flat[0].shape and flat[0].shape[0] is not None else -1
        batch = arguments.get("batch_size") or 32
        return -(-rows // batch) if rows >= 0 else -1
    return -1


def _steps_problem(model, steps, method):
    """The message when the ranks' known step counts differ, else None."""
    steps = [int(s) for s in steps]
    if min(steps) < 0 or len(set(steps)) == 1:
        return None
    counts = ", ".join(f"rank {r}: {s}" for r, s in enumerate(steps))
    return (f"tfhybrid guard: the ranks would run different numbers of steps in "
            f"{model.name!r}.{method} ({counts} per epoch, from their data's lengths), so a "
            "rank with more steps would wait forever in a collective the others never "
            "reach. Feed every rank the same global pipeline through "
            "tfhybrid.data.shard(dataset, model=model) (a partial last batch is handled "
            "alike on every rank), or pass the same steps_per_epoch/steps on every rank.")


def check_structure(model, steps=-1):
    """Every rank holds the same model structure and plans the same number of steps
    (collective, one allgather), else raise."""
    grid = runtime.current_grid()
    if grid.size == 1:
        return
    check = StartCheck(model, steps)
    check.run_alone()


def local_blocks(arguments):
    """(training rows, batch size, may differ, rows, validation rows,
    validation_split) of this rank's ``fit``/``evaluate`` inputs: whether the
    ranks' blocks of a step can hold unequal rows.

    In-memory arrays: the rows Keras trains on (after ``validation_split``'s
    cut), the batch size and the whole arrays' rows, compared over the ranks. A
    dataset: equal when its batch size is static (compared too) or it is
    ``data.shard``'s batched form; else, like a generator or a ``PyDataset``,
    it may differ. ``validation_data`` the same way (its rows, or may differ)."""
    split = float(arguments.get("validation_split") or 0.0)
    rows, batch, maybe = _blocks_of(arguments.get("x"), arguments.get("batch_size"))
    train = float(np.floor(rows * (1.0 - split))) if rows >= 0 and split else rows  # Keras' cut
    validation = arguments.get("validation_data")
    val_rows = rows - train if split and rows >= 0 else -1.0
    if validation is not None:
        first = validation[0] if isinstance(validation, (tuple, list)) \
            and len(validation) in (2, 3) else validation
        val_rows, _, val_maybe = _blocks_of(first, None)
        maybe = max(maybe, val_maybe)
    return train, batch, maybe, rows, val_rows, split


def _blocks_of(x, batch_size):
    """(rows or -1, batch size or -1, may differ) of one input of fit/evaluate."""
    if isinstance(x, tf.data.Dataset):
        from tfhybrid import data

        if data.equal_blocks(x):
            first = tf.nest.flatten(x.element_spec)[0]
            static = first.shape[0] if first.shape.rank else None
            return -1.0, float(static if static is not None else -1), 0.0
        return -1.0, -1.0, 1.0
    flat = tf.nest.flatten(x) if x is not None else []
    if flat and all(isinstance(a, np.ndarray) or tf.is_tensor(a) for a in flat) \
            and len(flat[0].shape) and flat[0].shape[0] is not None:
        return float(flat[0].shape[0]), float(batch_size or 32), 0.0
    return -1.0, -1.0, 1.0


def _decide_row_weighting(model, blocks, copies, split):
    """Set ``model``'s row-weighting flag (:mod:`tfhybrid.batch_losses`) from
    every rank's :func:`local_blocks` ``(training rows, batch, may differ, rows,
    validation rows)``; warn on rank 0 when a ``validation_split`` of per-rank
    arrays trains on other rows than one process would."""
    groups = _row_block_groups(model)
    if len(groups[0]) < 2 or any(getattr(model, "_tfhybrid_split_outputs", ())):
        return
    uneven = bool(np.any(blocks[:, 2] > 0)) or any(
        len({(blocks[r, 0], blocks[r, 1], blocks[r, 4]) for r in ranks}) > 1
        for ranks in groups)
    set_row_weighting(model, uneven)
    if split and copies == 1 and np.all(blocks[:, 0] >= 0):
        _warn_split(model, blocks, groups, split)


def _warn_split(model, blocks, groups, split):
    """A ``validation_split`` cuts each rank's arrays: the same rows as one
    process only when every rank's cut falls on a batch boundary and the cuts
    add up to one process's."""
    for ranks in groups:
        cuts = blocks[list(ranks), 0]
        batches = blocks[list(ranks), 1]
        one = int(np.floor(blocks[list(ranks), 3].sum() * (1.0 - split)))   # one process's cut
        if len(set(cuts)) == 1 and cuts[0] % batches[0] == 0 and int(cuts.sum()) == one:
            continue
        if runtime.current_grid().rank == 0:
            warnings.warn(
                f"tfhybrid: fit(validation_split={split}) cut each rank's arrays on its own: "
                f"the ranks train on {int(cuts.sum())} rows ({', '.join(str(int(c)) for c in cuts)}"
                f" per rank) where one process would train on the first {one} of the whole "
                "arrays, so this run trains and validates on other rows than one process. "
                "Split the whole arrays yourself and pass the validation rows as "
                "validation_data=(x_val, y_val) (each rank its share, like the training rows), "
                "or use a validation_split whose cut falls on a global batch boundary on "
                "every rank.", UserWarning, stacklevel=2)
        return


def row_weighting(model) -> bool:
    flag = getattr(model, "_tfhybrid_row_weighting", None)
    return flag is not None and bool(flag.numpy())


def set_row_weighting(model, value):
    flag = getattr(model, "_tfhybrid_row_weighting", None)
    if flag is not None and row_weighting(model) != bool(value):
        flag.assign(bool(value))


def _fit_fingerprints(arguments):
    """:func:`input_fingerprint` of fit's training and validation inputs (NaN
    where not in-memory arrays; a ``validation_split`` shares the training's)."""
    train = input_fingerprint(arguments.get("x"), arguments.get("y"))
    validation = arguments.get("validation_data")
    if validation is None:
        val = train if arguments.get("validation_split") else float("nan")
    elif isinstance(validation, (tuple, list)) and len(validation) in (2, 3):
        val = input_fingerprint(validation[0], validation[1])
    else:
        val = input_fingerprint(validation)
    return train, val


class StartCheck:
    """The start-of-fit structure and step-count check, to gather with another
    collective: ``riders`` (this rank's values) travel in the
    :class:`tfhybrid.callbacks.BroadcastGlobalVariablesCallback`'s digest
    allgather, which calls ``verify(gathered)`` before its first broadcast; the
    :class:`GuardCallback` runs it alone when no broadcast callback took it."""

    def __init__(self, model, steps, fingerprints=None, blocks=None):
        self.model = model
        self.riders = [structure_digest(model), float(steps)]
        if fingerprints is not None:     # fit's (training, validation) inputs
            self.riders += [float(f) for f in fingerprints]
            if blocks is not None:       # fit's local_blocks (after the fingerprints)
                self.riders += [float(b) for b in blocks[:5]]
                self.validation_split = blocks[5]

    def verify(self, gathered):
        """Raise :class:`ConsistencyError` when ``gathered`` (world x riders) disagree;
        with fingerprints, set the model's row copies for training and validation."""
        gathered = np.asarray(gathered, np.float64)
        _verify_structure(self.model, gathered)
        if gathered.shape[1] >= 4:
            copies = copies_of_rows(self.model, gathered[:, 2])
            if copies:
                set_row_copies(self.model, copies)
                if copies > 1:
                    _warn_copies(self.model, copies, "in fit")
            object.__setattr__(self.model, "_tfhybrid_validation_copies",
                               copies_of_rows(self.model, gathered[:, 3]))
        if gathered.shape[1] >= 9:
            _decide_row_weighting(self.model, gathered[:, 4:9], copies_of_rows(
                self.model, gathered[:, 2]), getattr(self, "validation_split", 0.0))

    def run_alone(self):
        """Gather ``riders`` in a world allgather of their own and verify them."""
        self.verify(_world_gather(self.riders, "guard.structure"))


def _verify_structure(model, gathered):
    grid = runtime.current_grid()
    digests = gathered[:, 0]
    bad = [r for r in range(grid.size) if digests[r] != digests[0]]
    if bad:
        raise ConsistencyError(
            f"tfhybrid guard: model {model.name!r} differs between ranks: ranks {bad} hold "
            "other layer names, classes or weight shapes than rank 0, so their collectives "
            "would pair with the wrong layers and hang. Usually Keras' auto-generated layer "
            "names drifted: some rank built an extra layer or model first (e.g. inside "
            "`if rank == 0:`). Build the same models in the same order on every rank, give "
            "layers explicit names, or call keras.utils.clear_session() before building.")
    problem = _steps_problem(model, gathered[:, 1], "fit")
    if problem:
        raise ConsistencyError(problem)


def check_steps(model, steps, method, fingerprint=None, blocks=None):
    """Every rank plans the same number of steps (collective), else raise.

    With ``fingerprint`` (:func:`input_fingerprint` of this rank's inputs, in
    the same allgather): return :func:`copies_of_rows` of the ranks' inputs.
    With ``blocks`` too (:func:`local_blocks`), set the row-weighting flag."""
    if runtime.current_grid().size == 1:
        return 1
    riders = [steps] if fingerprint is None else [steps, fingerprint]
    if fingerprint is not None and blocks is not None:
        riders += [float(b) for b in blocks[:5]]
    gathered = _world_gather(riders, f"guard.steps.{method}")
    problem = _steps_problem(model, gathered[:, 0], method)
    if problem:
        raise ConsistencyError(problem)
    if fingerprint is None:
        return None
    copies = copies_of_rows(model, gathered[:, 1])
    if blocks is not None:
        _decide_row_weighting(model, gathered[:, 2:7], copies, 0.0)
    return copies


def check_weights(model, when):
    """Replicas of every trainable weight agree (collective), else raise.

    Replicated and partial weights are full on every rank (they agree over
    the world); a sharded block agrees over its data group (the ranks with
    the same model rank).
    """
    grid = runtime.current_grid()
    variables = model.trainable_variables
    if grid.size == 1 or not variables:
        return
    _check_weight_sums(model, _world_gather(weight_checksums(variables), "guard.weights"), when)


def _check_weight_sums(model, sums, when):
    """Raise when the gathered checksums ``sums`` (world x variables) disagree."""
    grid = runtime.current_grid()
    world = [list(range(grid.size))]
    data_groups = [list(grid.data_group_ranks(m)) for m in range(grid.model_size)]
    model_groups = [list(grid.model_group_ranks(d)) for d in range(grid.data_size)]
    for i, v in enumerate(model.trainable_variables):
        groups = data_groups if layout_of(v).kind == "sharded" else world
        if getattr(v, "_tfhybrid_periodic_average", None) is not None:
            # gmp's periodic averaging: each model group's copy drifts between averagings
            groups = [] if layout_of(v).kind == "sharded" else model_groups
        for ranks in groups:
            vals = sums[ranks, i]
            if np.max(vals) - np.min(vals) > RTOL * max(1.0, float(np.max(np.abs(vals)))):
                other = next(r for r in ranks if abs(sums[r, i] - sums[ranks[0], i])
                             > RTOL * max(1.0, abs(sums[ranks[0], i])))
                raise ConsistencyError(_weights_message(model, v, ranks[0], other, when))


def _weights_message(model, v, a, b, when):
    head = (f"tfhybrid guard: weight {v.path!r} of model {model.name!r} differs between "
            f"ranks {a} and {b} {when}, but they must hold the same values")
    if when == "at the start of fit":
        return (head + ". It was changed on some ranks only after tfhybrid.transform (e.g. "
                "load_weights or set_weights on rank 0 only). Restore weights before "
                "transform (transform starts every rank from rank 0's weights), or pass "
                "tfhybrid.callbacks.standard() to fit, which broadcasts rank 0's state.")
    return (head + ": the replicas drifted apart. Compile with "
            "tfhybrid.DistributedOptimizer(...) (a plain Keras optimizer does not reduce "
            "gradients across ranks), do not change weights on some ranks only, and keep "
            "custom training steps identical on every rank.")


def _batch_shared(model) -> bool:
    """True when ranks of a model group must feed the same rows (same on every rank).

    Not for a model fed spatial blocks (``tfhybrid.data.volumes``): the ranks
    of a group then feed different blocks of the same rows."""
    grid = runtime.current_grid()
    return (grid.size > 1 and grid.model_size > 1
            and getattr(model, "_tfhybrid_batch_split", "data") == "data"
            and not getattr(model, "_tfhybrid_block_input", False))


def _row_block_groups(model):
    """The groups of ranks that must feed different rows (one per position in the
    model group; all ranks for d/gmp models, which split the batch over every rank)."""
    grid = runtime.current_grid()
    if getattr(model, "_tfhybrid_batch_split", "data") == "world":
        return [tuple(range(grid.size))]
    return [tuple(grid.data_group_ranks(m)) for m in range(grid.model_size)]


def _data_replicas_checked(model) -> bool:
    """True when the first step's batches are compared across the ranks that
    should feed different rows (more than one block of the global batch)."""
    return (runtime.current_grid().size > 1 and not getattr(model, "_tfhybrid_part", False)
            and batch_losses.row_blocks(model)[0] > 1)


def _batch_checksummed(model) -> bool:
    """Whether ``train_step`` computes its batch checksum (on the due steps)."""
    return _batch_shared(model) or _data_replicas_checked(model)


def check_batch(model, checksum, step):
    """The ranks of each model group fed the same rows (collective), else raise."""
    if _batch_shared(model):
        _check_batch_sums(_world_gather([checksum], "guard.batch")[:, 0], step)


def check_step(model, checksum, step, weights=True, gathered=None):
    """:func:`check_batch` and (with ``weights``) :func:`check_weights` after a step,
    in one collective (one allgather of the batch and weight checksums).
    ``gathered``: that allgather's result, already made inside the step
    (:func:`gather_step_sums`: world x (batch checksum, weight checksums));
    no collective here then."""
    grid = runtime.current_grid()
    shared = _batch_shared(model)
    # at the weight check's step: its allgather carries the batch checksum too
    duplicates = step == FIRST_STEPS and weights and _data_replicas_checked(model)
    batch = shared or duplicates
    variables = model.trainable_variables if weights else []
    if grid.size == 1 or not (batch or variables):
        return
    if gathered is not None and variables:
        sums = gathered if batch else gathered[:, 1:]
    else:
        values = ([checksum] if batch else []) + list(weight_checksums(variables))
        sums = _world_gather(values, "guard.step")
    if shared:
        _check_batch_sums(sums[:, 0], step)
    if duplicates:
        _found_duplicate_rows(model, sums[:, 0])
    if variables:
        _check_weight_sums(model, sums[:, int(batch):], f"after step {step}")


def _check_batch_sums(sums, step):
    grid = runtime.current_grid()
    for d in range(grid.data_size):
        ranks = list(grid.model_group_ranks(d))
        vals = sums[ranks]
        if np.max(vals) - np.min(vals) > 1e-9 * max(1.0, float(np.max(np.abs(vals)))):
            other = next(r for r in ranks if sums[r] != sums[ranks[0]])
            raise ConsistencyError(
                f"tfhybrid guard: ranks {ranks[0]} and {other} of model group {tuple(ranks)} "
                f"fed different rows at step {step} (batch checksums {sums[ranks[0]]:.6g} and "
                f"{sums[other]:.6g}), but the ranks of a model group must feed the same rows. "
                "Likely an unseeded or per-rank shuffle (dataset.shuffle() built before "
                "tfhybrid.init or with a rank-dependent seed, fit(shuffle=True) on arrays, "
                "np.random or Python's random in a keras.utils.PyDataset or generator, which "
                "tfhybrid.init does not seed) or data read per rank. Build the same global "
                "pipeline on every rank, give shuffle a seed (shuffle(n, seed=0)), feed it "
                "through tfhybrid.data.shard(dataset, model=model), and pass shuffle=False to "
                "fit with arrays; for numpy/Python randomness call "
                "keras.utils.set_random_seed(seed) with one seed on every rank.")


def _found_duplicate_rows(model, sums):
    """Every data-parallel rank fed the same rows at step 2 of a fit (an unsharded
    dataset; whole arrays are found before step 1): count each row once from here
    (the epoch's metrics are summed at its end), warn once, and refuse a ``sum``
    loss, whose first steps counted the rows several times."""
    copies = copies_of_rows(model, sums)
    if not copies or row_copies(model) == copies:
        return
    if copies == 1:     # same arrays, rows in other orders (per-rank shuffles): not copies
        summed = _sum_losses(model)
        if summed:
            raise ConsistencyError(
                f"tfhybrid guard: every rank was given the same arrays, but fed other rows at "
                f"step {FIRST_STEPS} (a shuffle seeded per rank), with loss "
                f"{summed[0]!r} of reduction='sum', so the first steps counted "
                "rows as copies. Shard the arrays per rank (x[tfhybrid.rank()::"
                "tfhybrid.size()]) or pass shuffle=False.")
        set_row_copies(model, 1)
        return
    _refuse_late_copies(model, copies, f"at step {FIRST_STEPS} of fit")
    set_row_copies(model, copies)
    _warn_copies(model, copies, f"at step {FIRST_STEPS} of fit")


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
        kind = ("p" if hasattr(model, "pipeline_state") else "ls")
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


# -- the hook on transformed models ----------------------------------------

def _broadcasts(callbacks) -> bool:
    """Whether ``callbacks`` (fit's argument) hold a broadcast callback that will
    broadcast at the start of this fit."""
    from tfhybrid.callbacks import BroadcastGlobalVariablesCallback

    if not isinstance(callbacks, (list, tuple)):
        return False
    return any(isinstance(c, BroadcastGlobalVariablesCallback) and not c._done
               for c in tf.nest.flatten(callbacks))


def _keras_signature(method):
    """The signature of Keras' own ``fit``/``evaluate``/``predict`` for ``method``:
    a subclass's override may take ``*args, **kwargs`` (tfhybrid's PipelineModel
    does), where binding would hide ``callbacks``, ``shuffle``, ... in
    ``kwargs``."""
    return inspect.signature(getattr(keras.Model, method.__name__, method))


def _callbacks_arg(method, model, args, kwargs):
    """(bound arguments, their callbacks list) of a fit/evaluate/predict call."""
    bound = _keras_signature(method).bind(model, *args, **kwargs)
    return bound, bound.arguments.get("callbacks")


def _quiet_shuffle(bound):
    """``shuffle=False`` in ``fit``'s bound arguments when it reads a
    ``tf.data.Dataset`` and the script left ``shuffle`` at its default: Keras
    ignores ``shuffle`` for a dataset and warns about it on every rank at every
    fit (the README's ``fit(tfhybrid.data.shard(...))`` included); the data
    order is unchanged."""
    if "shuffle" not in bound.arguments and isinstance(bound.arguments.get("x"),
                                                       tf.data.Dataset):
        bound.arguments["shuffle"] = False


def _keras_checkpoints(model, bound):
    """Keras' ``ModelCheckpoint`` callbacks in ``fit``'s bound arguments, handled.

    On a model with split tfhybrid layers, ``ModelCheckpoint`` would call
    ``model.save``/``save_weights`` (which refuse: they would write one rank's
    shards) only at the end of the first epoch: refuse it here, before any
    training, naming ``tfhybrid.callbacks.Checkpoint``. On a model of plain Keras
    layers every rank holds the full weights: rank 0 keeps the callback and the
    other ranks drop it (all ranks writing one file corrupts it; Horovod's
    examples save on rank 0 only).

    Raises:
        ValueError: for a ``ModelCheckpoint`` on a model with split layers.
    """
    callbacks = bound.arguments.get("callbacks")
    if callbacks is None or isinstance(callbacks, keras.callbacks.CallbackList):
        return
    callbacks = list(callbacks)
    found = [cb for cb in callbacks if isinstance(cb, keras.callbacks.ModelCheckpoint)]
    if not found:
        return
    if _holds_shards(model):
        cb = found[0]
        path = str(cb.filepath)
        suggested = path if path.endswith(".keras") else os.path.splitext(
            path.removesuffix(".weights.h5"))[0] + ".keras"
        raise ValueError(
            f"keras.callbacks.ModelCheckpoint({path!r}) would save transformed model "
            f"{model.name!r} with Keras' model.{'save_weights' if cb.save_weights_only else 'save'}"
            "(), which writes only this rank's part of its split layers. Use "
            f"tfhybrid.callbacks.Checkpoint({suggested!r}) instead (every rank runs it, rank 0 "
            "writes the full weights and optimizer state, tfhybrid.load resumes on any world "
            "size; sharded=True writes per-rank parts).")
    if runtime.current_grid().rank != 0:
        bound.arguments["callbacks"] = [cb for cb in callbacks if cb not in found]


class RootBackup(keras.callbacks.Callback):
    """Keras' ``BackupAndRestore`` run the Horovod way on a model whose ranks
    all hold the full weights (``d``): rank 0 alone backs up and deletes the
    backup (every rank writing one HDF5 file failed with a lock error); at
    the start of ``fit`` rank 0 restores it and every rank then takes rank
    0's weights, optimizer state and epoch to resume at (one broadcast), so
    all ranks resume together even where the others cannot read rank 0's
    files."""

    def __init__(self, backup):
        super().__init__()
        self.backup = backup
        self.root = runtime.current_grid().rank == 0

    def set_model(self, model):
        super().set_model(model)
        self.backup.set_model(model)

    def on_train_begin(self, logs=None):
        from tfhybrid.callbacks import broadcast_model
        from tfhybrid.comm import backend

        if self.root:
            self.backup.on_train_begin(logs)
        epoch = int(getattr(self.model, "_initial_epoch", None) or 0) if self.root else 0
        world = tuple(range(runtime.current_grid().size))
        epoch = int(backend.broadcast(tf.constant(epoch, tf.int64), 0, world,
                                      "backup.epoch").numpy())
        broadcast_model(self.model)
        if epoch:
            self.model._initial_epoch = epoch

    def _root_only(name):
        def hook(self, *args, **kwargs):
            if self.root:
                getattr(self.backup, name)(*args, **kwargs)
        hook.__name__ = name
        return hook

    on_epoch_end = _root_only("on_epoch_end")
    on_train_batch_end = _root_only("on_train_batch_end")
    on_train_end = _root_only("on_train_end")
    del _root_only


def _keras_backups(model, bound):
    """Keras' ``BackupAndRestore`` callbacks in ``fit``'s bound arguments, handled:
    refused before any training on a model whose ranks hold parts (its
    ``save_weights`` would write one rank's part), run by :class:`RootBackup`
    on a model of plain layers (``d``) in a multi-process job."""
    callbacks = bound.arguments.get("callbacks")
    if callbacks is None or isinstance(callbacks, keras.callbacks.CallbackList):
        return
    found = [cb for cb in callbacks if isinstance(cb, keras.callbacks.BackupAndRestore)]
    if not found or runtime.current_grid().size == 1:
        return
    if _holds_shards(model):
        backup_dir = str(found[0].backup_dir)
        last = os.path.join(backup_dir, "last.keras")
        raise ValueError(
            f"keras.callbacks.BackupAndRestore({backup_dir!r}) would back up transformed model "
            f"{model.name!r} with Keras' model.save_weights(), which writes only this rank's "
            "part of its split layers. Use tfhybrid.callbacks.Checkpoint("
            f"{last!r}, every_n_steps=...) in fit instead (every rank runs it; rank 0 writes "
            "the full weights and optimizer state) and, when the job restarts, "
            f"model = tfhybrid.load({last!r}) (it re-transforms and compiles the model, and "
            "its fit resumes at the saved epoch and step, on any world size).")
    bound.arguments["callbacks"] = [RootBackup(cb) if cb in found else cb for cb in callbacks]


def drop_validation_iterator(model):
    """Free the validation iterator Keras' ``fit`` caches on the model
    (``_eval_epoch_iterator``) when ``fit`` ended by an exception.

    Keras deletes it after the last epoch; a ``fit`` that raised (a guard's
    ``ConsistencyError`` at the first validation batch, a callback, Ctrl-C)
    left it on the model with its ``tf.data`` threads. Transformed models sit
    in reference cycles (their instance-level wrappers), so the iterator
    lived until a later garbage collection took the model, at any point of
    the script, where freeing it joins those threads. Dropped here, it goes
    with the exception (whose traceback may still hold Keras' frames), no
    longer with the model."""
    if getattr(model, "_eval_epoch_iterator", None) is not None:
        model._eval_epoch_iterator = None


def _call_with_callbacks(method, model, args, kwargs, extra):
    bound, callbacks = _callbacks_arg(method, model, args, kwargs)
    if not isinstance(callbacks, keras.callbacks.CallbackList):
        refuse_horovod_callbacks(callbacks)
    _quiet_other_ranks(bound)
    # fit's validation passes its own CallbackList (which holds fit's watchdog): keep it.
    if not isinstance(callbacks, keras.callbacks.CallbackList):
        bound.arguments["callbacks"] = _root_log_writers(list(callbacks or [])) + extra
    return method(*bound.args, **bound.kwargs)


#: Keras callbacks that write the logs to files: rank 0's alone.
LOG_WRITERS = (keras.callbacks.CSVLogger, keras.callbacks.TensorBoard)


def _root_log_writers(callbacks):
    """``callbacks`` without Keras' ``CSVLogger``/``TensorBoard`` on ranks other
    than global rank 0 (Horovod's rule: logs on rank 0 only). The logs are the
    global batch's on every rank; every rank wrote them: one CSV opened by
    every process, and one TensorBoard event file per rank in one run
    directory, each epoch plotted once per rank."""
    if runtime.current_grid().rank == 0:
        return callbacks
    return [cb for cb in callbacks if not isinstance(cb, LOG_WRITERS)]


def _quiet_other_ranks(bound):
    """``verbose=0`` on every rank but global rank 0 when the script left
    ``verbose`` at Keras' default ("auto": a progress bar): the logs are the
    global batch's on every rank, so the other ranks' bars repeat rank 0's,
    interleaved (one per rank at 64 ranks). An explicit ``verbose`` is kept
    (Horovod's ``verbose=1 if hvd.rank() == 0 else 0`` works as before)."""
    if "verbose" not in bound.arguments and runtime.current_grid().rank != 0:
        bound.arguments["verbose"] = 0


def metric_ranks(model):
    """The ranks whose metric states together cover each global batch once.

    With the batch split over the data axis, the ranks of a model group
    compute on the same rows: one member per model group (this rank's data
    group) covers the batch once. With a world split every rank holds its
    own rows: the world. With outputs split into spatial blocks every rank
    holds its own voxels: the world (metrics of values replicated in a
    model group, such as the loss, are means and unchanged by the sum).
    """
    grid = runtime.current_grid()
    if getattr(model, "_tfhybrid_batch_split", "data") == "world":
        return tuple(range(grid.size))
    if any(getattr(model, "_tfhybrid_split_outputs", ())):   # per-voxel blocks: every rank
        return tuple(range(grid.size))
    return tuple(grid.data_group_ranks(grid.model_rank))


def sum_metric_states(model):
    """Sum every metric variable of ``model`` over :func:`metric_ranks` (collective).

    Keras metrics keep additive states (Mean: total and count; accuracy,
    precision, AUC: counts), so after the sum each ``metric.result()`` is the
    metric of the rows of every rank, as one process evaluating the whole
    data set computes it (float64 sums, then the variables' own dtype).
    The states stay summed until the next ``reset_metrics``. A custom metric
    whose state is not a sum (a maximum, a last value) would be wrong: use
    ``Config(average_metrics=False)`` and reduce it yourself.

    Example:
        >>> tfhybrid.guards.sum_metric_states(model)   # custom evaluation loops
        >>> {m.name: float(m.result()) for m in model.metrics}
    """
    ranks = metric_ranks(model)
    variables = [v for v in model.metrics_variables
                 if v.dtype in ("float16", "bfloat16", "float32", "float64", "int32", "int64")]
    if len(ranks) < 2 or not variables:
        return
    if runtime.current_grid().model_rank != 0:
        # metrics of a replicated output beside split ones (every rank of a model
        # group holds the same rows): counted once, by the model group's first rank
        for v in _replicated_output_metric_variables(model):
            v.assign(tf.zeros_like(v))
    sum_variables(variables, ranks, "metric_states.sum", copies=row_copies(model))


def _replicated_output_metric_variables(model):
    """Metric variables of the outputs that are not split when others are
    (a classification head beside a per-voxel one)."""
    flags = getattr(model, "_tfhybrid_split_outputs", ())
    compiled = getattr(model, "_compile_metrics", None)
    if not any(flags) or all(flags) or compiled is None or not compiled.built:
        return []
    out = []
    for group in (compiled._flat_metrics, compiled._flat_weighted_metrics):
        for split, entry in zip(flags, group):
            if split or entry is None:
                continue
            for m in getattr(entry, "metrics", [entry]):
                out.extend(m.variables)
    return out


def sum_variables(variables, ranks, name, contribute=True, copies=1):
    """Replace each variable by its sum over ``ranks`` (collective; float64 sums,
    rounded for integer variables). ``contribute=False``: this rank adds zeros.
    ``copies``: each rank's rows were fed by that many ranks; the sum counts them once."""
    from tfhybrid.comm import backend

    flat = tf.concat([tf.reshape(tf.cast(v.value, tf.float64), [-1]) for v in variables], 0)
    if not contribute:
        flat = tf.zeros_like(flat)
    total = backend.allreduce(flat, ranks, name).numpy()
    if copies > 1:
        total = total / copies
    start = 0
    for v in variables:
        n = int(np.prod(v.shape))
        value = total[start:start + n].reshape(tuple(v.shape))
        if "int" in str(v.dtype):
            value = np.rint(value)
        v.assign(value.astype(str(v.dtype)))
        start += n


def _average_step_logs(logs, ranks):
    """Average the scalar logs of a custom ``test_step`` over ``ranks`` (collective)."""
    from tfhybrid.comm import backend

    keys = sorted(k for k, v in logs.items() if np.ndim(v) == 0)
    if len(ranks) < 2 or not keys:
        return logs
    values = tf.constant([float(logs[k]) for k in keys], tf.float64)
    mean = backend.allreduce(values, ranks, "metric_states.logs", average=True).numpy()
    return {**logs, **{k: float(v) for k, v in zip(keys, mean)}}


def summary_note(model) -> str:
    """The line ``model.summary()`` adds: the counts above are this rank's.

    Local, not collective (``summary`` is often called on rank 0 only): the
    full size is estimated from the blocks' layouts (sharded blocks x model
    group size); ``tfhybrid.gather(model).summary()`` prints the exact counts.
    """
    grid = runtime.current_grid()
    info = getattr(model, "_tfhybrid_transform", None)
    strategy = getattr(getattr(info, "plan", None), "strategy", "?")
    local = sharded = 0
    for v in model.weights:
        n = int(np.prod(v.shape))
        local += n
        if layout_of(v).kind == "sharded":
            sharded += n
    full = local + sharded * (grid.model_size - 1)
    text = (f"tfhybrid: the parameter counts above are global rank {grid.rank}'s "
            f"(of {grid.size}; strategy {strategy!r}, grid {grid.data_size} data x "
            f"{grid.model_size} model)")
    if sharded:
        text += (f": {sharded:,} of its {local:,} parameters are its blocks of weights "
                 f"sharded over its model group; the full model has about {full:,} "
                 "(tfhybrid.gather(model).summary() prints the exact counts).")
    else:
        text += f": every weight is whole on every rank ({local:,} parameters)."
    return text


def _watchdog_callbacks():
    """The watchdog's callback, when the watchdog runs (multi-process jobs): in
    one process, or with the watchdog off, its per-step hooks would do nothing."""
    from tfhybrid import watchdog

    return [watchdog.WatchdogCallback()] if watchdog.get().enabled else []


def _loss_scale_inside(model, optimizer, auto_scale_loss) -> bool:
    """Put mixed_float16's dynamic loss scaling *inside* a DistributedOptimizer.

    Keras' compile wraps the optimizer in a ``LossScaleOptimizer`` under the
    ``mixed_float16`` policy, which would then check each rank's *local*
    gradients for inf/NaN and skip the step (and with it the gradient
    allreduce inside the DistributedOptimizer) on the ranks that overflowed
    only: the others would wait in that allreduce forever. With the loss
    scaler inside (``DistributedOptimizer(LossScaleOptimizer(opt))``) it sees the
    reduced gradients, the same on every rank, as under ``tf.distribute``.

    Returns True when it moved the scaler inside (compile must then pass
    ``auto_scale_loss=False``).
    """
    from tfhybrid.optimizer import DistributedOptimizer

    if not (auto_scale_loss and model.dtype_policy.name == "mixed_float16"
            and isinstance(optimizer, DistributedOptimizer)):
        return False
    if not isinstance(optimizer.inner_optimizer, keras.optimizers.LossScaleOptimizer):
        if optimizer.built:
            return False            # slots exist: leave Keras' arrangement alone
        optimizer.inner_optimizer = keras.optimizers.LossScaleOptimizer(
            optimizer.inner_optimizer, name="loss_scale_optimizer")
    return True


def _from_horovod_keras(obj) -> bool:
    return type(obj).__module__.startswith("horovod.")


def refuse_horovod_optimizer(optimizer):
    """Horovod's Keras ``DistributedOptimizer`` is written for tf.keras 2 (it
    failed inside ``fit`` with "'list' object is not callable" under Keras 3)
    and averages every gradient over the world, which is wrong for the blocks
    of split layers."""
    if _from_horovod_keras(optimizer):
        inner = next((c.__name__ for c in type(optimizer).__mro__[1:]
                      if not c.__module__.startswith("horovod")), "the optimizer")
        raise ValueError(
            f"Received horovod.tensorflow.keras.DistributedOptimizer ({inner}) for a model "
            "returned by tfhybrid.transform. Horovod 0.28's Keras optimizer does not run with "
            "Keras 3 optimizers, and it would average the gradients of split layers' blocks "
            f"over every rank. Use tfhybrid.DistributedOptimizer(keras.optimizers.{inner}(...)) "
            "(it takes Horovod's compression, backward_passes_per_step and op options).")


def carry_weight_decay_exclusions(model, optimizer):
    """Translate ``optimizer.exclude_from_weight_decay(var_list=...)`` given the
    variables of the model before ``transform`` to ``model``'s variables.

    Keras keys the excluded variables by object (the TF variable's unique id):
    the transformed model's variables are new objects, so the exclusion
    would silently match nothing and decay what the script excluded. Each
    excluded variable of the
    source model maps to the variable of the same path here (under p/ls a
    variable another rank holds maps to nothing on this rank).

    Raises:
        ValueError: an excluded variable belongs to neither model.
    """
    from tfhybrid.checkpoint import keras_optimizer

    inner = keras_optimizer(optimizer)
    ids = getattr(inner, "_exclude_from_weight_decay", None)
    if not ids or getattr(inner, "built", False):
        return
    key = inner._var_key            # Keras' key of a variable (the TF variable's unique id)
    own = {key(v) for v in model.variables}
    foreign = set(ids) - own
    if not foreign:
        return
    source = {}
    for ref, path in getattr(model, "_tfhybrid_source_variables", ()):
        variable = ref()
        if variable is not None:
            source[key(variable)] = path
    by_path = {v.path: v for v in model.variables}
    mapped, unknown = set(ids) & own, 0
    for k in foreign:
        if k not in source:
            unknown += 1
        elif source[k] in by_path:
            mapped.add(key(by_path[source[k]]))
    if unknown:
        raise ValueError(
            f"The optimizer excludes {unknown} variable(s) from weight decay "
            "(exclude_from_weight_decay(var_list=...)) that belong neither to the model "
            f"{model.name!r} nor to the model it was transformed from. Keras matches them by "
            "object: build the optimizer from this model's variables, e.g. "
            "opt.exclude_from_weight_decay(var_list=[v for v in model.trainable_variables "
            "if 'bias' in v.path]), or use var_names=[...].")
    inner._exclude_from_weight_decay = mapped
    inner._exclude_from_weight_decay_cache = {}


def follow_source_flags(model):
    """Copy ``trainable`` flags changed on the layers of the model before
    ``transform`` since then onto ``model``'s layers of the same name.

    Transfer learning scripts keep a handle on the base (``base_model =
    keras.applications.ResNet50(...)``) and unfreeze it with
    ``base_model.trainable = True`` before recompiling: the transformed model
    holds copies of those layers, so the change silently did nothing (the
    base stayed frozen). Called at each compile of the transformed model (Keras
    asks for a compile after changing ``trainable``). Flags set on ``model``'s
    own layers are kept unless the source layer changed too. Under p, the
    layers of other stages are changed on their own ranks.
    """
    layers = getattr(model, "_tfhybrid_source_layers", None)
    if not layers:
        return
    local = getattr(model, "local_layer_names", None)
    changed = []
    for name, record in layers.items():
        ref, flag = record
        source = ref()
        if source is None or source.trainable == flag:
            continue
        record[1] = source.trainable
        if local is not None and name not in local:
            continue
        try:
            target = model.get_layer(name)
        except ValueError:
            continue
        target.trainable = source.trainable
        changed.append(name)
    if changed and runtime.is_root():
        warnings.warn(
            f"tfhybrid: {len(changed)} layer(s) of the model before tfhybrid.transform changed "
            f"'trainable' since transform ({', '.join(changed[:4])}"
            f"{', ...' if len(changed) > 4 else ''}); the transformed model follows them at "
            "this compile.", stacklevel=3)


# DistributedOptimizer options with their defaults, and what p/ls users do instead:
# p and ls reduce their stage's/part's gradients in their own step (a plain
# average over the data-parallel replicas) and apply the inner optimizer.
_PART_OPTIONS = (
    ("backward_passes_per_step", 1, "pass gradient_accumulation_steps=k to the Keras optimizer "
     "instead (keras.optimizers.SGD(..., gradient_accumulation_steps=k)): it runs under p/ls "
     "and equals one process"),
    ("op", "average", "keep op='average' and scale the learning rate"),
    ("compression", "none", "pass compression='none' (p/ls send gradients uncompressed)"),
    ("replicate_fc_gradients", 0, "drop the option (it applies to d/f/c/df models)"),
    ("delay_fc_update", False, "drop the option (it applies to d/f/c/df models)"),
)


def refuse_part_options(optimizer, strategy):
    """``p``/``ls`` models apply their own gradient step: a DistributedOptimizer
    option that changes the numbers there (``backward_passes_per_step``, ``op``,
    ``compression``, the FC options) would be ignored silently, so it is
    refused at compile."""
    for name, default, fix in _PART_OPTIONS:
        value = getattr(optimizer, name, default)
        if value != default:
            raise ValueError(
                f"Received tfhybrid.DistributedOptimizer({name}={value!r}) for a model of "
                f"strategy {strategy!r}: {strategy!r} reduces gradients in its own step and "
                f"does not apply {name}. To fix: {fix}.")


def refuse_horovod_callbacks(callbacks):
    """Horovod's Keras callbacks expect tf.keras 2 variables (its broadcast failed
    with "'Variable' object has no attribute 'ref'") and know nothing of split
    layers; tfhybrid.callbacks has each of them, layout-aware."""
    import tfhybrid.callbacks as ours

    for cb in callbacks or ():
        if _from_horovod_keras(cb):
            name = type(cb).__name__
            fix = (f"tfhybrid.callbacks.{name}(...) (same arguments)" if hasattr(ours, name)
                   else "tfhybrid.callbacks.standard() for the broadcast and metric averaging")
            raise ValueError(
                f"Received Horovod's Keras callback {name} for a model returned by "
                "tfhybrid.transform. Horovod 0.28's Keras callbacks do not run with Keras 3 "
                f"variables and know nothing of split layers. Use {fix}.")


def _wrap_optimizer(optimizer):
    from tfhybrid.optimizer import DistributedOptimizer

    refuse_horovod_optimizer(optimizer)

    if isinstance(optimizer, DistributedOptimizer):
        optimizer.replicas_checked = True     # the guards compare and broadcast at fit
        return optimizer
    if runtime.current_grid().size == 1:
        return optimizer
    wrapped = DistributedOptimizer(optimizer)
    wrapped.replicas_checked = True
    if runtime.is_root():
        warnings.warn(
            f"tfhybrid: the transformed model was compiled with a plain "
            f"{type(wrapped.inner_optimizer).__name__} optimizer, which does not reduce "
            "gradients across ranks (replicas would drift apart); it was wrapped in "
            "tfhybrid.DistributedOptimizer. Wrap it yourself to choose bucket_bytes, "
            "compression, etc.", stacklevel=3)
    return wrapped


_EVAL_HINT = ("model.{0}() of a transformed model is collective (its layers exchange "
              "activations and the metrics are averaged): every rank must call it, each on its "
              "shard of the data (tfhybrid.data.shard(..., model=model)); called under `if "
              "tfhybrid.is_root():` it leaves rank 0 waiting here for ranks that never come. "
              "To evaluate on one process, evaluate tfhybrid.gather(model) there (gather on "
              "every rank).")


def _holds_shards(model) -> bool:
    """Whether a transformed model holds tfhybrid layers (split weights, or layers
    that exchange activations), or is one rank's part of the model (a pipeline
    stage, an ``ls`` worker), so that Keras' own save/load would see only this
    rank's part. A model of plain Keras layers (``d``, or nothing split) does not."""
    if getattr(model, "_tfhybrid_part", False):
        return True
    return any(type(layer).__module__.startswith("tfhybrid.")
               for layer in model._flatten_layers(include_self=False, recursive=True))


_SAVE_FIX = ("Use tfhybrid.save(model, path) on every rank (rank 0 writes a plain .keras "
             "file of the full weights, loadable by keras.saving.load_model, and the "
             "optimizer state beside it), or tfhybrid.gather(model) on every rank and save "
             "that full model ({}), or tfhybrid.save(model, directory, sharded=True) for "
             "per-rank files.")


@contextlib.contextmanager
def after_reading(data):
    """A context in which every op of a step waits for the step's batch ``data``.

    Keras' loss tracker and ratio metrics add the batch's row count to their
    ``count`` state, and with a static batch size that count is a constant
    (``tf.shape`` of a fully known shape), so its ``assign_add`` depends on
    nothing the step reads. When a dataset of unknown length ends, the step
    function is called once more and its ``get_next`` raises
    ``OutOfRangeError`` (Keras' end-of-epoch signal), yet the constant
    ``assign_add`` may already have run: every loss and metric of the pass
    (fit's epoch logs, validation, evaluate) then comes out ``n / (n + 1)``
    of its value over ``n`` batches (under Keras 3.15.1 / TF 2.18.1, in one
    process too). Inside this context every op of
    the step, constants included, runs only after the batch was read, so the
    end-of-data call changes no state. Eager steps need no ordering (a no-op).
    Variables the step creates (metrics built at their first update) are
    created outside the context: their initial values are lifted out of the
    traced step and must not depend on its input.
    """
    if tf.executing_eagerly():
        yield
        return

    def without_dependencies(next_creator, **kwargs):
        with tf.control_dependencies(None):
            return next_creator(**kwargs)

    with tf.variable_creator_scope(without_dependencies), tf.control_dependencies(
            [t for t in tf.nest.flatten(data, expand_composites=True) if tf.is_tensor(t)]):
        yield


def install(model, part=False):
    """Make transformed ``model``'s compile/fit/evaluate/predict run the guards.

    Instance-level wrappers (the class and serialization are unchanged);
    idempotent.

    ``part=True``: a model whose ranks run different layers with their own
    train step and reductions (``p``, ``ls``): the ranks' structures and
    weights differ by design, so the consistency checks, the optimizer
    wrapping and the lean train function are not installed; fit, evaluate
    and predict still get the watchdog and the collective-call hints, fit its
    ``ModelCheckpoint`` and ``shuffle`` handling, and Keras' save/load refuse
    with the tfhybrid way to do it.
    """
    if getattr(model, "_tfhybrid_guarded", False):
        return model
    cls = type(model)
    checksum = tf.Variable(0.0, dtype=tf.float64, trainable=False, name="tfhybrid_batch_checksum")
    # True before the steps whose batch the GuardCallback compares (set by it):
    # the traced step skips the checksum's work on the other steps.
    due = tf.Variable(True, trainable=False, name="tfhybrid_batch_checksum_due")
    # True before the steps whose weights the GuardCallback compares: the traced
    # step gathers the checksums itself (gather_step_sums)
    weights_due = tf.Variable(False, trainable=False, name="tfhybrid_weight_checksums_due")
    # True for the first step of an evaluate whose rows are compared (EvaluateRows)
    evaluate_due = tf.Variable(False, trainable=False, name="tfhybrid_evaluate_checksum_due")
    # ranks of a row-block group feeding the very same rows (batch_losses' sum)
    copies = tf.Variable(1.0, trainable=False, name="tfhybrid_row_copies")
    # set by fit's start check when the ranks' blocks of a step may hold unequal
    # rows: train_step then weighs each block by its rows (batch_losses)
    weighting = tf.Variable(False, trainable=False, name="tfhybrid_row_weighting")

    def compile(self, *args, **kwargs):   # noqa: A001 - Keras' name
        bound = inspect.signature(cls.compile).bind(self, *args, **kwargs)
        bound.arguments["optimizer"] = _wrap_optimizer(bound.arguments.get("optimizer",
                                                                            "rmsprop"))
        follow_source_flags(self)
        carry_weight_decay_exclusions(self, bound.arguments["optimizer"])
        if _loss_scale_inside(self, bound.arguments["optimizer"],
                              bound.arguments.get("auto_scale_loss", True)):
            bound.arguments["auto_scale_loss"] = False     # done: no second LossScaleOptimizer
        return cls.compile(*bound.args, **bound.kwargs)

    def part_compile(self, *args, **kwargs):
        # p/ls apply their own optimizer step (no wrapping), but Horovod's Keras
        # optimizer fails inside their step as it does in Keras'.
        bound = inspect.signature(cls.compile).bind(self, *args, **kwargs)
        optimizer = bound.arguments.get("optimizer")
        refuse_horovod_optimizer(optimizer)
        from tfhybrid.optimizer import DistributedOptimizer

        if isinstance(optimizer, DistributedOptimizer):
            refuse_part_options(optimizer, "ls" if hasattr(self, "fc_part") else "p")
        follow_source_flags(self)
        if optimizer is not None and not isinstance(optimizer, str):
            carry_weight_decay_exclusions(self, optimizer)
        return cls.compile(*bound.args, **bound.kwargs)

    keras_compute_loss = model.compute_loss     # a split-output wrapper, or Keras'

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        loss = keras_compute_loss(x, y, y_pred, sample_weight, training=training)
        return batch_losses.whole_regularization(self, loss)

    def train_step(self, data):
        data = full_labels_to_blocks(self, data)     # fit(x, y) with whole-volume labels
        batch_losses.wrap(self)                      # reduction="sum" losses: x row blocks
        batch_losses.wrap_metrics(self)              # batch-level metric functions: whole
        # Only where ranks of a model group must feed the same rows (nothing to
        # compare otherwise: pure data parallelism, one process), and only on
        # the steps the GuardCallback checks.
        with after_reading(data):
            if _config().guards and _batch_checksummed(self):
                # split labels (per-voxel outputs under s/ds) differ within a model group
                split = (any(getattr(self, "_tfhybrid_split_outputs", ()))
                         and isinstance(data, tuple))
                rows = data[0] if split else data
                checksum.assign(tf.cond(due, lambda: batch_checksum(rows), checksum.read_value))
            with batch_losses.weighted_rows(self, batch_losses.rows_factor(self, data,
                                                                            weighting)):
                logs = cls.train_step(self, data)
            if _config().guards and runtime.current_grid().size > 1:
                gather_step_sums(self, checksum, weights_due)
        return logs

    def test_step(self, data):
        batch_losses.wrap(self)
        batch_losses.wrap_metrics(self)
        data = full_labels_to_blocks(self, data)
        with after_reading(data):
            if _config().guards and _data_replicas_checked(self):     # EvaluateRows' batch
                split = (any(getattr(self, "_tfhybrid_split_outputs", ()))
                         and isinstance(data, tuple))
                rows = data[0] if split else data
                checksum.assign(tf.cond(evaluate_due, lambda: batch_checksum(rows),
                                        checksum.read_value))
            with batch_losses.weighted_rows(self, batch_losses.rows_factor(self, data,
                                                                            weighting)):
                return cls.test_step(self, data)

    def part_step(keras_step):
        """p/ls: the batch checksum of the steps :class:`PartRows` compares."""
        def step(self, data):
            with after_reading(data):
                rows = part_rows(self) if _config().guards else None
                if rows is not None:
                    position = tf.constant(rows[0], tf.int32)
                    checksum.assign(tf.cond(due, lambda: batch_checksum(data, position),
                                            checksum.read_value))
                return keras_step(self, data)
        return step

    def fit(self, *args, **kwargs):
        bound = _keras_signature(cls.fit).bind(self, *args, **kwargs)
        _keras_checkpoints(self, bound)          # may raise: before any collective
        _keras_backups(self, bound)              # may raise: before any collective
        _quiet_shuffle(bound)
        object.__setattr__(self, "_tfhybrid_broadcast_in_fit", False)   # set by the callback
        extra = _watchdog_callbacks()
        config = _config()
        object.__setattr__(self, "_tfhybrid_start_check", None)
        object.__setattr__(self, "_tfhybrid_validation_copies", None)
        if config.guards and runtime.current_grid().size > 1 and not part:   # 1 process: no peers
            set_row_copies(self, 1)      # until the inputs are compared
            check = StartCheck(self, planned_steps(bound.arguments, "steps_per_epoch"),
                               _fit_fingerprints(bound.arguments),
                               local_blocks(bound.arguments))
            if _broadcasts(bound.arguments.get("callbacks")):
                # rides in the broadcast callback's allgather, before its broadcasts
                # (the GuardCallback runs it if that callback does not)
                object.__setattr__(self, "_tfhybrid_start_check", check)
            else:       # before the first collective of the fit
                check.run_alone()
            step_sums_variable(self)
            extra.append(GuardCallback(checksum, config.guard_every_steps, due, weights_due))
        if config.guards and runtime.current_grid().size > 1 and not part:
            extra.append(EvaluateRows(checksum, evaluate_due))   # validation on a dataset
        if part and config.guards and part_rows(self) is not None:
            extra.append(PartRows(checksum, due))     # each part fed the rows it needs
        if runtime.current_grid().size > 1:
            extra.append(AgreeOnStop())          # last: after every callback's on_epoch_end
        try:
            return _call_with_callbacks(cls.fit, self, bound.args[1:], bound.kwargs, extra)
        finally:
            set_row_copies(self, 1)              # this fit's inputs only
            set_row_weighting(self, False)
            drop_validation_iterator(self)

    @collective_api("model.evaluate", _EVAL_HINT.format("evaluate"))
    def evaluate(self, *args, **kwargs):
        bound = _keras_signature(cls.evaluate).bind(self, *args, **kwargs)
        in_fit = isinstance(bound.arguments.get("callbacks"), keras.callbacks.CallbackList)
        compare = (_config().guards and not part and runtime.current_grid().size > 1
                   and _data_replicas_checked(self))
        fit_copies, fit_weighting = row_copies(self), row_weighting(self)
        extra = _watchdog_callbacks()
        if _config().guards and not part and not in_fit:      # fit's validation: fit checked
            copies = check_steps(self, planned_steps(bound.arguments, "steps"), "evaluate",
                                 input_fingerprint(bound.arguments.get("x"),
                                                   bound.arguments.get("y")) if compare else None,
                                 local_blocks(bound.arguments) if compare else None)
        else:
            copies = getattr(self, "_tfhybrid_validation_copies", None) if compare else None
        object.__setattr__(self, "_tfhybrid_rows_unknown", compare and copies is None)
        if compare:
            set_row_copies(self, copies or 1)
            if copies is None and not in_fit:   # a dataset: its first batch tells (fit
                extra.append(EvaluateRows(checksum, evaluate_due))   # lists its own)
            elif copies is not None and copies > 1:
                _warn_copies(self, copies, "in evaluate")
        if part and not in_fit and _config().guards and part_rows(self) is not None:
            extra.append(PartRows(checksum, due))     # fit's validation: fit's callback
        outer = getattr(self, "_tfhybrid_evaluating", False)
        object.__setattr__(self, "_tfhybrid_evaluating", True)
        try:
            return _call_with_callbacks(cls.evaluate, self, args, kwargs, extra)
        finally:
            object.__setattr__(self, "_tfhybrid_evaluating", outer)
            if compare:
                set_row_copies(self, fit_copies)    # a callback's evaluate inside fit too
                set_row_weighting(self, fit_weighting)

    def _get_metrics_result_or_logs(self, logs):
        # Called eagerly, on every rank, at the end of evaluate and of each fit
        # epoch (before validation and the callbacks): the epoch's train logs
        # become the global batch's (before: each rank's own rows, so that
        # EarlyStopping/ReduceLROnPlateau on "loss" decided per rank).
        if not (tf.executing_eagerly() and _config().average_metrics
                and runtime.current_grid().size > 1):
            return cls._get_metrics_result_or_logs(self, logs)
        object.__setattr__(self, "_tfhybrid_logs_global", True)   # MetricAverageCallback
        sum_metric_states(self)
        out = cls._get_metrics_result_or_logs(self, logs)
        if out is logs and isinstance(logs, dict):   # custom test_step: its own logs
            out = _average_step_logs(logs, metric_ranks(self))
        return out

    def on_batch(name):
        """Keras' ``train_on_batch``/``test_on_batch`` with the batch's logs of the
        global batch, as one process computes them (Keras resets the metrics
        before the step, so summing the states gives that batch's), not each
        rank's own rows' loss and metrics."""
        keras_method = getattr(cls, name)

        def method(self, *args, **kwargs):
            bound = _keras_signature(keras_method).bind(self, *args, **kwargs)
            return_dict = bound.arguments.get("return_dict", False)
            bound.arguments["return_dict"] = True
            logs = keras_method(*bound.args, **bound.kwargs)
            if _config().average_metrics and runtime.current_grid().size > 1:
                logs = {k: float(np.asarray(v)) if np.ndim(v) == 0 else np.asarray(v)
                        for k, v in self._get_metrics_result_or_logs(logs).items()}
            return logs if return_dict else self._flatten_metrics_in_order(logs)
        return collective_api(f"model.{name}", _EVAL_HINT.format(name))(method)

    train_on_batch = on_batch("train_on_batch")
    test_on_batch = on_batch("test_on_batch")

    def summary(self, *args, **kwargs):
        bound = inspect.signature(cls.summary).bind(self, *args, **kwargs)
        out = cls.summary(*bound.args, **bound.kwargs)
        print_fn = bound.arguments.get("print_fn")
        note = summary_note(self)
        (print_fn or print)(note)     # Keras calls print_fn(text) the same way
        return out

    @collective_api("model.predict", _EVAL_HINT.format("predict"))
    def predict(self, *args, **kwargs):
        out = _call_with_callbacks(cls.predict, self, args, kwargs, _watchdog_callbacks())
        # whole volumes, as one process predicts them (s/ds outputs stay in blocks)
        return whole_predictions(self, out) if not part else out

    def make_train_function(self, force=False):
        if self.train_function is not None and not force:
            return self.train_function
        cls.make_train_function(self, force=force)
        self.train_function = lean_train_function(self, self.train_function)
        return self.train_function

    def refusing_shards(name, problem, fix):
        """Keras' ``name`` unchanged on a model of plain layers; on split layers a
        ValueError naming ``problem`` and ``fix`` instead of one rank's shards."""
        keras_method = getattr(cls, name)

        def method(self, *args, **kwargs):
            if _holds_shards(self):
                raise ValueError(f"model.{name}() {problem.format(self.name)} {fix}")
            return keras_method(self, *args, **kwargs)
        return method

    save = refusing_shards(
        "save", "of transformed model {!r} would write only this rank's part of its split "
        "layers, in tfhybrid layers that need this process grid to load.",
        _SAVE_FIX.format("e.g. full.save(path) on rank 0"))
    save_weights = refusing_shards(
        "save_weights", "of transformed model {!r} would write only this rank's part of its "
        "split layers.", _SAVE_FIX.format("e.g. full.save_weights(path) on rank 0"))
    load_weights = refusing_shards(
        "load_weights", "into transformed model {!r}: its split layers hold this rank's part "
        "of each weight, so a weights file of the full model does not fit them.",
        "Load full weights into the original model before tfhybrid.transform (it copies "
        "them; loading on rank 0 only is enough: transform broadcasts them), or resume a "
        "tfhybrid checkpoint with tfhybrid.load(path).")

    methods = [("compile", compile), ("compute_loss", compute_loss),
               ("train_step", train_step), ("test_step", test_step),
               ("fit", fit),
               ("make_train_function", make_train_function),
               ("evaluate", evaluate), ("predict", predict), ("summary", summary),
               ("train_on_batch", train_on_batch), ("test_on_batch", test_on_batch),
               ("save", save), ("save_weights", save_weights), ("load_weights", load_weights)]
    if hasattr(cls, "_get_metrics_result_or_logs"):    # Keras 3 trainers (3.0 .. 3.15)
        methods.append(("_get_metrics_result_or_logs", _get_metrics_result_or_logs))
    if part:     # p/ls: their own steps, reductions and metrics
        keep = ("fit", "evaluate", "predict", "save", "save_weights", "load_weights")
        methods = [(name, fn) for name, fn in methods if name in keep]
        methods += [("compile", part_compile), ("train_step", part_step(cls.train_step)),
                    ("test_step", part_step(cls.test_step))]
        object.__setattr__(model, "_tfhybrid_part", True)
    for name, fn in methods:
        object.__setattr__(model, name, types.MethodType(fn, model))
    object.__setattr__(model, "_tfhybrid_batch_checksum", checksum)
    object.__setattr__(model, "_tfhybrid_batch_checksum_due", due)
    if not part:
        object.__setattr__(model, "_tfhybrid_row_copies", copies)
        object.__setattr__(model, "_tfhybrid_row_weighting", weighting)
    object.__setattr__(model, "_tfhybrid_guarded", True)
    return model


def lean_train_function(model, keras_function):
    """``fit``'s train function for a transformed model: one ``tf.function``
    that reads the next batch and runs ``train_step`` on it.

    Keras 3 (``steps_per_execution=1``) wraps the same step in an outer
    function returning a ``tf.experimental.Optional`` and then runs two eager
    ops per step (``has_value``, ``get_value``) on it, a cost a small CNN's
    data-parallel step notices. The step itself is
    the same ``train_step`` (bit-identical weights); an exhausted iterator
    raises ``OutOfRangeError``, which Keras' epoch loop treats as the end of
    the data, as it does for its own function. Keras' function is kept
    (returned unchanged) for eager runs, ``steps_per_execution > 1``, XLA
    (the batch is read outside the compiled step), a ``tf.distribute``
    strategy, and any iterator that is not a ``tf.data`` iterator.
    """
    if (model.run_eagerly or model.steps_per_execution != 1 or model.jit_compile
            or tf.distribute.has_strategy() or keras_function is None):
        return keras_function

    @tf.autograph.experimental.do_not_convert
    def one_step_on_iterator(iterator):
        return model.train_step(iterator.get_next())

    step = tf.function(one_step_on_iterator, reduce_retracing=True, jit_compile=False)
    # The epoch's iterator and its traced step: calling the concrete function skips
    # the polymorphic dispatch (the iterator's type spec canonicalised and hashed
    # on every call). A new iterator (next epoch or
    # fit) looks the step up again, so a new element spec still retraces.
    epoch = {"iterator": None, "step": None}

    def function(iterator):
        if not isinstance(iterator, tf.data.Iterator):
            return keras_function(iterator)
        seen = epoch["iterator"]
        if seen is None or seen() is not iterator:
            # An iterator's first step runs through the tf.function's own call, as
            # Keras' function does: it creates the variables the first trace makes
            # (metrics built at their first update) and, when an initial value
            # depends on the batch (made inside the step, after reading it), falls
            # back to initialising it inside the step. get_concrete_function alone
            # would raise UnliftableError there; after this call it only looks up
            # the step that creates no variables.
            logs = step(iterator)
            epoch["step"] = _flat_caller(step.get_concrete_function(iterator), iterator)
            epoch["iterator"] = weakref.ref(iterator)
            return logs
        return epoch["step"]()

    return function


def _flat_caller(concrete, iterator):
    """A call of ``concrete`` on ``iterator`` with its one flat input, the
    iterator's resource handle (checked once here against the traced signature).

    ``ConcreteFunction.__call__`` binds and type-checks the structured
    arguments on every call (the iterator's spec canonicalised and cast);
    ``_call_flat`` with the same flat tensors runs the same function (TF
    2.18). Where this TensorFlow has no such entry point, or the iterator
    does not flatten to one resource tensor, the structured call is kept.
    """
    call_flat = getattr(concrete, "_call_flat", None)
    handle = getattr(iterator, "_iterator_resource", None)
    try:
        flat = concrete.function_type.unpack_inputs(
            concrete.function_type.bind(iterator))
    except Exception:  # noqa: BLE001 (any other signature: the public call)
        flat = None
    if (call_flat is None or handle is None or flat is None or len(flat) != 1
            or flat[0] is not handle):
        return lambda: concrete(iterator)
    captured = concrete.captured_inputs
    return lambda: call_flat([handle], captured)


def set_consistent_seed():
    """Set TensorFlow's global seed to one broadcast from rank 0, unless the
    script set one (collective; called by :func:`tfhybrid.init`)."""
    from tensorflow.python.eager import context

    from tfhybrid.comm import backend

    if backend.size() == 1 or context.global_seed() is not None:
        return
    seed = tf.constant([np.random.SeedSequence().entropy % (2**31 - 1)], tf.int64)
    seed = int(backend.broadcast(seed, 0, tuple(range(backend.size())), "guard.seed").numpy()[0])
    tf.random.set_seed(seed)
