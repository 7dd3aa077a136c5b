"""The guarded model: ``compile``/``fit``/``evaluate``/``predict``/``summary`` of a
transformed model, run with the guards.

:func:`install` gives a transformed model a subclass of its own class (cached
per class) whose methods run the guards around Keras' own: :class:`GuardedModel`
for models built by the planner and rewriter, :class:`GuardedPartModel` for
``p``/``ls`` models, whose ranks run different layers with their own train
step. The subclass keeps the name and module of the model's class, so Keras
serializes the model exactly as before; the per-model state (the checksum
variables the traced steps update) is held in ``_tfhybrid_*`` attributes.
"""
from __future__ import annotations

import inspect

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



def _base(model):
    """The model's own class, whose methods the guarded ones wrap."""
    return type(model)._tfhybrid_base


def _state(model, name):
    """One of the per-model variables :func:`install` creates."""
    return object.__getattribute__(model, f"_tfhybrid_{name}")


def _refusing_shards(name, problem, fix):
    """Keras' ``name`` unchanged on a model of plain layers; on split layers a
    ValueError naming ``problem`` and ``fix`` instead of one rank's shards."""
    def method(self, *args, **kwargs):
        if _holds_shards(self):
            raise ValueError(f"model.{name}() {problem.format(self.name)} {fix}")
        return getattr(_base(self), name)(self, *args, **kwargs)
    method.__name__ = name
    return method


class _GuardedMethods:
    """What every guarded model runs: fit, evaluate and predict with the watchdog,
    the start checks and the collective-call hints; Keras' save/load refusing
    with the tfhybrid way to do it."""

    _tfhybrid_base = None      # the model's own class (set on each guarded subclass)
    _tfhybrid_part = False

    def fit(self, *args, **kwargs):
        cls, part = _base(self), self._tfhybrid_part
        bound = _keras_signature(cls.fit).bind(self, *args, **kwargs)
        _keras_checkpoints(self, bound)          # may raise: before any collective
        _keras_backups(self, bound)              # may raise: before any collective
        _quiet_shuffle(bound)
        object.__setattr__(self, "_tfhybrid_broadcast_in_fit", False)   # set by the callback
        object.__setattr__(self, "_tfhybrid_start_check", None)
        object.__setattr__(self, "_tfhybrid_validation_copies", None)
        extra = _watchdog_callbacks() + _fit_checks(self, bound, part)
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
        cls, part = _base(self), self._tfhybrid_part
        bound = _keras_signature(cls.evaluate).bind(self, *args, **kwargs)
        in_fit = isinstance(bound.arguments.get("callbacks"), keras.callbacks.CallbackList)
        compare = (_config().guards and not part and runtime.current_grid().size > 1
                   and _data_replicas_checked(self))
        fit_copies, fit_weighting = row_copies(self), row_weighting(self)
        extra = _watchdog_callbacks() + _evaluate_checks(self, bound, part, in_fit, compare)
        outer = getattr(self, "_tfhybrid_evaluating", False)
        object.__setattr__(self, "_tfhybrid_evaluating", True)
        try:
            return _call_with_callbacks(cls.evaluate, self, args, kwargs, extra)
        finally:
            object.__setattr__(self, "_tfhybrid_evaluating", outer)
            if compare:
                set_row_copies(self, fit_copies)    # a callback's evaluate inside fit too
                set_row_weighting(self, fit_weighting)

    @collective_api("model.predict", _EVAL_HINT.format("predict"))
    def predict(self, *args, **kwargs):
        out = _call_with_callbacks(_base(self).predict, self, args, kwargs,
                                   _watchdog_callbacks())
        # whole volumes, as one process predicts them (s/ds outputs stay in blocks)
        return whole_predictions(self, out) if not self._tfhybrid_part else out

    save = _refusing_shards(
        "save", "of transformed model {!r} would write only this rank's part of its split "
        "layers, in tfhybrid layers that need this process grid to load.",
        _SAVE_FIX.format("e.g. full.save(path) on rank 0"))
    save_weights = _refusing_shards(
        "save_weights", "of transformed model {!r} would write only this rank's part of its "
        "split layers.", _SAVE_FIX.format("e.g. full.save_weights(path) on rank 0"))
    load_weights = _refusing_shards(
        "load_weights", "into transformed model {!r}: its split layers hold this rank's part "
        "of each weight, so a weights file of the full model does not fit them.",
        "Load full weights into the original model before tfhybrid.transform (it copies "
        "them; loading on rank 0 only is enough: transform broadcasts them), or resume a "
        "tfhybrid checkpoint with tfhybrid.load(path).")


