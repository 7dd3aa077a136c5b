"""Checkpoints that resume on any world size and strategy.

:func:`save` writes ONE checkpoint for a transformed model, from rank 0:

- ``PATH`` (a ``.keras`` file): the plain Keras model with the full weights,
  as :func:`tfhybrid.gather` returns it, so ``keras.saving.load_model(PATH)``
  loads it without tfhybrid;
- ``PATH + ".state.npz"`` (the side file): the optimizer state gathered the
  same way as the weights (each slot re-laid to its variable's full shape),
  the optimizer's iteration count, the epoch and step counters, the strategy
  the model was trained with and the optimizer/loss configuration.

Both files are written to temporary names and renamed into place (side file
first), so a crash while saving leaves the previous checkpoint intact.

:func:`load` reads a checkpoint on any world size: it transforms the full
model for the strategy asked (by default the one saved), compiles it with the
saved optimizer wrapped in :class:`tfhybrid.DistributedOptimizer` and the
saved loss (when they were serializable), and re-shards every optimizer slot
exactly as ``transform`` shards the weights, so training continues as if it
had never stopped.

Slots are found generically: Keras 3 optimizers name the slot of variable
``v`` ``f"{v.path.replace('/', '_')}_{slot}"`` (``add_variable_from_reference``).
Gathering a slot reuses :func:`tfhybrid.gather` (the slot values are put in
the weights' place for the call), and sharding it reuses
:func:`tfhybrid.transform` on a copy of the full model holding the slot
values, so every layout the transformer knows is covered by construction.
"""
from __future__ import annotations

import json
import os
import tempfile
import warnings

import keras
import numpy as np

from tfhybrid import runtime
from tfhybrid.optimizer.slots import inner as _inner, keras_optimizer, set_step_count
from tfhybrid.optimizer.slots import slot_names as _slot_names, slots_of, step_count
from tfhybrid.watchdog import collective_api
from tfhybrid.transformer.api import build, strategy_of
from tfhybrid.transformer.parts import PartModel

SIDE_SUFFIX = ".state.npz"
FORMAT = 1


# -- optimizer slots ---------------------------------------------------------

def _counter_variables(optimizer) -> dict:
    """The optimizer's scalar state a checkpoint records beside its slots:
    DistributedOptimizer's micro-step inside a backward_passes_per_step cycle
    and gmp's applied steps (its averaging period), and a LossScaleOptimizer's
    (mixed_float16) dynamic loss scale and its steps since the last change."""
    out = {name: getattr(optimizer, name) for name in ("_micro_step", "_applied_steps")
           if getattr(optimizer, name, None) is not None}
    inner = _inner(optimizer)
    if isinstance(inner, keras.optimizers.LossScaleOptimizer) and inner.built:
        out["loss_scale.dynamic_scale"] = inner.dynamic_scale
        out["loss_scale.step_counter"] = inner.step_counter
    return out


def optimizer_counters(model) -> dict:
    """``{name: number}`` of :func:`_counter_variables` (the same on every rank)."""
    optimizer = getattr(model, "optimizer", None)
    if optimizer is None or not getattr(optimizer, "built", False):
        return {}
    return {name: np.asarray(v.numpy()).item()
            for name, v in _counter_variables(optimizer).items()}


def set_optimizer_counters(optimizer, counters) -> None:
    """Restore what :func:`optimizer_counters` recorded (names the optimizer lacks are skipped)."""
    variables = _counter_variables(optimizer)
    for name, value in (counters or {}).items():
        if name in variables:
            variables[name].assign(value)


def _saved_values(optimizer, variables) -> dict:
    """``{id(slot): value}`` where a checkpoint records a slot other than its
    live value: DistributedOptimizer's backward_passes_per_step accumulators,
    averaged over the replicas (see ``saved_accumulators``). Collective when
    there are such accumulators."""
    return getattr(optimizer, "saved_accumulators", lambda variables: {})(variables)


def gather_optimizer_state(model) -> dict:
    """The optimizer state of a transformed model at full shapes (collective).

    Returns:
        ``{"iterations": int, "slots": {slot name: [full array per trainable
        variable of the gathered model, or None]}}`` (identical on every
        rank), or ``None`` when the model has no built optimizer.
    """
    from tfhybrid.transformer.gather import gather

    optimizer = getattr(model, "optimizer", None)
    if optimizer is None or not optimizer.built:
        return None
    variables = model.trainable_variables
    slots = slots_of(optimizer, variables)
    saved = _saved_values(optimizer, variables)
    backup = [v.numpy() for v in variables]
    gathered = {}
    try:
        for name in _slot_names(slots):
            for v, per_var in zip(variables, slots):
                v.assign(saved.get(id(per_var[name]), per_var[name]) if name in per_var
                         else np.zeros(v.shape, v.dtype))
            values = [w.numpy() for w in gather(model).trainable_variables]
            # A variable without this slot gathered zeros: record None for it (the
            # full and transformed variables line up one to one when counts agree).
            present = [name in per_var for per_var in slots]
            if len(present) == len(values):
                values = [val if ok else None for val, ok in zip(values, present)]
            gathered[name] = values
    finally:
        for v, value in zip(variables, backup):
            v.assign(value)
    return {"iterations": step_count(optimizer), "slots": gathered}


# -- random-generator state --------------------------------------------------

