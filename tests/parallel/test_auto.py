"""``strategy="auto"`` under horovodrun -np 2 and -np 4: whatever it chooses
(grid, strategy, per-layer plan) builds and trains exactly like the
single-process model.

Three machine files steer the oracle to different corners: the calibrated
development box, a machine whose communication is free and compute slow
(splitting every layer wins), and one whose latency is huge (few collectives
win). The choices differ; each is trained two steps and compared with
single-process training after ``gather``.
"""
import keras
import numpy as np
import pytest

import tfhybrid
from tfhybrid.compose import transform
from tfhybrid.transformer import gather
from tfhybrid.transformer.api import info_of

from conftest import world_size
import test_transform
from test_transform import assert_weights_close, cnn, data, reference, train

N = world_size()
BATCH = 8
MACHINES = {
    "calibrated": None,
    "free_comm": {"alpha": 0.0, "beta": 0.0, "flop_rate": 1e6},
    "slow_latency": {"alpha": 1.0, "beta": 1e-12, "flop_rate": 1e12},
}


def big_head(seed=0):
    """Two convolutions and a wide FC head (SplitBrain's shape in miniature)."""
    keras.utils.set_random_seed(seed)
    return keras.Sequential([
        keras.Input((8, 8, 3)),
        keras.layers.Conv2D(8, 3, padding="same", activation="relu", name="conv1"),
        keras.layers.MaxPooling2D(name="pool1"),
        keras.layers.Conv2D(8, 3, padding="same", activation="relu", name="conv2"),
        keras.layers.Flatten(name="flat"),
        keras.layers.Dense(64, activation="relu", name="fc1"),
        keras.layers.Dense(32, activation="relu", name="fc2"),
        keras.layers.Dense(4, activation="softmax", name="out")], name="big_head")


test_transform.MODELS["big_head"] = big_head     # reference() builds models by name


@pytest.mark.parametrize("machine", list(MACHINES))
def test_auto_choice_builds_and_trains_exactly(grid_of, machine):
    grid_of(1)
    x, y = data()
    seen = []
    for name in ("cnn", "big_head"):
        expected = reference(name, x, y)
        original = test_transform.MODELS[name]()
        initial = original.get_weights()
        options = {"machine": MACHINES[machine]} if MACHINES[machine] else {}
        pmodel = transform(original, "auto", batch_size=BATCH, fallback="replicate", **options)
        choice = info_of(pmodel).auto
        seen.append((name, choice.strategy, choice.model_parallel, choice.plan is not None))
        assert choice.model_parallel == tfhybrid.grid().model_size
        assert info_of(pmodel).grid.model_size == choice.model_parallel
        train(pmodel, x, y)
        full = gather(pmodel)
        text = tfhybrid.describe(pmodel, print_fn=None).text
        assert "auto: " in text and "chosen" in text
        assert_weights_close(full.get_weights(), expected, initial)
        tfhybrid.shutdown()
        tfhybrid.init(model_parallel=1)
    print(f"\nauto at np{N} on {machine}: {seen}")
    if machine == "free_comm":     # splitting is free: every layer is split over all ranks
        assert all(k == N for _, _, k, _ in seen), seen


def test_keep_grid_and_regrid(grid_of):
    grid_of(1)
    fast = MACHINES["free_comm"]
    pmodel = transform(cnn(), "auto", batch_size=BATCH, fallback="replicate", machine=fast,
                       keep_grid=True)
    assert info_of(pmodel).auto.model_parallel == 1 and tfhybrid.grid().model_size == 1
    assert info_of(pmodel).auto.regridded is None
    pmodel = transform(cnn(), "auto", batch_size=BATCH, fallback="replicate", machine=fast)
    assert info_of(pmodel).auto.regridded == (1, N)
    assert tfhybrid.grid().model_size == N


@pytest.mark.parametrize("mp", sorted({N, 2}), ids=lambda m: f"mp{m}")
def test_per_layer_plan_is_recorded_with_alternatives(grid_of, mp):
    """On a grid with model groups (at -np 4 also 2 x 2: ds/df), the integrated plan
    shows each layer's costs and trains exactly."""
    grid_of(mp)
    pmodel = transform(big_head(), "auto", batch_size=BATCH, keep_grid=True,
                       machine=MACHINES["free_comm"])
    choice = info_of(pmodel).auto
    ranking = [label for label, _, _ in choice.ranking]
    assert ranking, "auto tried no candidate"
    if choice.plan is not None:
        names = [c.name for c in choice.plan.layers]
        assert names == ["conv1", "conv2", "fc1", "fc2", "out"]
        assert all(c.choice in c.costs for c in choice.plan.layers)
    x, y = data()
    expected = reference("big_head", x, y)
    train(pmodel, x, y)
    assert_weights_close(gather(pmodel).get_weights(), expected, big_head().get_weights())
    assert np.isfinite(choice.predicted_s)
