""":func:`install`: ``compile``/``fit``/``evaluate``/``predict``/``summary`` of a
transformed model, wrapped to run the guards."""
from __future__ import annotations

import inspect
import types

import keras
import numpy as np
import tensorflow as tf

from tfhybrid import batch_losses, runtime
from tfhybrid.layers.spatial.output import full_labels_to_blocks, whole_predictions
from tfhybrid.watchdog import collective_api
from tfhybrid.guards.checksums import (
    _config, batch_checksum, gather_step_sums, input_fingerprint, step_sums_variable)
from tfhybrid.guards.consistency import (
    StartCheck, _batch_checksummed, _data_replicas_checked, _fit_fingerprints, _warn_copies,
    check_steps, local_blocks, planned_steps, row_copies, row_weighting, set_row_copies,
    set_row_weighting)
from tfhybrid.guards.fast_path import after_reading, lean_train_function
from tfhybrid.guards.keras_hooks import (
    _broadcasts, _call_with_callbacks, _holds_shards, _keras_backups, _keras_checkpoints,
    _keras_signature, _quiet_shuffle, _watchdog_callbacks, drop_validation_iterator)
from tfhybrid.guards.metrics import (
    _average_step_logs, metric_ranks, sum_metric_states, summary_note)
from tfhybrid.guards.optimizers import (
    _loss_scale_inside, _wrap_optimizer, carry_weight_decay_exclusions, follow_source_flags,
    refuse_horovod_optimizer, refuse_part_options)
from tfhybrid.guards.step_callbacks import (
    AgreeOnStop, EvaluateRows, GuardCallback, PartRows, part_rows)


_EVAL_HINT = ("model.{0}() of a transformed model is collective (its layers exchange "
              "activations and the metrics are averaged): every rank must call it, each on its "
              "shard of the data (tfhybrid.data.shard(..., model=model)); called under `if "
              "tfhybrid.is_root():` it leaves rank 0 waiting here for ranks that never come. "
              "To evaluate on one process, evaluate tfhybrid.gather(model) there (gather on "
              "every rank).")


_SAVE_FIX = ("Use tfhybrid.save(model, path) on every rank (rank 0 writes a plain .keras "
             "file of the full weights, loadable by keras.saving.load_model, and the "
             "optimizer state beside it), or tfhybrid.gather(model) on every rank and save "
             "that full model ({}), or tfhybrid.save(model, directory, sharded=True) for "
             "per-rank files.")


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

    def compile(self, *args, **kwargs):
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