def _seed_variables(model):
    """The model's Keras ``SeedGenerator`` states (dropout etc.), in model order."""
    return [v for v in model.variables if "seed_generator_state" in v.path]


def gather_rng_state(model) -> dict:
    """Every rank's seed-generator states and TensorFlow's global seed (collective).

    Returns ``{"global_seed": int or None, "per_rank": array (world, n, 2)}``
    (identical on every rank). Replicas keep their own dropout streams, so
    each rank's state is kept.
    """
    import tensorflow as tf
    from tensorflow.python.eager import context

    from tfhybrid.comm import backend

    seeds = _seed_variables(model)
    grid = runtime.current_grid()
    mine = (np.stack([np.asarray(v.numpy(), np.int64) for v in seeds]) if seeds
            else np.zeros((0, 2), np.int64))
    if grid.size > 1:
        world = tuple(range(grid.size))
        # Ranks may hold different layers (p stages): pad to the longest list.
        counts = backend.allgather(tf.constant([mine.shape[0]], tf.int64), world,
                                   "checkpoint.rng.n").numpy()
        mine = np.concatenate([mine, np.zeros((int(counts.max()) - mine.shape[0], 2),
                                              np.int64)])
        rows = backend.allgather(tf.constant(mine[None]), world, "checkpoint.rng").numpy()
    else:
        rows = mine[None]
    return {"global_seed": context.global_seed(), "per_rank": rows}


def restore_rng_state(model, per_rank):
    """Give each rank the seed states rank ``rank % saved world`` had."""
    seeds = _seed_variables(model)
    if per_rank is None or not len(per_rank) or per_rank.shape[1] != len(seeds):
        return False
    row = per_rank[runtime.current_grid().rank % per_rank.shape[0]]
    for v, value in zip(seeds, row):
        v.assign(value.astype(v.dtype))
    return True


# -- files -------------------------------------------------------------------

def _serializable(obj):
    try:
        config = keras.saving.serialize_keras_object(obj)
        json.dumps(config)
        return config
    except Exception:  # noqa: BLE001 - anything unserializable is simply not recorded
        return None


def _compile_config(model, exclusions=None):
    """The optimizer (unwrapped) and loss of a compiled model, if serializable,
    and under ``"full"`` Keras' whole compile configuration (the
    DistributedOptimizer with its options, metrics, loss weights,
    steps_per_execution...) when it serializes to JSON. ``exclusions``: the
    weight-decay exclusions over every rank (p/ls: :func:`_part_exclusions`),
    else this rank's are read."""
    optimizer = getattr(model, "optimizer", None)
    if not getattr(model, "compiled", False) or optimizer is None:
        return None
    config = {"optimizer": _serializable(_inner(optimizer)),
              "loss": _serializable(getattr(model, "loss", None))}
    try:
        full = model.get_compile_config()
        json.dumps(full)
        config["full"] = full
    except Exception:  # noqa: BLE001 - a custom metric or loss without a config
        pass
    exclusions = exclusions or _weight_decay_exclusions(model, optimizer)
    if exclusions:
        config["weight_decay_exclusions"] = exclusions
    return config


def _weight_decay_exclusions(model, optimizer):
    """``exclude_from_weight_decay``'s variables (as paths) and name pattern,
    which Keras' optimizer config leaves out. Under p/ls, the paths of this
    rank's variables."""
    inner = keras_optimizer(optimizer)
    ids = getattr(inner, "_exclude_from_weight_decay", None) or set()
    pattern = getattr(inner, "_exclude_from_weight_decay_pattern", None)
    if not ids and pattern is None:
        return None
    return {"paths": sorted(v.path for v in model.variables if inner._var_key(v) in ids),
            "pattern": pattern.pattern if pattern is not None else None}


def _part_exclusions(model):
    """:func:`_weight_decay_exclusions` over every rank of a p/ls model, whose
    ranks hold different layers (collective when the optimizer has exclusions;
    ``exclude_from_weight_decay`` ran on every rank, as scripts do)."""
    import tensorflow as tf

    from tfhybrid.comm import backend
    optimizer = getattr(model, "optimizer", None)
    inner = keras_optimizer(optimizer) if optimizer is not None else None
    if inner is None or not hasattr(inner, "_exclude_from_weight_decay"):
        return None
    mine = _weight_decay_exclusions(model, optimizer) or {"paths": [], "pattern": None}
    world = tuple(range(runtime.current_grid().size))
    if len(world) > 1:
        text = (json.dumps(mine["paths"]) + "\n").encode()
        joined = backend.allgather(tf.constant(np.frombuffer(text, np.uint8)), world,
                                   "checkpoint.decay_exclusions").numpy().tobytes()
        mine["paths"] = sorted({p for line in joined.decode().splitlines() if line
                                for p in json.loads(line)})
    return mine


def _exclude_again(model, optimizer, exclusions):
    if not exclusions:
        return
    paths = set(exclusions.get("paths") or ())
    pattern = exclusions.get("pattern")
    keras_optimizer(optimizer).exclude_from_weight_decay(
        var_list=[v for v in model.variables if v.path in paths] or None,
        var_names=[pattern] if pattern else None)


def _meta(model, state, epoch, step, exclusions=None):
    grid = runtime.current_grid()
    return {
        "format": FORMAT,
        "strategy": strategy_of(model),
        "world_size": grid.size,
        "model_parallel": grid.model_size,
        "epoch": epoch,
        "step": step,
        "iterations": state["iterations"] if state else 0,
        "slot_names": sorted(state["slots"]) if state else [],
        "compile": _compile_config(model, exclusions),
        "counters": optimizer_counters(model),
    }


