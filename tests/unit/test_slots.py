"""Optimizer slots report their model variable's layout.

A slot of a sharded weight (Adam's moments, SGD momentum, RMSprop's
velocities, gradient accumulators) is a block of state; the broadcast at the
start of ``fit`` reads its layout from the slot.
"""
import keras
import pytest

from tfhybrid import DistributedOptimizer
from tfhybrid.layout import VariableLayout, layout_of, set_layout, slot_owner
from tfhybrid.optimizer.slots import link_slots, tracking_slots

SHARDED = VariableLayout("sharded", "model", axis=-1)


def _model():
    inputs = keras.Input((3,))
    x = keras.layers.Dense(4, name="fc")(inputs)
    x = keras.layers.Dense(4, name="fc_1")(x)          # a name that extends "fc"
    return keras.Model(inputs, keras.layers.Dense(2, name="out")(x))


OPTIMIZERS = [lambda: keras.optimizers.Adam(0.1),
              lambda: keras.optimizers.SGD(0.1, momentum=0.9),
              lambda: keras.optimizers.RMSprop(0.1, momentum=0.5, centered=True),
              lambda: keras.optimizers.Lion(0.1)]


def _slots(optimizer):
    return [v for v in optimizer.variables if v.shape.rank]   # not iterations/lr


def _check_owners(model, optimizer):
    for slot in _slots(optimizer):
        owner = slot_owner(slot)
        assert owner is not None, slot.name
        assert slot.name.startswith(owner.path.replace("/", "_") + "_"), (slot.name, owner.path)
    kernel = model.get_layer("fc").kernel
    set_layout(kernel, SHARDED)                             # set after the slots exist
    owned = [s for s in _slots(optimizer) if slot_owner(s) is kernel]
    assert owned and all(layout_of(s) == SHARDED for s in owned)
    others = [s for s in _slots(optimizer) if slot_owner(s) is not kernel]
    assert all(layout_of(s).kind == "replicated" for s in others)


@pytest.mark.parametrize("make", OPTIMIZERS)
def test_distributed_optimizer_links_its_slots_when_it_builds(make):
    model = _model()
    optimizer = DistributedOptimizer(make(), backward_passes_per_step=2)
    optimizer.build(model.trainable_variables)
    _check_owners(model, optimizer)
    assert "add_variable_from_reference" not in vars(optimizer.inner_optimizer)   # unpatched


@pytest.mark.parametrize("make", OPTIMIZERS)
def test_slots_of_an_optimizer_built_elsewhere_are_linked_by_name(make):
    model = _model()
    optimizer = make()
    optimizer.build(model.trainable_variables)
    assert link_slots(optimizer.variables, model.trainable_variables) == len(_slots(optimizer))
    _check_owners(model, optimizer)


def test_tracking_slots_links_exactly_and_restores_the_method():
    model = _model()
    optimizer = keras.optimizers.Adam()
    with tracking_slots(optimizer):
        optimizer.build(model.trainable_variables)
    assert "add_variable_from_reference" not in vars(optimizer)
    _check_owners(model, optimizer)
    assert not any(slot_owner(v) for v in optimizer.variables if not v.shape.rank)
