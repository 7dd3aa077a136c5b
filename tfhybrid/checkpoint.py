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

import keras
import numpy as np

from tfhybrid import runtime

SIDE_SUFFIX = ".state.npz"
FORMAT = 1


# -- optimizer slots ---------------------------------------------------------

def _inner(optimizer):
    """The Keras optimizer holding the slots (inside a DistributedOptimizer)."""
    return getattr(optimizer, "inner_optimizer", optimizer)


def _slot_prefix(variable):
    return variable.path.replace("/", "_") + "_"


def slots_of(optimizer, variables) -> list:
    """Per variable of ``variables``, ``{slot name: optimizer variable}``.

    Each optimizer variable is matched to the variable with the longest
    name prefix that it starts with and whose shape it has (so ``fc1_kernel``
    does not capture the slots of ``fc1_kernel_2``'s variable).
    """
    prefixes = [(_slot_prefix(v), i, tuple(v.shape)) for i, v in enumerate(variables)]
    prefixes.sort(key=lambda p: -len(p[0]))
    out = [dict() for _ in variables]
    for slot in _inner(optimizer).variables:
        name = slot.name
        for prefix, i, shape in prefixes:
            if name.startswith(prefix) and tuple(slot.shape) == shape:
                out[i][name[len(prefix):]] = slot
                break
    return out


def _slot_names(slots):
    names = []
    for per_var in slots:
        for name in per_var:
            if name not in names:
                names.append(name)
    return names


def gather_optimizer_state(model) -> dict:
    """The optimizer state of a transformed model at full shapes (collective).

    Returns:
        ``{"iterations": int, "slots": {slot name: [full array per trainable
        variable of the gathered model, or None]}}`` (identical on every
        rank), or ``None`` when the model has no built optimizer.
    """
    from tfhybrid.transform.gather import gather

    optimizer = getattr(model, "optimizer", None)
    if optimizer is None or not optimizer.built:
        return None
    variables = model.trainable_variables
    slots = slots_of(optimizer, variables)
    backup = [v.numpy() for v in variables]
    gathered = {}
    try:
        for name in _slot_names(slots):
            for v, per_var in zip(variables, slots):
                v.assign(per_var[name] if name in per_var else np.zeros(v.shape, v.dtype))
            full = gather(model)
            present = [name in per_var for per_var in slots]
            values = [w.numpy() for w in full.trainable_variables]
            # Which full variables have this slot: all of them unless some rank's
            # variable lacked it (then its gathered value is zeros and unused).
            gathered[name] = values if all(present) else [
                val if ok else None for val, ok in zip(values, _full_presence(present, values))]
    finally:
        for v, value in zip(variables, backup):
            v.assign(value)
    return {"iterations": int(_inner(optimizer).iterations.numpy()), "slots": gathered}


def _full_presence(present, values):
    """Presence flags per full variable (same count when layers map one to one)."""
    if len(present) == len(values):
        return present
    return [True] * len(values)


# -- files -------------------------------------------------------------------

def _serializable(obj):
    try:
        config = keras.saving.serialize_keras_object(obj)
        json.dumps(config)
        return config
    except Exception:  # noqa: BLE001 - anything unserializable is simply not recorded
        return None


def _meta(model, state, epoch, step):
    from tfhybrid.transform.api import info_of

    info = info_of(model)
    grid = runtime.current_grid()
    optimizer = getattr(model, "optimizer", None)
    compile_config = None
    if getattr(model, "compiled", False):
        compile_config = {
            "optimizer": _serializable(_inner(optimizer)) if optimizer is not None else None,
            "loss": _serializable(getattr(model, "loss", None)),
        }
    return {
        "format": FORMAT,
        "strategy": info.plan.strategy,
        "world_size": grid.size,
        "model_parallel": grid.model_size,
        "epoch": epoch,
        "step": step,
        "iterations": state["iterations"] if state else 0,
        "slot_names": sorted(state["slots"]) if state else [],
        "compile": compile_config,
    }