def _write_side_file(path, meta, state, rng=None):
    arrays = {"meta": np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)}
    if rng is not None:
        arrays["rng/per_rank"] = rng["per_rank"]
    if state:
        for name, values in state["slots"].items():
            for i, value in enumerate(values):
                if value is not None:
                    arrays[f"slot/{name}/{i}"] = value
    directory = os.path.dirname(os.path.abspath(path)) or "."
    fd, tmp = tempfile.mkstemp(prefix=".tfhybrid-", suffix=".npz", dir=directory)
    os.close(fd)
    try:
        np.savez(tmp, **arrays)
        os.replace(tmp, path + SIDE_SUFFIX)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _check_path(path):
    if not isinstance(path, (str, os.PathLike)) or not str(path).endswith(".keras"):
        raise ValueError(f"Received an invalid checkpoint path {path!r}; expected a file name "
                         "ending in '.keras' (the side file PATH.state.npz is written beside it).")
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        raise ValueError(f"The directory of checkpoint path {str(path)!r} does not exist: "
                         f"create {directory!r} first.")
    return str(path)


def template_sample(path) -> str:
    """``path`` with ``{epoch}`` and ``{step}`` filled in (a :class:`Checkpoint` template).

    Raises:
        ValueError: for a field other than ``epoch`` and ``step``, or a bad format spec.
    """
    try:
        return str(path).format(epoch=0, step=0)
    except (KeyError, IndexError, ValueError) as err:
        raise ValueError(f"Received an invalid checkpoint path {str(path)!r}: it cannot be "
                         f"formatted ({type(err).__name__}: {err}); the fields it may hold are "
                         "{epoch} and {step} (e.g. 'ckpt/e{epoch:03d}.keras'); write a literal "
                         "brace as {{ or }}.") from None


def check_writable(path, sharded: bool = False) -> None:
    """Refuse a checkpoint path that no save could write (no collective, no write).

    The directory a checkpoint goes into may not exist yet (:class:`Checkpoint`
    creates it at its first save): its deepest existing ancestor must then be
    a directory this process may write into. ``path`` itself must not be a
    directory (a single-file checkpoint) or a file (``sharded``). The result
    depends only on ``path`` and the file system, so every rank that sees the
    same file system decides alike, and all of them fail together before any
    training, not one rank at its first save while the others wait.

    Raises:
        ValueError: naming the path, what is in the way and what to do.
    """
    sample = os.path.abspath(template_sample(path))
    head = f"Checkpoint path {str(path)!r} cannot be written: "
    fix = "pass a path in a directory you can write to"
    if not sharded and os.path.isdir(sample):
        raise ValueError(f"{head}{sample!r} is a directory; pass a file name ending in "
                         "'.keras' (or sharded=True to save per-rank parts into a directory).")
    if sharded and os.path.exists(sample) and not os.path.isdir(sample):
        raise ValueError(f"{head}{sample!r} is a file and a sharded checkpoint is a "
                         f"directory; remove the file or {fix}.")
    directory = os.path.dirname(sample)
    existing = directory
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise ValueError(f"{head}{existing!r} is a file, not a directory, so the directory "
                         f"{directory!r} cannot be created; {fix}, or move the file.")
    if not os.access(existing, os.W_OK | os.X_OK):
        needed = ("to write into it" if existing == directory
                  else f"to create {directory!r} in it")
        raise ValueError(f"{head}no write permission in directory {existing!r} ({needed}); "
                         f"{fix}, or give this user write permission there "
                         f"(chmod u+w {existing!r}).")


@collective_api("tfhybrid.save")
def save(model, path, epoch: int | None = None, step: int | None = None,
         sharded: bool = False, redundant: bool = False):
    """Write a checkpoint of a transformed model (collective: call on every rank).

    Args:
        model: A model returned by :func:`tfhybrid.transform` (compiled or not).
        path: Destination ``.keras`` file; the side file ``path + ".state.npz"``
            is written beside it. Existing files are replaced atomically.
        epoch: Epochs completed so far (passed back by :func:`read_meta` and
            used by :func:`load` for ``initial_epoch``).
        step: Optimizer steps completed in the current epoch (data position).
        sharded: Large-model mode: ``path`` is a directory and every rank
            writes its own part (see :func:`save_sharded`); nothing is
            gathered on one rank. :func:`consolidate` makes a single file
            of it offline; :func:`load` reads both kinds.
        redundant: With ``sharded``, also keep each rank's file on its
            neighbour (Stanza §5.3).

    Raises:
        ValueError: for a path that does not end in ``.keras`` or whose
            directory does not exist, or a model not returned by transform.

    Example:
        >>> tfhybrid.save(model, "ckpt/last.keras", epoch=3)
        >>> model = tfhybrid.load("ckpt/last.keras", strategy="d")
    """
    from tfhybrid.comm import backend
    from tfhybrid.transformer.gather import gather

    if sharded:
        return save_sharded(model, path, epoch=epoch, step=step, redundant=redundant)
    if redundant:
        raise ValueError("redundant=True keeps a second copy of every rank's part of a sharded "
                         "checkpoint: pass sharded=True too (a single-file checkpoint has one "
                         "writer, rank 0).")
    path = _check_path(path)
    full = gather(model)   # ls: also copies the FC workers' parameters to every CONV worker
    part = isinstance(model, PartModel)
    state = model.optimizer_state() if part else gather_optimizer_state(model)   # p/ls: own
    rng = gather_rng_state(model)
    exclusions = _part_exclusions(model) if part else None
    # every rank returns once the files exist, or raises when rank 0 could not
    # write them (a layer Keras cannot serialise, a full disk)
    with backend.together(f"tfhybrid.save({path!r}) on rank 0"):
        if runtime.is_root():
            meta = _meta(model, state, epoch, step, exclusions)
            meta["global_seed"] = rng["global_seed"]
            _write_side_file(path, meta, state, rng)
            directory = os.path.dirname(os.path.abspath(path))
            fd, tmp = tempfile.mkstemp(prefix=".tfhybrid-", suffix=".keras", dir=directory)
            os.close(fd)
            try:
                full.save(tmp)
                os.replace(tmp, path)
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)