def _fit_checks(model, bound, part):
    """The guard callbacks of one ``fit`` (and its start check, run or scheduled)."""
    config, extra = _config(), []
    if config.guards and runtime.current_grid().size > 1 and not part:   # 1 process: no peers
        set_row_copies(model, 1)      # until the inputs are compared
        check = StartCheck(model, planned_steps(bound.arguments, "steps_per_epoch"),
                           _fit_fingerprints(bound.arguments), local_blocks(bound.arguments))
        if _broadcasts(bound.arguments.get("callbacks")):
            # rides in the broadcast callback's allgather, before its broadcasts
            # (the GuardCallback runs it if that callback does not)
            object.__setattr__(model, "_tfhybrid_start_check", check)
        else:       # before the first collective of the fit
            check.run_alone()
        step_sums_variable(model)
        extra.append(GuardCallback(_state(model, "batch_checksum"), config.guard_every_steps,
                                   _state(model, "batch_checksum_due"),
                                   _state(model, "weight_checksums_due")))
        extra.append(EvaluateRows(_state(model, "batch_checksum"),     # validation on a
                                  _state(model, "evaluate_checksum_due")))   # dataset
    if part and config.guards and part_rows(model) is not None:
        extra.append(PartRows(_state(model, "batch_checksum"),      # each part fed the
                              _state(model, "batch_checksum_due")))  # rows it needs
    return extra


def _evaluate_checks(model, bound, part, in_fit, compare):
    """The guard callbacks of one ``evaluate``; sets the rows' copies it found."""
    extra = []
    if _config().guards and not part and not in_fit:      # fit's validation: fit checked
        copies = check_steps(model, planned_steps(bound.arguments, "steps"), "evaluate",
                             input_fingerprint(bound.arguments.get("x"),
                                               bound.arguments.get("y")) if compare else None,
                             local_blocks(bound.arguments) if compare else None)
    else:
        copies = getattr(model, "_tfhybrid_validation_copies", None) if compare else None
    object.__setattr__(model, "_tfhybrid_rows_unknown", compare and copies is None)
    if compare:
        set_row_copies(model, copies or 1)
        if copies is None and not in_fit:   # a dataset: its first batch tells (fit
            extra.append(EvaluateRows(_state(model, "batch_checksum"),    # lists its own)
                                      _state(model, "evaluate_checksum_due")))
        elif copies is not None and copies > 1:
            _warn_copies(model, copies, "in evaluate")
    if part and not in_fit and _config().guards and part_rows(model) is not None:
        extra.append(PartRows(_state(model, "batch_checksum"),      # fit's validation:
                              _state(model, "batch_checksum_due")))  # fit's callback
    return extra


def _checksum_rows(model, data):
    """The rows a batch checksum covers: split labels (per-voxel outputs under
    s/ds) differ within a model group, so only the inputs then."""
    split = any(getattr(model, "_tfhybrid_split_outputs", ())) and isinstance(data, tuple)
    return data[0] if split else data