def _write_side_file(path, meta, state):
    arrays = {"meta": np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)}
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


def save(model, path, epoch: int | None = None, step: int | None = None):
    """Write a checkpoint of a transformed model (collective: call on every rank).

    Args:
        model: A model returned by :func:`tfhybrid.transform` (compiled or not).
        path: Destination ``.keras`` file; the side file ``path + ".state.npz"``
            is written beside it. Existing files are replaced atomically.
        epoch: Epochs completed so far (passed back by :func:`read_meta` and
            used by :func:`load` for ``initial_epoch``).
        step: Optimizer steps completed in the current epoch (data position).

    Raises:
        ValueError: for a path that does not end in ``.keras`` or whose
            directory does not exist, or a model not returned by transform.

    Example:
        >>> tfhybrid.save(model, "ckpt/last.keras", epoch=3)
        >>> model = tfhybrid.load("ckpt/last.keras", strategy="d")
    """
    from tfhybrid.comm import backend
    from tfhybrid.transform.gather import gather

    path = _check_path(path)
    full = gather(model)
    state = gather_optimizer_state(model)
    if runtime.is_root():
        meta = _meta(model, state, epoch, step)
        _write_side_file(path, meta, state)
        directory = os.path.dirname(os.path.abspath(path))
        fd, tmp = tempfile.mkstemp(prefix=".tfhybrid-", suffix=".keras", dir=directory)
        os.close(fd)
        try:
            full.save(tmp)
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    if runtime.current_grid().size > 1:
        backend.barrier()   # every rank returns once the files exist