def _read_side_meta(path) -> dict:
    """The side file's record of a single-file checkpoint (strategy, epoch, step, ...).

    Raises:
        FileNotFoundError: with the missing file's name.
        ValueError: for a side file tfhybrid did not write.
    """
    side = str(path) + SIDE_SUFFIX
    if not os.path.exists(side):
        raise FileNotFoundError(f"Checkpoint side file {side!r} does not exist; pass the "
                                "path given to tfhybrid.save (the .keras file).")
    with np.load(side) as data:
        if "meta" not in data.files:
            raise ValueError(f"{side!r} is not a tfhybrid checkpoint side file (no 'meta').")
        return json.loads(bytes(data["meta"]).decode())


def _read_slots(path, meta):
    with np.load(str(path) + SIDE_SUFFIX) as data:
        slots = {}
        for name in meta["slot_names"]:
            keys = {int(k.split("/")[2]): k for k in data.files if k.startswith(f"slot/{name}/")}
            slots[name] = {i: data[k] for i, k in keys.items()}
        return slots


def _shard_like(full, values, strategy, options):
    """``values`` (one array per full trainable variable) laid out as
    ``transform(full, strategy, **options)`` lays out the weights."""
    copy = keras.models.clone_model(full)
    for var, value in zip(copy.trainable_variables, values):
        if value is not None:
            var.assign(value)
    return [v.numpy() for v in build(copy, strategy, **options).trainable_variables]


def resume(transform, path, strategy=None, compile=True, custom_objects=None, **options):
    """What :func:`tfhybrid.load` does (:func:`tfhybrid.compose.load`), with
    ``transform`` the function that builds and guards the model."""
    with keras.saving.custom_object_scope(custom_objects or {}):
        return _load(transform, path, strategy, compile, options)


def _load(transform, path, strategy, compile, options):
    path = str(path)
    if os.path.isdir(path):
        return resume_fit_at(_load_sharded(transform, path, strategy, compile, options),
                             read_manifest(path))
    if not os.path.exists(path):
        raise FileNotFoundError(f"Checkpoint {path!r} does not exist.")
    meta = read_meta(path)
    strategy = strategy or meta["strategy"]
    full = keras.saving.load_model(path, compile=False)
    model = transform(full, strategy, **options)
    with np.load(path + SIDE_SUFFIX) as data:
        if "rng/per_rank" in data.files:
            restore_rng_state(model, data["rng/per_rank"])
    if compile:
        _compile_from(model, meta, path)
        _restore_slots(model, full, _read_slots(path, meta), meta["iterations"], strategy, options)
        set_optimizer_counters(model.optimizer, meta.get("counters"))
    return resume_fit_at(model, meta)


def _compile_from(model, meta, where):
    config = meta.get("compile") or {}
    if not config.get("optimizer") or not config.get("loss"):
        raise ValueError(f"Checkpoint {where!r} records no serializable optimizer and loss; "
                         "load with compile=False and compile the model yourself.")
    from tfhybrid.optimizer import DistributedOptimizer

    failed = None
    if config.get("full"):
        try:
            args = keras.saving.deserialize_keras_object(config["full"])
        except Exception as e:  # noqa: BLE001 - e.g. a custom metric not registered here
            failed = e
        else:
            if not isinstance(args.get("optimizer"), DistributedOptimizer):
                args["optimizer"] = DistributedOptimizer(args["optimizer"])
            _exclude_again(model, args["optimizer"], config.get("weight_decay_exclusions"))
            model.compile(**args)
            return
    try:
        inner = keras.saving.deserialize_keras_object(config["optimizer"])
        loss = keras.saving.deserialize_keras_object(config["loss"])
    except Exception as e:
        raise ValueError(
            f"Checkpoint {where!r} was compiled with a loss or optimizer that does not "
            f"deserialize here ({type(e).__name__}: {e}). Pass it: tfhybrid.load(path, "
            "custom_objects={'my_loss': my_loss}), or register it with "
            "@keras.saving.register_keras_serializable(); or load with compile=False and "
            "compile yourself (the optimizer state then starts from zero).") from e
    if failed is not None:
        warnings.warn(f"tfhybrid.load: the compile configuration of {where!r} does not "
                      f"deserialize here ({type(failed).__name__}: {failed}); compiled with "
                      "its optimizer and loss only (no metrics, no DistributedOptimizer "
                      "options). Pass your custom objects: tfhybrid.load(path, "
                      "custom_objects={'name': object}).", stacklevel=4)
    _exclude_again(model, inner, config.get("weight_decay_exclusions"))
    model.compile(optimizer=DistributedOptimizer(inner), loss=loss)