class GuardedModel(_GuardedMethods):
    """The methods of a transformed model built by the planner and rewriter.

    ``compile`` wraps a plain optimizer in :class:`tfhybrid.DistributedOptimizer`;
    the traced steps compare batches across the ranks that must feed the same
    rows and weigh unequal row blocks; epoch logs, ``evaluate`` and
    ``*_on_batch`` return the global batch's metrics; ``summary`` adds the
    layout note; the train function takes the lean path.
    """

    def compile(self, *args, **kwargs):
        cls = _base(self)
        bound = inspect.signature(cls.compile).bind(self, *args, **kwargs)
        bound.arguments["optimizer"] = _wrap_optimizer(bound.arguments.get("optimizer",
                                                                            "rmsprop"))
        follow_source_flags(self)
        carry_weight_decay_exclusions(self, bound.arguments["optimizer"])
        if _loss_scale_inside(self, bound.arguments["optimizer"],
                              bound.arguments.get("auto_scale_loss", True)):
            bound.arguments["auto_scale_loss"] = False     # done: no second LossScaleOptimizer
        return cls.compile(*bound.args, **bound.kwargs)

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        inner = self._tfhybrid_inner_compute_loss     # a split-output wrapper, or Keras'
        if inner is None:
            loss = _base(self).compute_loss(self, x, y, y_pred, sample_weight,
                                            training=training)
        else:
            loss = inner(x, y, y_pred, sample_weight, training=training)
        return batch_losses.whole_regularization(self, loss)

    def train_step(self, data):
        data = full_labels_to_blocks(self, data)     # fit(x, y) with whole-volume labels
        batch_losses.wrap(self)                      # reduction="sum" losses: x row blocks
        batch_losses.wrap_metrics(self)              # batch-level metric functions: whole
        checksum, due = _state(self, "batch_checksum"), _state(self, "batch_checksum_due")
        # Only where ranks of a model group must feed the same rows (nothing to
        # compare otherwise: pure data parallelism, one process), and only on
        # the steps the GuardCallback checks.
        with after_reading(data):
            if _config().guards and _batch_checksummed(self):
                rows = _checksum_rows(self, data)
                checksum.assign(tf.cond(due, lambda: batch_checksum(rows), checksum.read_value))
            with batch_losses.weighted_rows(self, batch_losses.rows_factor(
                    self, data, _state(self, "row_weighting"))):
                logs = _base(self).train_step(self, data)
            if _config().guards and runtime.current_grid().size > 1:
                gather_step_sums(self, checksum, _state(self, "weight_checksums_due"))
        return logs

    def test_step(self, data):
        batch_losses.wrap(self)
        batch_losses.wrap_metrics(self)
        data = full_labels_to_blocks(self, data)
        checksum, due = _state(self, "batch_checksum"), _state(self, "evaluate_checksum_due")
        with after_reading(data):
            if _config().guards and _data_replicas_checked(self):     # EvaluateRows' batch
                rows = _checksum_rows(self, data)
                checksum.assign(tf.cond(due, lambda: batch_checksum(rows), checksum.read_value))
            with batch_losses.weighted_rows(self, batch_losses.rows_factor(
                    self, data, _state(self, "row_weighting"))):
                return _base(self).test_step(self, data)

    def make_train_function(self, force=False):
        if self.train_function is not None and not force:
            return self.train_function
        _base(self).make_train_function(self, force=force)
        self.train_function = lean_train_function(self, self.train_function)
        return self.train_function

    def _get_metrics_result_or_logs(self, logs):
        # Called eagerly, on every rank, at the end of evaluate and of each fit
        # epoch (before validation and the callbacks): the epoch's train logs
        # become the global batch's (rather than each rank's own rows, so that
        # EarlyStopping/ReduceLROnPlateau on "loss" decide as one process does).
        cls = _base(self)
        if not (tf.executing_eagerly() and _config().average_metrics
                and runtime.current_grid().size > 1):
            return cls._get_metrics_result_or_logs(self, logs)
        object.__setattr__(self, "_tfhybrid_logs_global", True)   # MetricAverageCallback
        sum_metric_states(self)
        out = cls._get_metrics_result_or_logs(self, logs)
        if out is logs and isinstance(logs, dict):   # custom test_step: its own logs
            out = _average_step_logs(logs, metric_ranks(self))
        return out

    @collective_api("model.train_on_batch", _EVAL_HINT.format("train_on_batch"))
    def train_on_batch(self, *args, **kwargs):
        return _global_batch_logs(self, "train_on_batch", args, kwargs)

    @collective_api("model.test_on_batch", _EVAL_HINT.format("test_on_batch"))
    def test_on_batch(self, *args, **kwargs):
        return _global_batch_logs(self, "test_on_batch", args, kwargs)

    def summary(self, *args, **kwargs):
        cls = _base(self)
        bound = inspect.signature(cls.summary).bind(self, *args, **kwargs)
        out = cls.summary(*bound.args, **bound.kwargs)
        print_fn = bound.arguments.get("print_fn")
        (print_fn or print)(summary_note(self))     # Keras calls print_fn(text) the same way
        return out


def _global_batch_logs(model, name, args, kwargs):
    """Keras' ``train_on_batch``/``test_on_batch`` with the batch's logs of the
    global batch, as one process computes them (Keras resets the metrics
    before the step, so summing the states gives that batch's), not each
    rank's own rows' loss and metrics."""
    keras_method = getattr(_base(model), name)
    bound = _keras_signature(keras_method).bind(model, *args, **kwargs)
    return_dict = bound.arguments.get("return_dict", False)
    bound.arguments["return_dict"] = True
    logs = keras_method(*bound.args, **bound.kwargs)
    if _config().average_metrics and runtime.current_grid().size > 1:
        logs = {k: float(np.asarray(v)) if np.ndim(v) == 0 else np.asarray(v)
                for k, v in model._get_metrics_result_or_logs(logs).items()}
    return logs if return_dict else model._flatten_metrics_in_order(logs)


