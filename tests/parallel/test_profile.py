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



def _recorded(strategy, loss_out):
    """Names of the collectives one traced forward+backward records, and of
    those ``executed_collectives`` keeps (what TensorFlow runs)."""
    from tfhybrid.comm import backend
    from tfhybrid.profiling import executed_collectives
    keras.utils.set_random_seed(0)
    plain = keras.Sequential([
        keras.Input((8, 8, 2)),
        keras.layers.Conv2D(4, 3, padding="same", name="conv1"),
        keras.layers.Conv2D(4, 3, padding="same", name="conv2"),
        keras.layers.Flatten(name="flat"),
        keras.layers.Dense(4, name="fc")], name="pruned")
    pm = tfhybrid.transform(plain, strategy)
    x = tf.constant(np.random.default_rng(0).standard_normal((4, 8, 8, 2)), tf.float32)

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(pm(x, training=True))
        grads = tape.gradient(loss, pm.trainable_weights)
        return (loss, grads) if loss_out else grads
    with backend.recording_collectives() as calls:
        step()
    kept = executed_collectives(calls, step.get_concrete_function().graph)
    return [c[1] for c in calls], [c[1] for c in kept]


def test_replays_only_the_collectives_the_step_runs(grid_of):
    """The input's halo return of the first spatial convolution is traced but
    pruned (nothing needs the input's gradient, Horovod's ops are not stateful),
    so the profile must not replay it; every other halo exchange stays."""
    grid_of(world_size())
    recorded, kept = _recorded("s", loss_out=True)
    first_back = [n for n in recorded if "conv1.halo" in n and n.endswith(".bwd")]
    assert first_back, recorded          # traced...
    assert not set(first_back) & set(kept), kept     # ... but not run
    assert [n for n in kept if "conv2.halo" in n and n.endswith(".bwd")], kept
    assert [n for n in kept if "conv1.halo" in n and not n.endswith(".bwd")], kept
    assert set(kept) == set(recorded) - set(first_back)


def test_forward_collectives_run_only_when_the_loss_is_returned(grid_of):
    """A forward reduction feeding only a sum is pruned unless the loss is an
    output of the step (as in a train step; measure_phases returns it)."""
    grid_of(world_size())
    recorded, kept = _recorded("f", loss_out=True)
    assert set(kept) == set(recorded), (recorded, kept)
    recorded, kept = _recorded("f", loss_out=False)
    forward = [n for n in recorded if n.startswith("tfh.fc.") and not n.endswith(".bwd")]
    assert forward and not set(forward) & set(kept), (recorded, kept)