def _restore_slots(model, full, saved, iterations, strategy, options):
    """Set ``model``'s optimizer slots from full-shape ``saved`` values
    (``{slot name: {full trainable index: array}}``) and its iteration count.
    Collective (it transforms copies of ``full`` to shard the slots)."""
    optimizer = model.optimizer
    if not optimizer.built:
        optimizer.build(model.trainable_variables)
    slots = slots_of(optimizer, model.trainable_variables)
    n_full = len(full.trainable_variables)
    for name, by_index in saved.items():
        values = [by_index.get(i) for i in range(n_full)]
        sharded = _shard_like(full, values, strategy, options)
        for per_var, value in zip(slots, sharded):
            if name in per_var:
                per_var[name].assign(value)
    set_step_count(optimizer, iterations)


def read_meta(path) -> dict:
    """The record of a checkpoint: strategy, epoch, step, iterations, world size, ...

    Reads the side file of a single-file checkpoint or the manifest of a
    sharded one.

    Raises:
        FileNotFoundError: naming the missing file.
        ValueError: for a side file tfhybrid did not write.
    """
    if os.path.isdir(str(path)):
        return read_manifest(path)
    return _read_side_meta(path)


def _load_sharded(transform, directory, strategy, compile, options):
    manifest = read_manifest(directory)
    grid = runtime.current_grid()
    strategy = strategy or manifest["strategy"]
    same_grid = (grid.size == manifest["world_size"] and grid.model_size == manifest["model_parallel"]
                 and strategy == manifest["strategy"] and not options)
    if not same_grid:
        full, slots = _consolidated(directory, manifest)
        model = transform(full, strategy, **options)
        if compile:
            _compile_from(model, manifest, directory)
            _restore_slots(model, full, slots, manifest["iterations"], strategy, options)
            set_optimizer_counters(model.optimizer, manifest.get("counters"))
        return model
    full = keras.saving.deserialize_keras_object(json.loads(manifest["source"]))
    model = transform(full, strategy)
    own = _open_rank(directory, grid.rank)
    variables = model.variables
    if len(variables) != len(manifest["variables"]):
        raise ValueError(f"Sharded checkpoint {directory!r} holds {len(manifest['variables'])} "
                         f"variables per rank but the model transformed for {strategy!r} has "
                         f"{len(variables)}: the architecture changed since it was saved.")
    for i, v in enumerate(variables):
        v.assign(own[f"var/{i}"])
    from tfhybrid.transformer.source import finalize_states
    finalize_states(model)      # an adapted Normalization's mean/variance
    if compile:
        _compile_from(model, manifest, directory)
        optimizer = model.optimizer
        optimizer.build(model.trainable_variables)
        index = {id(v): i for i, v in enumerate(variables)}
        for v, per_var in zip(model.trainable_variables,
                              slots_of(optimizer, model.trainable_variables)):
            for name, slot in per_var.items():
                key = f"slot/{name}/{index[id(v)]}"
                if key in own:
                    slot.assign(own[key])
        set_step_count(optimizer, manifest["iterations"])
        set_optimizer_counters(optimizer, manifest.get("counters"))
    return model


# -- data position: the first fit after load continues mid-epoch ------------------

def resume_fit_at(model, meta):
    """Make the first ``fit`` of ``model`` continue at the data position of ``meta``.

    ``meta`` is a checkpoint's record (:func:`read_meta`): ``epoch`` (epochs
    completed) and ``step`` (batches of the next epoch trained before the
    checkpoint). Wraps ``model.fit`` (instance attribute, once): in the first
    call, ``initial_epoch`` defaults to ``epoch`` when ``epochs`` exceeds it
    (as ``keras.callbacks.BackupAndRestore`` resumes), and when the fit
    starts at that epoch with a ``tf.data.Dataset`` (e.g. what
    :func:`tfhybrid.data.shard` returns: one element per global batch), that
    epoch is trained on the dataset without its first ``step`` elements,
    then the remaining epochs on the whole dataset (two Keras ``fit`` calls,
    one returned History). :class:`Checkpoint` counts the skipped batches in
    the saved ``step``. Later calls are plain ``fit``.

    Exact resume needs the dataset to yield the same batches in that epoch
    as the interrupted run did: unshuffled, or shuffled with a seed that
    depends on the epoch (``shard(..., shuffle=...)`` reshuffles per
    iteration of the dataset object, so a new dataset restarts its order).

    Returns:
        ``model``.

    Example:
        >>> model = tfhybrid.load("ckpt/last.keras")     # saved at epoch 2, step 300
        >>> model.fit(tfhybrid.data.shard(ds, model=model), epochs=5)
        >>> # trains batches 300.. of epoch 2, then epochs 3 and 4 whole
    """
    import inspect
    import types

    import tensorflow as tf

    epoch, step = int(meta.get("epoch") or 0), int(meta.get("step") or 0)
    if not epoch and not step:
        return model
    inner, signature = model.fit, inspect.signature(keras.Model.fit)
    pending = [True]

    def fit(self, *args, **kwargs):
        if not pending:
            return inner(*args, **kwargs)
        pending.clear()
        call = {k: v for k, v in signature.bind(self, *args, **kwargs).arguments.items()
                if k != "self"}                 # as given: Keras warns about some defaults
        epochs = call.get("epochs", signature.parameters["epochs"].default)
        if "initial_epoch" not in call and epochs > epoch:
            call["initial_epoch"] = epoch
        if not step or call.get("initial_epoch", 0) != epoch:
            return inner(**call)
        if not isinstance(call.get("x"), tf.data.Dataset):
            if runtime.is_root():
                warnings.warn(f"tfhybrid.load: the checkpoint was saved after {step} batches of "
                              f"epoch {epoch}, but fit received {type(call.get('x')).__name__}, "
                              "not a tf.data.Dataset: the whole epoch is trained again. Pass "
                              "tfhybrid.data.shard(dataset, model=model).", stacklevel=2)
            return inner(**call)
        first = dict(call, x=call["x"].skip(step), epochs=epoch + 1)
        if call.get("steps_per_epoch"):
            first["steps_per_epoch"] = call["steps_per_epoch"] - step
        object.__setattr__(self, "_tfhybrid_step_offset", step)
        try:
            history = inner(**first)
        finally:
            object.__setattr__(self, "_tfhybrid_step_offset", 0)
        if epochs <= epoch + 1 or self.stop_training:
            return history
        rest = inner(**dict(call, initial_epoch=epoch + 1))
        rest.epoch = history.epoch + rest.epoch
        rest.history = {k: history.history.get(k, []) + v for k, v in rest.history.items()}
        return rest

    object.__setattr__(model, "fit", types.MethodType(fit, model))
    return model


