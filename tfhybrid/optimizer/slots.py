"""Optimizer slots know which model variable they belong to (and so its layout).

A Keras 3 optimizer creates its per-variable state (SGD momentum, Adam's
moments, RMSprop's velocities, gradient accumulators, ...) with
``add_variable_from_reference(variable, name)``. Such a slot of a sharded
weight is a block of state, different on every rank of a model group; the
broadcast of the initial state (:mod:`tfhybrid.callbacks`) and any
consistency check must treat it like its weight. Two ways link a slot to its
variable (:func:`tfhybrid.layout.set_slot_of`):

- :func:`tracking_slots`: while an optimizer builds, every slot it creates
  from a reference is linked to that reference (exact; used by
  :class:`tfhybrid.DistributedOptimizer` and by the broadcast callback when it
  builds the optimizer itself);
- :func:`link_slots`: for an optimizer built elsewhere, by Keras' slot naming
  rule (``<variable path with '/' -> '_'>_<slot name>``), longest match first,
  then same shape.
"""
from __future__ import annotations

import contextlib

from tfhybrid.layout import set_slot_of, slot_owner

_METHOD = "add_variable_from_reference"


@contextlib.contextmanager
def tracking_slots(optimizer):
    """Within this context, slots ``optimizer`` creates are linked to their variables.

    Example:
        >>> with tracking_slots(adam):
        ...     adam.build(model.trainable_variables)
    """
    if _METHOD in vars(optimizer):      # already tracking (nested build)
        yield optimizer
        return
    original = getattr(optimizer, _METHOD)

    def add_variable_from_reference(reference_variable, *args, **kwargs):
        slot = original(reference_variable, *args, **kwargs)
        set_slot_of(slot, reference_variable)
        return slot

    object.__setattr__(optimizer, _METHOD, add_variable_from_reference)
    try:
        yield optimizer
    finally:
        object.__delattr__(optimizer, _METHOD)


def slot_prefix(variable):
    """Keras' name prefix of ``variable``'s slots: its path, '/' -> '_', then '_'."""
    path = getattr(variable, "path", None)
    if path is None:
        path = str(variable.name).replace(":", "_")
    return path.replace("/", "_") + "_"


def link_slots(optimizer_variables, model_variables):
    """Link unlinked optimizer variables to model variables by Keras' slot names.

    A slot named ``<path of v with '/' -> '_'>_<anything>`` belongs to ``v``
    (the longest such prefix wins, then the same shape). Variables that match
    no model variable (iterations, learning rate) stay unlinked, i.e.
    replicated. Not covered: state made with ``add_variable`` under another
    name (Adafactor's factored moments, which are not per-block state of a
    sharded weight anyway). Returns the number of slots linked.
    """
    prefixes = sorted(((slot_prefix(v), v) for v in model_variables),
                      key=lambda item: -len(item[0]))
    linked = 0
    for slot in optimizer_variables:
        if slot_owner(slot) is not None:
            continue
        name = str(getattr(slot, "name", ""))
        matches = [v for prefix, v in prefixes if name.startswith(prefix)]
        if not matches:
            continue
        longest = len(slot_prefix(matches[0]))
        same = [v for v in matches if len(slot_prefix(v)) == longest]
        shaped = [v for v in same if tuple(v.shape) == tuple(slot.shape)]
        set_slot_of(slot, (shaped or same)[0])
        linked += 1
    return linked


def inner(optimizer):
    """The Keras optimizer holding the slots (inside a DistributedOptimizer)."""
    return getattr(optimizer, "inner_optimizer", optimizer)


def keras_optimizer(optimizer):
    """The Keras optimizer inside the DistributedOptimizer and LossScaleOptimizer
    (mixed_float16) wrappers: the one that counts the applied steps (a
    LossScaleOptimizer's ``iterations`` is its inner optimizer's) and holds
    ``exclude_from_weight_decay``'s settings."""
    while hasattr(optimizer, "inner_optimizer"):
        optimizer = optimizer.inner_optimizer
    return optimizer


def step_count(optimizer) -> int:
    """The optimizer's count of applied gradients (Keras' ``_iterations``).

    With ``gradient_accumulation_steps=k``, Keras' ``iterations`` is that
    count floor-divided by k, a read-only tensor: a checkpoint records (and
    restores into) the raw count, so a resume keeps the position inside an
    accumulation cycle (the accumulators are saved as the slot
    ``gradient_accumulator``)."""
    inner = keras_optimizer(optimizer)
    return int(getattr(inner, "_iterations", inner.iterations).numpy())


def set_step_count(optimizer, count: int) -> None:
    """Set what :func:`step_count` reads."""
    inner = keras_optimizer(optimizer)
    getattr(inner, "_iterations", inner.iterations).assign(count)


def slots_of(optimizer, variables) -> list:
    """Per variable of ``variables``, ``{slot name: optimizer variable}``.

    Uses the slot -> variable links of :mod:`tfhybrid.optimizer.slots`
    (recorded while the optimizer built, else made here from Keras' slot
    names); a slot's name is its Keras name without its variable's prefix
    (``"momentum"``, ``"velocity"``), so slots of different models and
    world sizes line up by name.
    """
    slots = list(inner(optimizer).variables)
    if optimizer is not inner(optimizer):   # DistributedOptimizer's own per-variable state:
        seen = {id(s) for s in slots}          # backward_passes_per_step accumulators,
        slots += [s for s in optimizer.variables if id(s) not in seen]   # delayed FC grads
    link_slots(slots, variables)
    index = {id(v): i for i, v in enumerate(variables)}
    out = [dict() for _ in variables]
    for slot in slots:
        owner = slot_owner(slot)
        i = index.get(id(owner))
        if i is None or tuple(slot.shape) != tuple(owner.shape):
            continue
        prefix = slot_prefix(owner)
        if slot.name.startswith(prefix):
            out[i][slot.name[len(prefix):]] = slot
    return out


def slot_names(slots):
    """The slot names of ``slots`` (as :func:`slots_of` returns), each once, in order of appearance."""
    names = []
    for per_var in slots:
        for name in per_var:
            if name not in names:
                names.append(name)
    return names
