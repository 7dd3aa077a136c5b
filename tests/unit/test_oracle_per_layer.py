"""Gholami's integrated per-layer plan (tfhybrid.oracle.per_layer), pure Python."""
import math

import pytest

from tfhybrid.oracle import per_layer
from tfhybrid.oracle.profile import LayerRow, ModelProfile

FREE = {"alpha": 0.0, "beta": 0.0, "flop_rate": 1e6}
HIGH_LATENCY = {"alpha": 1.0, "beta": 1e-12, "flop_rate": 1e12}


def conv(name, hw, c, f, k=3):
    items_in, items_out = hw * hw * c, hw * hw * f
    flops = 2.0 * hw * hw * k * k * c * f
    return LayerRow(name, "conv", k * k * c * f + f, k * k * c * f, f, flops, 2 * flops,
                    items_in, items_out, c, f, (hw, hw), (hw, hw), (k, k), (1, 1),
                    halo_x=hw * c, halo_dy=hw * f)


def dense(name, i, o):
    return LayerRow(name, "dense", i * o + o, i * o, o, 2.0 * i * o, 4.0 * i * o, i, o, i, o)


def profile():
    rows = (conv("conv1", 16, 4, 8), conv("conv2", 16, 8, 8), dense("fc1", 2048, 64),
            dense("fc2", 64, 8))
    return ModelProfile("m", rows, 8)


def test_every_grid_gets_its_best_plan_fastest_first():
    plans = per_layer.integrated_plans(profile(), 4, 8, FREE)
    assert sorted(pl.model_parallel for pl in plans) == [1, 2, 4]
    assert [pl.total_s for pl in plans] == sorted(pl.total_s for pl in plans)
    best = plans[0]
    assert best.model_parallel == 4           # free communication: split everything 4 ways
    assert all(c.choice != "replicate" for c in best.layers)
    assert [c.name for c in best.layers] == ["conv1", "conv2", "fc1", "fc2"]


def test_high_latency_keeps_data_parallelism_fewest_collectives():
    plans = per_layer.integrated_plans(profile(), 4, 8, HIGH_LATENCY)
    assert plans[0].strategy == "d" and plans[0].options == {}


def test_options_are_transform_options():
    for pl in per_layer.integrated_plans(profile(), 4, 8, FREE):
        if pl.strategy in ("s", "ds"):
            assert pl.options["spatial"] == "height" and pl.options["spatial_layers"] >= 1
            assert set(pl.options["layers"]) == {c.name for c in pl.layers if c.choice != "s"}
        elif pl.strategy in ("f", "df"):
            assert set(pl.options["layers"]) == {c.name for c in pl.layers}


def test_each_choice_is_the_cheapest_alternative_or_a_pair():
    pl = per_layer.grid_plan(per_layer.Context(profile(), per_layer.as_machine(
        {"alpha": 1e-5, "beta": 1e-9, "flop_rate": 1e9}), 8), 4, 2)
    for c in pl.layers:
        if c.choice == "s" or c.paired_with:
            continue
        assert c.costs[c.choice] == min(c.costs.values()), c
    assert "ms" in pl.table() and "conv1" in pl.table()


def test_a_layer_that_cannot_split_costs_inf_and_is_replicated():
    rows = (dense("fc1", 64, 64), dense("fc2", 64, 3))     # 3 units: not divisible by 2
    plan = per_layer.integrated_plans(ModelProfile("m", rows, 8), 2, 8, FREE,
                                      model_parallel=2)[0]
    fc2 = [c for c in plan.layers if c.name == "fc2"][0]
    assert math.isinf(fc2.costs["f"])
    assert fc2.choice in ("c", "replicate")


def test_bad_arguments():
    with pytest.raises(ValueError, match=r"model_parallel=3.*does not divide p=4"):
        per_layer.integrated_plans(profile(), 4, 8, FREE, model_parallel=3)
    with pytest.raises(ValueError, match=r"batch_size=0"):
        per_layer.integrated_plans(profile(), 4, 0, FREE)
