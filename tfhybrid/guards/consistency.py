"""The guards' checks: rows fed by several ranks, steps per epoch, row blocks of
unequal size, and the comparisons of structure, weights and batches."""
from __future__ import annotations

import warnings

import numpy as np
import tensorflow as tf

from tfhybrid import batch_losses, runtime
from tfhybrid.layout import layout_of
from tfhybrid.guards.checksums import (
    ConsistencyError, FIRST_STEPS, RTOL, _world_gather, input_fingerprint, structure_digest,
    weight_checksums)


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
