"""Keras' own callbacks made right for a multi-process run: ``ModelCheckpoint`` and
``BackupAndRestore`` on rank 0, log writers and progress bars, the watchdog's callback."""
from __future__ import annotations

import inspect
import os

import keras
import tensorflow as tf

from tfhybrid import runtime
from tfhybrid.guards.optimizers import _from_horovod_keras


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


def _watchdog_callbacks():
    """The watchdog's callback, when the watchdog runs (multi-process jobs): in
    one process, or with the watchdog off, its per-step hooks would do nothing."""
    from tfhybrid import watchdog

    return [watchdog.WatchdogCallback()] if watchdog.get().enabled else []


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


def _holds_shards(model) -> bool:
    """Whether a transformed model holds tfhybrid layers (split weights, or layers
    that exchange activations), or is one rank's part of the model (a pipeline
    stage, an ``ls`` worker), so that Keras' own save/load would see only this
    rank's part. A model of plain Keras layers (``d``, or nothing split) does not."""
    if getattr(model, "_tfhybrid_part", False):
        return True
    return any(type(layer).__module__.startswith("tfhybrid.")
               for layer in model._flatten_layers(include_self=False, recursive=True))
