"""tfhybrid.callbacks.Profile under horovodrun: it measures every phase on every
rank, prints the table on rank 0, and leaves training exactly as without it."""
import keras
import numpy as np
import pytest
import tensorflow as tf

import tfhybrid
from tfhybrid.profiling import PHASES

from conftest import world_size


def _model():
    keras.utils.set_random_seed(0)
    return keras.Sequential([
        keras.Input((8, 8, 2)),
        keras.layers.Conv2D(4, 3, padding="same", activation="relu", name="conv"),
        keras.layers.BatchNormalization(name="bn"),
        keras.layers.Flatten(name="flat"),
        keras.layers.Dense(4, name="fc")], name="profiled")


def _fit(strategy, callbacks):
    pm = tfhybrid.transform(_model(), strategy)
    pm.compile(optimizer=tfhybrid.DistributedOptimizer(keras.optimizers.SGD(0.05)),
               loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
               jit_compile=False)
    rng = np.random.default_rng(3)
    x = rng.standard_normal((8 * 6, 8, 8, 2)).astype("float32")
    y = rng.integers(0, 4, len(x))
    rows = tf.data.Dataset.from_tensor_slices((x, y))
    pm.fit(tfhybrid.data.shard(rows, model=pm, batch_size=8), epochs=1, verbose=0,
           shuffle=False, callbacks=tfhybrid.callbacks.standard() + callbacks)
    return tfhybrid.gather(pm)


@pytest.mark.parametrize("strategy, mp", [("d", 1), ("s", None)])
def test_profile_measures_and_does_not_change_training(grid_of, strategy, mp, tmp_path):
    grid_of(mp or world_size())
    lines = []
    profile = tfhybrid.callbacks.Profile(steps=2, start=1, batch_size=8, print_fn=lines.append,
                                         png=str(tmp_path / "profile.png"))
    with_profile = _fit(strategy, [profile])
    without = _fit(strategy, [])
    for a, b in zip(with_profile.get_weights(), without.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)   # BN statistics restored
    r = profile.result
    assert r is not None and r["steps"] == 2 and r["world_size"] == world_size()
    assert set(r["measured"]) == set(PHASES) == set(r["predicted"])
    assert all(v >= 0 for v in r["measured"].values())
    assert all(a is None or 0 <= a <= 1 for a in r["accuracy"].values())
    assert r["measured"]["total"] > 0
    if strategy == "s":     # the spatial conv's halo exchange was found and timed
        assert r["measured"]["halo"] > 0 and r["predicted"]["halo"] > 0
    if tfhybrid.grid().rank == 0:
        assert lines and "predicted" in lines[0] and (tmp_path / "profile.png").exists()
    else:
        assert not lines

