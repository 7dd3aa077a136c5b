"""Where the pipeline ``p`` cuts a model (pure: no Horovod): only where a single
tensor crosses (never inside a residual block), balanced by cost."""
import os

import keras
import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from tfhybrid.transformer.graph import as_functional, describe_graph
from tfhybrid.transformer.pipeline import balance, cut_positions, plan_stages


def residual(blocks=2):
    x = keras.Input((8, 8, 3))
    h = keras.layers.Conv2D(4, 3, padding="same", name="stem")(x)
    for b in range(blocks):
        r = keras.layers.Conv2D(4, 3, padding="same", name=f"b{b}_a")(h)
        r = keras.layers.Conv2D(4, 3, padding="same", name=f"b{b}_b")(r)
        short = keras.layers.Conv2D(4, 1, name=f"b{b}_proj")(h)      # projection shortcut
        h = keras.layers.Add(name=f"b{b}_add")([short, r])
    h = keras.layers.GlobalAveragePooling2D(name="gap")(h)
    return keras.Model(x, keras.layers.Dense(3, name="out")(h), name="res")


def _after(model):
    """Names of the layers after which the model may be cut."""
    graph = describe_graph(as_functional(model))
    return [graph.nodes[k - 1].name for k in cut_positions(graph)]


def test_sequential_cuts_between_every_layer():
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(4, name="a"),
                              keras.layers.Dense(4, name="b"), keras.layers.Dense(2, name="c")])
    assert _after(model) == ["a", "b"]


def test_residual_blocks_are_never_cut_inside():
    assert _after(residual()) == ["stem", "b0_add", "b1_add", "gap"]


def test_input_skip_has_no_cut_before_it_joins():
    x = keras.Input((4,))
    h = keras.layers.Dense(4, name="a")(x)
    h = keras.layers.Dense(4, name="b")(h)
    y = keras.layers.Add(name="add")([x, h])
    model = keras.Model(x, keras.layers.Dense(2, name="out")(y))
    assert _after(model) == ["add"]


def test_balance_minimises_the_largest_stage():
    assert balance([1, 1, 1, 1], (1, 2, 3), 2) == (2,)
    assert balance([5, 1, 1, 1, 1, 1], (1, 2, 3, 4, 5), 2) == (1,)
    assert balance([1, 1, 1, 1, 1, 1], (1, 2, 3, 4, 5), 3) == (2, 4)
    assert balance([1, 1, 1, 1], (3,), 2) == (3,)        # the only allowed cut
    assert balance([3, 1, 1, 3], (1, 2, 3), 4) == (1, 2, 3)


def test_plan_stages_by_flops_and_by_layer_times():
    model = as_functional(residual())
    plan = plan_stages(model, 2)
    assert plan.by == "flops" and len(plan.stages) == 2 and plan.positions == 4
    flat = [n for stage in plan.stages for n in stage]
    assert flat == [n.name for n in describe_graph(model).nodes]
    assert plan.cuts[0] in ("b0_add", "b1_add")
    # Calibrated times: the first block very slow -> the cut right after it.
    times = {n: (1e-6, 2e-6) for n in flat}
    times.update({"b0_a": (1.0, 2.0), "b0_b": (1.0, 2.0)})
    plan = plan_stages(model, 2, {"alpha": 1e-5, "beta": 1e-9, "layer_times": times,
                                  "flop_rate": 1e9})
    assert plan.by == "layer_times" and plan.cuts == ("b0_add",)
    assert plan.costs[0] > 5 and plan.costs[1] < 1e-3


def test_more_stages_than_cut_points_is_refused():
    with pytest.raises(ValueError, match=r"stages=6 .* cut at only 4 places .* stages <= 5"):
        plan_stages(as_functional(residual()), 6)
