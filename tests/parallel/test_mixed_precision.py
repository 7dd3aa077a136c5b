"""mixed_float16 (the usual GPU recipe) under tfhybrid: Keras' dynamic loss
scaling must see the reduced gradients.

Keras' ``compile`` wraps the optimizer in a ``LossScaleOptimizer`` under the
``mixed_float16`` policy. Around a DistributedOptimizer that scaler would check
each rank's local gradients and skip the step (the gradient allreduce
included) only on the ranks whose gradients overflowed: the others hung in the
allreduce. A transformed model's compile puts the scaler inside the
DistributedOptimizer instead, so every rank skips or applies together, as one
process does on the whole batch. Here the second of three global batches
overflows in rank 0's rows only: single-process training skips that step and
halves the scale; so must every strategy, with the same weights.
"""
import contextlib

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfhybrid

from conftest import randn, world_size

BATCH, STEPS = 8, 3


@contextlib.contextmanager
def mixed_float16():
    before = keras.config.dtype_policy()
    keras.config.set_dtype_policy("mixed_float16")
    try:
        yield
    finally:
        keras.config.set_dtype_policy(before)


def make_model():
    keras.utils.set_random_seed(4)
    i = keras.Input((8,))
    x = keras.layers.Dense(16, activation="relu", name="h")(i)
    return keras.Model(i, keras.layers.Dense(2, name="o", dtype="float32")(x), name="mp")


def data():
    # small values: a rank's mean over its 2 rows (np4) has 4x the per-row weight of the
    # 8-row mean, which must not overflow at the initial scale 2^15 on its own
    x, y = 0.1 * randn((BATCH * STEPS, 8), "mp16", "x"), 0.1 * randn((BATCH * STEPS, 2), "mp16", "y")
    x[BATCH:BATCH + 2] *= 3e5          # batch 2, rows 0-1 (rank 0's): float16 overflow
    return x, y


def batches(x, y):
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH)


@pytest.mark.parametrize("strategy", ["d", "f"])
def test_overflow_on_one_rank_skips_the_step_everywhere(grid_of, strategy):
    grid_of(1 if strategy == "d" else world_size())
    x, y = data()
    with mixed_float16():
        reference = make_model()
        reference.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
        reference.fit(batches(x, y), epochs=1, verbose=0)
        model = tfhybrid.transform(make_model(), strategy, fallback="replicate")
        model.compile(optimizer=tfhybrid.DistributedOptimizer(keras.optimizers.SGD(0.1)),
                      loss="mse")
        model.fit(tfhybrid.data.shard(batches(x, y), model=model), epochs=1, verbose=0)
        full = tfhybrid.gather(model)
    scaler = model.optimizer.inner_optimizer
    assert isinstance(scaler, keras.optimizers.LossScaleOptimizer)
    # one step skipped: the scale halved once, two steps applied
    assert float(scaler.dynamic_scale.numpy()) == float(reference.optimizer.dynamic_scale.numpy())
    assert int(model.optimizer.iterations.numpy()) == int(reference.optimizer.iterations.numpy())
    for a, e in zip(full.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(a, e, rtol=2e-3, atol=2e-4)


@pytest.mark.parametrize("strategy,sharded", [("d", False), ("f", True)])
def test_checkpoint_keeps_the_loss_scale_and_the_step_count(grid_of, strategy, sharded):
    """tfhybrid.load restores the loss scaler's scale and growth counter (its
    scalars are no slots, so a restore of slots alone would start it again at
    2^15 with the counter at 0) and the optimizer's step count, not the
    scaler's own unused one (the resumed iterations would read 4 for 8)."""
    import os

    from conftest import job_dir

    grid_of(1 if strategy == "d" else world_size())
    x, y = data()
    path = os.path.join(job_dir(), f"mp16_{strategy}" + ("" if sharded else ".keras"))
    with mixed_float16():
        reference = make_model()
        reference.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
        reference.fit(batches(x, y), epochs=1, verbose=0)
        reference.fit(batches(x, y), epochs=2, initial_epoch=1, verbose=0)
        model = tfhybrid.transform(make_model(), strategy, fallback="replicate")
        model.compile(optimizer=tfhybrid.DistributedOptimizer(keras.optimizers.SGD(0.1)),
                      loss="mse")
        model.fit(tfhybrid.data.shard(batches(x, y), model=model), epochs=1, verbose=0)
        tfhybrid.save(model, path, epoch=1, sharded=sharded)
        resumed = tfhybrid.load(path, fallback="replicate")
        resumed.fit(tfhybrid.data.shard(batches(x, y), model=resumed), epochs=2, verbose=0)
        full = tfhybrid.gather(resumed)
    scaler = resumed.optimizer.inner_optimizer
    assert isinstance(scaler, keras.optimizers.LossScaleOptimizer)
    assert float(scaler.dynamic_scale.numpy()) == float(reference.optimizer.dynamic_scale.numpy())
    assert int(scaler.step_counter.numpy()) == int(reference.optimizer.step_counter.numpy())
    assert int(resumed.optimizer.iterations.numpy()) == int(reference.optimizer.iterations.numpy())
    for a, e in zip(full.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(a, e, rtol=2e-3, atol=2e-4)
