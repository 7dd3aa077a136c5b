"""Variable layouts: how each weight is held across the grid and how its
gradient must be reduced (pure Python; no TensorFlow or Horovod needed).

Every trainable variable of a tfhybrid model carries a :class:`VariableLayout`.
The :class:`tfhybrid.DistributedOptimizer` reads it to reduce the gradient
over the right process set so that, after reduction, the gradient equals the
single-process gradient of the mean loss over the global batch:

=============  ===========================================  =================================
kind           what each rank holds / computes              reduction of the local gradient
=============  ===========================================  =================================
replicated     the full weight; its local gradient is the   average over the world
               gradient of this rank's loss                 (``group="data"``: over the
                                                            data group only, see below)
partial        the full weight; the true gradient of a      sum over ``group``, average over
               model group is the sum of its ranks'         the rest (= world average x
               local gradients (e.g. spatial layers)        group size)
sharded        a block of the weight; the gradient of the   average over the data group
               block is complete within the model group
=============  ===========================================  =================================

A replicated variable with ``group="data"`` is one whose local gradient is
already identical on every rank of a model group (the model group computes
on the same rows and its activations are replicated there, as in the f, c,
df, s and ds strategies): averaging over the data group alone gives the same
value and skips the model axis. ``tfhybrid.transform`` tags replicated
weights this way when a strategy splits the batch over the data axis only.

``grad_scale`` multiplies the reduced gradient (e.g. 1/K where a model group
sums K ranks' losses, as in SplitBrain's ModuloLayer).

Optimizer slots (momentum, Adam moments, ...) hold per-element state of one
model variable, so they have that variable's layout: a slot linked with
:func:`set_slot_of` reports its variable's layout (a slot of a sharded
kernel is a block too, and must never be broadcast as if replicated).
"""
from __future__ import annotations

import dataclasses
import weakref

from tfhybrid._compat import module_aliases

WEIGHT_LAYOUT_KINDS = ("replicated", "partial", "sharded")
_ATTR = "_tfhybrid_layout"
_SLOT_ATTR = "_tfhybrid_slot_of"


@dataclasses.dataclass(frozen=True)
class VariableLayout:
    """Layout of one variable.

    Attributes:
        kind: "replicated", "partial" or "sharded".
        group: The model-axis group the variable is partial/sharded over
            ("model" or a sub-axis name); for "replicated", "data" means the
            local gradient is identical across the model group (reduce over
            the data group only); any other value means the world.
        axis: The sharded axis of the full weight (sharded only).
        grad_scale: Factor applied after the reduction.
    """

    kind: str = "replicated"
    group: str = "model"
    axis: int | None = None
    grad_scale: float = 1.0

    def __post_init__(self):
        if self.kind not in WEIGHT_LAYOUT_KINDS:
            raise ValueError(f"Received an invalid layout kind: {self.kind!r}; expected one of "
                             f"{WEIGHT_LAYOUT_KINDS}.")


REPLICATED_WEIGHT = VariableLayout()


def set_layout(variable, layout: VariableLayout):
    """Attach ``layout`` to a (Keras or tf) variable and return the variable."""
    if not isinstance(layout, VariableLayout):
        raise TypeError(f"Received an invalid layout: {layout!r}; expected VariableLayout.")
    setattr(variable, _ATTR, layout)
    return variable


def layout_of(variable) -> VariableLayout:
    """The layout attached to ``variable``; for an optimizer slot linked by
    :func:`set_slot_of`, its model variable's layout; replicated otherwise."""
    layout = getattr(variable, _ATTR, None)
    if layout is not None:
        return layout
    owner = slot_owner(variable)
    return layout_of(owner) if owner is not None else REPLICATED_WEIGHT


def set_slot_of(slot, variable):
    """Link optimizer ``slot`` to the model ``variable`` it holds state for.

    The slot then reports ``variable``'s layout (:func:`layout_of`), also when
    the variable's layout is set later. Only a weak reference is kept (no
    checkpoint dependency, no reference cycle). Returns ``slot``.
    """
    setattr(slot, _SLOT_ATTR, weakref.ref(variable))
    return slot


def slot_owner(slot):
    """The model variable ``slot`` was linked to by :func:`set_slot_of`, or None."""
    ref = getattr(slot, _SLOT_ATTR, None)
    return ref() if ref is not None else None


__getattr__ = module_aliases(__name__, globals(), {"KINDS": "WEIGHT_LAYOUT_KINDS",
                                                  "REPLICATED": "REPLICATED_WEIGHT"})
