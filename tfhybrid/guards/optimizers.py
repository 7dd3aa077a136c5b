"""The optimizer a transformed model compiles with: plain optimizers wrapped in
:class:`tfhybrid.DistributedOptimizer`, Horovod's refused, weight-decay exclusions
and ``trainable`` flags carried over from the source model."""
from __future__ import annotations

import warnings

import keras

from tfhybrid import runtime


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
    from tfhybrid.optimizer.slots import keras_optimizer

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