class Checkpoint(keras.callbacks.Callback):
    """Save a :func:`save` checkpoint during ``fit`` (every rank runs it; rank 0 writes).

    Args:
        path: ``.keras`` file name; may contain ``{epoch}`` and ``{step}``
            (e.g. ``"ckpt/e{epoch:03d}-s{step}.keras"``); without them every
            save replaces the same file atomically.
        every_n_steps: Also save every N optimizer steps within an epoch
            (0: never).
        every_epoch: Save at the end of every epoch (default True).
        keep: With a formatted ``path``, how many of the newest checkpoints
            rank 0 keeps (older ones and their side files are deleted);
            None keeps all.
        sharded: Write per-rank parts into the directory ``path`` instead of
            gathering on rank 0 (see :func:`save_sharded`).
        redundant: With ``sharded``, each rank's part is also kept by its
            neighbour (Stanza §5.3 redundant checkpoint).

    The directory of ``path`` is created at the first save when it does not
    exist. A path no save could write (a file where a directory must be, no
    write permission) is refused when the callback is made, on every rank,
    before any training (:func:`check_writable`).

    Raises:
        ValueError: for a non-``.keras`` path, a path that cannot be written,
            a field other than ``{epoch}``/``{step}`` in it, a negative
            ``every_n_steps``, ``keep`` < 1, or nothing to save (both
            triggers off).

    Example:
        >>> model.fit(data, epochs=10, callbacks=tfhybrid.callbacks.standard() + [
        ...     tfhybrid.callbacks.Checkpoint("ckpt/last.keras", every_n_steps=500)])
        >>> model = tfhybrid.load("ckpt/last.keras")        # any world size, any strategy
        >>> model.fit(data, epochs=10, ...)      # resumes at the saved epoch and step
    """

    def __init__(self, path, every_n_steps: int = 0, every_epoch: bool = True,
                 keep: int | None = None, sharded: bool = False, redundant: bool = False):
        super().__init__()
        if not isinstance(path, (str, os.PathLike)) or (
                not sharded and not str(path).endswith(".keras")):
            raise ValueError(f"Received an invalid checkpoint path {path!r}; expected a file "
                             "name ending in '.keras' (or a directory name with sharded=True).")
        if redundant and not sharded:
            raise ValueError("redundant=True keeps a second copy of every rank's part of a "
                             "sharded checkpoint: pass sharded=True too.")
        self.sharded, self.redundant = bool(sharded), bool(redundant)
        if isinstance(every_n_steps, bool) or not isinstance(every_n_steps, int) or every_n_steps < 0:
            raise ValueError(f"Received an invalid value for `every_n_steps`: {every_n_steps!r}; "
                             "expected a non-negative integer (0 = only at epoch ends).")
        if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 1):
            raise ValueError(f"Received an invalid value for `keep`: {keep!r}; expected a "
                             "positive integer or None (keep all).")
        if not every_n_steps and not every_epoch:
            raise ValueError("Checkpoint would never save: pass every_n_steps > 0 or "
                             "every_epoch=True.")
        check_writable(path, self.sharded)
        self.path, self.every_n_steps, self.every_epoch, self.keep = (
            str(path), every_n_steps, bool(every_epoch), keep)
        self._epoch = 0
        self._written = []
        self._made = set()

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        step = batch + 1 + getattr(self.model, "_tfhybrid_step_offset", 0)  # resumed mid-epoch
        if self.every_n_steps and step % self.every_n_steps == 0:
            self._save(self._epoch, step)

    def on_epoch_end(self, epoch, logs=None):
        if self.every_epoch:
            self._save(epoch + 1, 0)

    def _make_directory(self, path):
        """Create the directory ``path`` goes into (with its parents), as Keras'
        ``ModelCheckpoint`` does, on the ranks that write: rank 0 (a single
        file), every rank (``sharded``: each writes its part). Collective the
        first time per directory (the same on every rank: ``path`` comes from
        the same template and counters), so a rank that cannot create it
        stops every rank here."""
        directory = os.path.dirname(os.path.abspath(path))
        if directory in self._made:
            return
        if runtime.current_grid().size == 1:
            os.makedirs(directory, exist_ok=True)
        else:
            from tfhybrid.comm import backend

            with backend.together(f"tfhybrid.callbacks.Checkpoint creating {directory!r}"):
                if self.sharded or runtime.is_root():
                    os.makedirs(directory, exist_ok=True)
        self._made.add(directory)

    def _save(self, epoch, step):
        path = self.path.format(epoch=epoch, step=step)
        self._make_directory(path)
        save(self.model, path, epoch=epoch, step=step, sharded=self.sharded,
             redundant=self.redundant)
        if runtime.is_root() and path != self.path:
            if path in self._written:
                self._written.remove(path)
            self._written.append(path)
            while self.keep and len(self._written) > self.keep:
                old = self._written.pop(0)
                if os.path.isdir(old):
                    import shutil
                    shutil.rmtree(old, ignore_errors=True)
                for name in (old, old + SIDE_SUFFIX):
                    if os.path.isfile(name):
                        os.unlink(name)


