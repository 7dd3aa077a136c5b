"""``compile(steps_per_execution=N)`` on a transformed model, as users write it.

Keras advises ``steps_per_execution`` for small steps (``fit`` then runs N
steps per call of its multi-step function, with the callbacks once per
call). Under tfhybrid the steps inside one call carry the gradient
reductions, the layers' collectives and, on the guards' checked calls, the
in-step gather of the weight checksums. The weights and the epoch logs must
equal one process trained with the same setting on the global batches,
including a last call of fewer than N steps (10 batches, N = 4).

Run under ``horovodrun -np 2`` and ``-np 4``.
"""
import keras
import numpy as np
import pytest
import tensorflow as tf

import tfhybrid

from conftest import assert_weights_like, randn, rng, world_size

GLOBAL_BATCH = 8
BATCHES = 10
N = 4


def make_model():
    keras.utils.set_random_seed(3)
    return keras.Sequential([
        keras.Input((6, 6, 2)),
        keras.layers.Conv2D(4, 3, activation="relu", name="conv"),
        keras.layers.Flatten(name="flat"),
        keras.layers.Dense(8, activation="tanh", name="fc1"),
        keras.layers.Dense(3, name="fc2"),
    ])


def compile_kwargs():
    return dict(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                metrics=["accuracy"], steps_per_execution=N, jit_compile=False)


def data():
    n = BATCHES * GLOBAL_BATCH
    x = randn((n, 6, 6, 2), "spe", "x")
    y = rng("spe", "y").integers(0, 3, size=n).astype(np.int32)
    return x, y


@pytest.mark.parametrize("strategy, mp", [("d", 1), ("df", 2), ("f", "world")])
def test_steps_per_execution_trains_like_one_process(grid_of, strategy, mp):
    grid_of(world_size() if mp == "world" else mp)
    x, y = data()
    reference = make_model()
    reference.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.5), **compile_kwargs())
    want = reference.fit(x, y, batch_size=GLOBAL_BATCH, epochs=2, shuffle=False, verbose=0)

    model = tfhybrid.transform(make_model(), strategy, fallback="replicate")
    model.compile(optimizer=tfhybrid.DistributedOptimizer(
        keras.optimizers.SGD(0.05, momentum=0.5)), **compile_kwargs())
    rows = tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH, drop_remainder=True)
    got = model.fit(tfhybrid.data.shard(rows, model=model), epochs=2, verbose=0,
                    callbacks=tfhybrid.callbacks.standard())

    assert not model.train_function.__qualname__.startswith("lean_train_function")
    assert_weights_like(tfhybrid.gather(model), reference, rtol=1e-5)
    for key in ("loss", "accuracy"):
        np.testing.assert_allclose(got.history[key], want.history[key], rtol=1e-5, err_msg=key)