def read_meta(path) -> dict:
    """The side file's record of a checkpoint (strategy, epoch, step, iterations, ...).

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
    from tfhybrid.transform.api import transform

    copy = keras.models.clone_model(full)
    for var, value in zip(copy.trainable_variables, values):
        if value is not None:
            var.assign(value)
    return [v.numpy() for v in transform(copy, strategy, **options).trainable_variables]


def load(path, strategy: str | None = None, compile: bool = True, **options):
    """Resume a checkpoint of :func:`save` on this grid (collective).

    Args:
        path: The ``.keras`` file given to :func:`save`.
        strategy: Strategy to transform for; default the one saved. Any
            strategy and world size work: weights and optimizer slots are
            re-sharded for the new layout.
        compile: Compile with the saved optimizer (wrapped in
            :class:`tfhybrid.DistributedOptimizer`) and loss, and restore the
            optimizer's slots and iteration count. With ``compile=False``
            only the weights are restored.
        **options: ``transform`` options (``mp``, ``spatial``, ``layers``...).

    Returns:
        The transformed model. ``tfhybrid.read_meta(path)["epoch"]`` is the
        ``initial_epoch`` to pass to ``fit``.

    Raises:
        FileNotFoundError: if the checkpoint or its side file is missing.
        ValueError: if ``compile=True`` but the checkpoint has no optimizer
            or loss configuration (compile yourself, then call
            :func:`restore_optimizer_state`).

    Example:
        >>> model = tfhybrid.load("ckpt/last.keras", strategy="df")
        >>> model.fit(data, initial_epoch=tfhybrid.read_meta("ckpt/last.keras")["epoch"], ...)
    """
    from tfhybrid.transform.api import transform

    if not os.path.exists(str(path)):
        raise FileNotFoundError(f"Checkpoint {str(path)!r} does not exist.")
    meta = read_meta(path)
    strategy = strategy or meta["strategy"]
    full = keras.saving.load_model(str(path), compile=False)
    model = transform(full, strategy, **options)
    if not compile:
        return model
    config = meta.get("compile") or {}
    if not config.get("optimizer") or not config.get("loss"):
        raise ValueError(f"Checkpoint {str(path)!r} records no serializable optimizer and loss; "
                         "load with compile=False, compile the model yourself, then call "
                         "tfhybrid.checkpoint.restore_optimizer_state(model, path, full_model).")
    from tfhybrid.optimizer import DistributedOptimizer

    inner = keras.saving.deserialize_keras_object(config["optimizer"])
    loss = keras.saving.deserialize_keras_object(config["loss"])
    model.compile(optimizer=DistributedOptimizer(inner), loss=loss)
    restore_optimizer_state(model, path, full, strategy, **options)
    return model


def restore_optimizer_state(model, path, full, strategy, **options):
    """Set ``model``'s optimizer slots and iterations from checkpoint ``path``.

    ``full`` is the checkpoint's plain model (``keras.saving.load_model(path)``)
    and ``strategy``/``options`` those ``model`` was transformed with.
    Collective (it transforms copies of ``full``).
    """
    meta = read_meta(path)
    optimizer = model.optimizer
    if not optimizer.built:
        optimizer.build(model.trainable_variables)
    slots = slots_of(optimizer, model.trainable_variables)
    saved = _read_slots(path, meta)
    n_full = len(full.trainable_variables)
    for name, by_index in saved.items():
        values = [by_index.get(i) for i in range(n_full)]
        sharded = _shard_like(full, values, strategy, options)
        for per_var, value in zip(slots, sharded):
            if name in per_var:
                per_var[name].assign(value)
    _inner(optimizer).iterations.assign(meta["iterations"])


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

    Raises:
        ValueError: for a non-``.keras`` path, a negative ``every_n_steps``,
            ``keep`` < 1, or nothing to save (both triggers off).

    Example:
        >>> model.fit(data, epochs=10, callbacks=tfhybrid.callbacks.standard() + [
        ...     tfhybrid.callbacks.Checkpoint("ckpt/last.keras", every_n_steps=500)])
        >>> model = tfhybrid.load("ckpt/last.keras")        # any world size, any strategy
        >>> meta = tfhybrid.checkpoint.read_meta("ckpt/last.keras")
        >>> model.fit(data.skip(meta["step"]), initial_epoch=meta["epoch"], ...)
    """

    def __init__(self, path, every_n_steps: int = 0, every_epoch: bool = True,
                 keep: int | None = None):
        super().__init__()
        if not isinstance(path, (str, os.PathLike)) or not str(path).endswith(".keras"):
            raise ValueError(f"Received an invalid checkpoint path {path!r}; expected a file "
                             "name ending in '.keras'.")
        if isinstance(every_n_steps, bool) or not isinstance(every_n_steps, int) or every_n_steps < 0:
            raise ValueError(f"Received an invalid value for `every_n_steps`: {every_n_steps!r}; "
                             "expected a non-negative integer (0 = only at epoch ends).")
        if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 1):
            raise ValueError(f"Received an invalid value for `keep`: {keep!r}; expected a "
                             "positive integer or None (keep all).")
        if not every_n_steps and not every_epoch:
            raise ValueError("Checkpoint would never save: pass every_n_steps > 0 or "
                             "every_epoch=True.")
        self.path, self.every_n_steps, self.every_epoch, self.keep = (
            str(path), every_n_steps, bool(every_epoch), keep)
        self._epoch = 0
        self._written = []

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if self.every_n_steps and (batch + 1) % self.every_n_steps == 0:
            self._save(self._epoch, batch + 1)

    def on_epoch_end(self, epoch, logs=None):
        if self.every_epoch:
            self._save(epoch + 1, 0)

    def _save(self, epoch, step):
        path = self.path.format(epoch=epoch, step=step)
        save(self.model, path, epoch=epoch, step=step)
        if runtime.is_root() and path != self.path:
            if path in self._written:
                self._written.remove(path)
            self._written.append(path)
            while self.keep and len(self._written) > self.keep:
                old = self._written.pop(0)
                for name in (old, old + SIDE_SUFFIX):
                    if os.path.exists(name):
                        os.unlink(name)