# -- sharded checkpoints (large-model mode) -----------------------------------
#
# ``save(model, DIR, sharded=True)`` writes, DeepSpeed-style, one file per rank
# with that rank's own variables and optimizer slots (nothing is gathered), and
# a manifest from rank 0 with the architecture, strategy, grid, counters and,
# per variable, how the blocks of the ranks make the full value (layout kind,
# sharded axis, the group's ranks in block order). ``consolidate`` rebuilds a
# single-file checkpoint from it offline (no Horovod), ``load`` reads it on the
# same grid rank by rank, or consolidates in memory for another grid.

MANIFEST = "manifest.json"


def _rank_file(directory, rank, copy=False):
    return os.path.join(directory, f"rank-{rank:05d}{'.copy' if copy else ''}.npz")


def _owner_groups(model):
    """``{id(variable): ranks of the group its blocks are split over}``."""
    owners = {}
    for layer in model._flatten_layers(include_self=False):
        group = getattr(layer, "comm_group", None)
        if group is not None:
            for w in layer.weights:
                owners[id(w)] = tuple(int(r) for r in group.ranks)
    return owners


def _variable_records(model):
    from tfhybrid.layout import layout_of

    grid = runtime.current_grid()
    owners = _owner_groups(model)
    records = []
    for v in model.variables:
        layout = layout_of(v)
        record = {"path": v.path, "kind": layout.kind, "shape": list(v.shape)}
        if layout.kind == "sharded":
            ranks = owners.get(id(v))
            if ranks is None:
                ranks = grid.group(layout.group if layout.group in ("model", "data")
                                   else "model").ranks
            record.update(axis=layout.axis, ranks=list(ranks))
        records.append(record)
    return records


def _shard_arrays(model):
    arrays = {f"var/{i}": v.numpy() for i, v in enumerate(model.variables)}
    optimizer = getattr(model, "optimizer", None)
    iterations = 0
    if optimizer is not None and optimizer.built:
        index = {id(v): i for i, v in enumerate(model.variables)}
        variables = model.trainable_variables
        slots = slots_of(optimizer, variables)
        saved = _saved_values(optimizer, variables)
        for v, per_var in zip(variables, slots):
            for name, slot in per_var.items():
                arrays[f"slot/{name}/{index[id(v)]}"] = saved.get(id(slot), slot).numpy()
        iterations = step_count(optimizer)
    return arrays, iterations


def _npz_bytes(arrays):
    import io

    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    return buffer.getvalue()


def _pass_to_next_rank(payload: bytes, name: str) -> bytes:
    """Send ``payload`` to rank r+1 (ring) and return what rank r-1 sent."""
    import tensorflow as tf

    from tfhybrid.comm import backend

    grid = runtime.current_grid()
    world = tuple(range(grid.size))
    splits = [0] * grid.size
    splits[(grid.rank + 1) % grid.size] = len(payload)
    data = tf.constant(np.frombuffer(payload, dtype=np.uint8))
    return backend.alltoall(data, splits, world, name).numpy().tobytes()