class GuardedPartModel(_GuardedMethods):
    """The methods of a ``p``/``ls`` model: its ranks run different layers with
    their own train step, reductions and metrics, so their structures and
    weights differ by design. No consistency checks, optimizer wrapping or
    lean train function; the steps checksum the rows :class:`PartRows` compares."""

    _tfhybrid_part = True

    def compile(self, *args, **kwargs):
        # p/ls apply their own optimizer step (no wrapping), but Horovod's Keras
        # optimizer fails inside their step as it does in Keras'.
        cls = _base(self)
        bound = inspect.signature(cls.compile).bind(self, *args, **kwargs)
        optimizer = bound.arguments.get("optimizer")
        refuse_horovod_optimizer(optimizer)
        from tfhybrid.optimizer import DistributedOptimizer

        if isinstance(optimizer, DistributedOptimizer):
            refuse_part_options(optimizer, self.tfhybrid_strategy)
        follow_source_flags(self)
        if optimizer is not None and not isinstance(optimizer, str):
            carry_weight_decay_exclusions(self, optimizer)
        return cls.compile(*bound.args, **bound.kwargs)

    def train_step(self, data):
        return self._part_step(_base(self).train_step, data)

    def test_step(self, data):
        return self._part_step(_base(self).test_step, data)

    def _part_step(self, keras_step, data):
        """The batch checksum of the steps :class:`PartRows` compares, then Keras' step."""
        checksum, due = _state(self, "batch_checksum"), _state(self, "batch_checksum_due")
        with after_reading(data):
            rows = part_rows(self) if _config().guards else None
            if rows is not None:
                position = tf.constant(rows[0], tf.int32)
                checksum.assign(tf.cond(due, lambda: batch_checksum(data, position),
                                        checksum.read_value))
            return keras_step(self, data)


_CLASSES = {}


def _guarded_class(cls, part):
    """The subclass of ``cls`` with the guarded methods (one per class): same name
    and module as ``cls``, so Keras serializes its models as ``cls``'s."""
    key = (cls, part)
    if key not in _CLASSES:
        methods = GuardedPartModel if part else GuardedModel
        _CLASSES[key] = type(cls.__name__, (methods, cls),
                             {"__module__": cls.__module__, "__qualname__": cls.__qualname__,
                              "_tfhybrid_base": cls})
    return _CLASSES[key]


def install(model, part=False):
    """Make transformed ``model``'s compile/fit/evaluate/predict run the guards.

    The model becomes an instance of a subclass of its class
    (:class:`GuardedModel` or, with ``part``, :class:`GuardedPartModel`, over
    it), which Keras serializes as its class; idempotent. ``part=True``: a
    ``p``/``ls`` model, whose ranks run different layers with their own train
    step and reductions.
    """
    if getattr(model, "_tfhybrid_guarded", False):
        return model
    variables = {
        "batch_checksum": tf.Variable(0.0, dtype=tf.float64, trainable=False,
                                      name="tfhybrid_batch_checksum"),
        # True before the steps whose batch the GuardCallback compares (set by it):
        # the traced step skips the checksum's work on the other steps.
        "batch_checksum_due": tf.Variable(True, trainable=False,
                                          name="tfhybrid_batch_checksum_due"),
        # True before the steps whose weights the GuardCallback compares: the
        # traced step gathers the checksums itself (gather_step_sums)
        "weight_checksums_due": tf.Variable(False, trainable=False,
                                            name="tfhybrid_weight_checksums_due"),
        # True for the first step of an evaluate whose rows are compared (EvaluateRows)
        "evaluate_checksum_due": tf.Variable(False, trainable=False,
                                             name="tfhybrid_evaluate_checksum_due"),
    }
    if not part:
        # ranks of a row-block group feeding the very same rows (batch_losses' sum)
        variables["row_copies"] = tf.Variable(1.0, trainable=False, name="tfhybrid_row_copies")
        # set by fit's start check when the ranks' blocks of a step may hold
        # unequal rows: train_step then weighs each block by its rows (batch_losses)
        variables["row_weighting"] = tf.Variable(False, trainable=False,
                                                 name="tfhybrid_row_weighting")
    for name, variable in variables.items():
        object.__setattr__(model, f"_tfhybrid_{name}", variable)
    # a compute_loss set on the instance (split outputs) would hide the class's
    object.__setattr__(model, "_tfhybrid_inner_compute_loss",
                       vars(model).pop("compute_loss", None))
    object.__setattr__(model, "__class__", _guarded_class(type(model), part))
    object.__setattr__(model, "_tfhybrid_guarded", True)
    return model