def save_sharded(model, directory, epoch=None, step=None, redundant=False):
    """Per-rank checkpoint of a transformed model in ``directory`` (collective).

    Each rank writes ``rank-NNNNN.npz`` (its variables and optimizer slots,
    as it holds them), rank 0 writes ``manifest.json``. With ``redundant``
    (Stanza §5.3) each rank also writes the previous rank's file as
    ``rank-MMMMM.copy.npz``, so losing one rank's file loses nothing.
    Written into a temporary directory renamed into place at the end.

    Raises:
        ValueError: if the parent directory does not exist or ``directory``
            names an existing file.
    """
    import shutil

    from tfhybrid.comm import backend
    from tfhybrid.transformer.api import info_of

    directory = os.path.abspath(str(directory))
    parent = os.path.dirname(directory)
    if not os.path.isdir(parent):
        raise ValueError(f"The parent directory of sharded checkpoint {directory!r} does not "
                         f"exist: create {parent!r} first.")
    if os.path.isfile(directory):
        raise ValueError(f"Sharded checkpoint path {directory!r} is a file; pass a directory "
                         "name (sharded checkpoints are directories).")
    info = info_of(model)
    grid = runtime.current_grid()
    tmp = directory + ".tmp"
    # each phase ends on every rank together: a write that fails on one rank (a
    # full disk) raises on all, and nothing is published
    what = f"tfhybrid.save({directory!r}, sharded=True)"
    with backend.together(what):
        if runtime.is_root():
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(tmp)
    arrays, iterations = _shard_arrays(model)
    payload = _npz_bytes(arrays)
    # the copy for the next rank moves before anything can fail (a collective)
    copy = _pass_to_next_rank(payload, "checkpoint.redundant") \
        if redundant and grid.size > 1 else None
    with backend.together(what):      # every rank's file is in tmp
        with open(_rank_file(tmp, grid.rank), "wb") as f:
            f.write(payload)
        if copy is not None:
            previous = (grid.rank - 1) % grid.size
            with open(_rank_file(tmp, previous, copy=True), "wb") as f:
                f.write(copy)
        if runtime.is_root():
            slot_names = sorted({k.split("/")[1] for k in arrays if k.startswith("slot/")})
            manifest = {
                "format": FORMAT, "sharded": True, "strategy": info.plan.strategy,
                "world_size": grid.size, "model_parallel": grid.model_size,
                "epoch": epoch, "step": step, "iterations": iterations,
                "slot_names": slot_names, "redundant": bool(redundant), "source": info.source,
                "variables": _variable_records(model),
                "compile": _compile_config(model), "counters": optimizer_counters(model),
            }
            with open(os.path.join(tmp, MANIFEST), "w") as f:
                json.dump(manifest, f)
    with backend.together(what):
        if runtime.is_root():
            old = directory + ".old"
            shutil.rmtree(old, ignore_errors=True)
            if os.path.exists(directory):
                os.replace(directory, old)
            os.replace(tmp, directory)
            shutil.rmtree(old, ignore_errors=True)


def read_manifest(directory) -> dict:
    """The manifest of a sharded checkpoint.

    Raises:
        FileNotFoundError: naming the missing manifest.
    """
    path = os.path.join(str(directory), MANIFEST)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path!r} does not exist: {str(directory)!r} is not a "
                                "sharded tfhybrid checkpoint (tfhybrid.save(..., sharded=True)).")
    with open(path) as f:
        return json.load(f)


def _open_rank(directory, rank):
    """Rank ``rank``'s arrays, from its file or, if that is missing or
    unreadable, from the redundant copy its neighbour wrote."""
    errors = []
    for copy in (False, True):
        path = _rank_file(directory, rank, copy)
        try:
            with np.load(path) as data:
                return {k: data[k] for k in data.files}
        except (OSError, ValueError, EOFError) as err:   # missing, truncated, corrupt
            errors.append(f"{path}: {err}")
    raise FileNotFoundError(f"No readable file for rank {rank} in sharded checkpoint "
                            f"{str(directory)!r} ({'; '.join(errors)}); save with "
                            "redundant=True to keep a second copy of every rank's file.")


def _consolidated(directory, manifest):
    """(full model, {slot name: {full trainable index: array}}) of a sharded checkpoint."""
    files = [_open_rank(directory, r) for r in range(manifest["world_size"])]
    full_values, full_slots = {}, {name: {} for name in manifest["slot_names"]}

    def whole(key, record):
        if record["kind"] != "sharded":
            return files[0].get(key)
        blocks = [files[r].get(key) for r in record["ranks"]]
        if any(b is None for b in blocks):
            return None
        return np.concatenate(blocks, axis=record["axis"])

    for i, record in enumerate(manifest["variables"]):
        full_values[record["path"]] = whole(f"var/{i}", record)
        for name in manifest["slot_names"]:
            value = whole(f"slot/{name}/{i}", record)
            if value is not None:
                full_slots[name][record["path"]] = value
    full = keras.saving.deserialize_keras_object(json.loads(manifest["source"]))
    for v in full.variables:
        value = full_values.get(v.path)
        if value is not None and tuple(value.shape) == tuple(v.shape):
            v.assign(value)
    trainable = [v.path for v in full.trainable_variables]
    slots = {name: {trainable.index(p): a for p, a in by_path.items() if p in trainable}
             for name, by_path in full_slots.items()}
    return full, slots


def consolidate(directory, path):
    """Turn a sharded checkpoint into a single-file one (offline: no Horovod).

    Writes ``path`` (plain ``.keras``) and its side file, which
    :func:`load` reads on any world size and strategy.

    Example:
        >>> tfhybrid.checkpoint.consolidate("ckpt/step1000", "ckpt/step1000.keras")
    """
    path = _check_path(path)
    manifest = read_manifest(directory)
    full, slots = _consolidated(directory, manifest)
    n = len(full.trainable_variables)
    state = {"iterations": manifest["iterations"],
             "slots": {name: [by_index.get(i) for i in range(n)]
                       for name, by_index in slots.items()}}
    meta = {k: manifest[k] for k in ("format", "strategy", "world_size", "model_parallel",
                                      "epoch", "step", "iterations", "slot_names", "compile")}
    meta["counters"] = manifest.get("counters", {})
    _write_side_file(path, meta, state)
    full.save(path)
    return path
