"""DistributedOptimizer + model.fit equals single-process training on the global batch.

Run under ``horovodrun -np 2`` and ``-np 4``. Every rank trains the reference
itself: the unmodified model, the plain Keras optimizer, the global batches,
one process. The distributed run feeds ``tfhybrid.data.shard`` of the same
batches. After a few steps every weight must agree (float32: rtol 1e-5,
atol 1e-6; fp16 compression: rtol/atol 2e-3, since float16 keeps about 3
significant digits of each gradient).
"""
import keras
import numpy as np
import pytest
import tensorflow as tf

import tfhybrid

from conftest import randn, reference_once, rng

GLOBAL_BATCH = 8
STEPS = 3
LR = 0.05


def make_model(seed=0):
    """A small CNN: conv -> flatten -> dense -> dense (5 layers with weights)."""
    keras.utils.set_random_seed(seed)
    return keras.Sequential([
        keras.Input((6, 6, 2)),
        keras.layers.Conv2D(4, 3, activation="relu"),
        keras.layers.Flatten(),
        keras.layers.Dense(8, activation="tanh"),
        keras.layers.Dense(6, activation="tanh"),
        keras.layers.Dense(3),
    ])


def make_data(steps=STEPS, batch=GLOBAL_BATCH, key="data"):
    n = steps * batch
    x = randn((n, 6, 6, 2), key, "x")
    y = rng(key, "y").integers(0, 3, size=n).astype(np.int32)
    return x, y


def make_optimizer(kind):
    return {"sgd": lambda: keras.optimizers.SGD(LR, momentum=0.5),
            "adam": lambda: keras.optimizers.Adam(LR / 5)}[kind]()


LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


_REFERENCES = {}


def reference_weights(kind, x, y, batch=GLOBAL_BATCH, seed=0):
    """Single-process training of the unmodified model on the global batches
    (memoised per configuration: several tests share a reference)."""
    key = (kind, x.tobytes(), y.tobytes(), batch, seed)
    if key not in _REFERENCES:
        def compute():
            model = make_model(seed)
            model.compile(optimizer=make_optimizer(kind), loss=LOSS, jit_compile=False)
            model.fit(x, y, batch_size=batch, shuffle=False, epochs=1, verbose=0)
            return model.get_weights()
        _REFERENCES[key] = reference_once(compute, kind, x, y, batch, seed)   # by rank 0
    return _REFERENCES[key]


def distributed_model(kind, seed=0, compile_kwargs=None, **options):
    model = make_model(seed)
    opt = tfhybrid.DistributedOptimizer(make_optimizer(kind), **options)
    model.compile(optimizer=opt, loss=LOSS, **(compile_kwargs or {"jit_compile": False}))
    return model


def global_dataset(x, y, batch=GLOBAL_BATCH):
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(batch, drop_remainder=True)


def assert_weights_close(actual, expected, rtol=1e-5, atol=1e-6):
    assert len(actual) == len(expected)
    for i, (a, e) in enumerate(zip(actual, expected)):
        np.testing.assert_allclose(a, e, rtol=rtol, atol=atol, err_msg=f"weight {i}")


def run_fit(kind, x, y, batch=GLOBAL_BATCH, callbacks=None, **options):
    model = distributed_model(kind, **options)
    model.fit(tfhybrid.data.shard(global_dataset(x, y, batch), model), epochs=1, verbose=0,
              shuffle=False,
              callbacks=callbacks)
    return model


@pytest.fixture
def dp(grid_of):
    return grid_of(1)


@pytest.mark.parametrize("kind", ["sgd", "adam"])
@pytest.mark.parametrize("bucket_bytes", [2**20, 64], ids=["one_bucket", "many_buckets"])
def test_fit_matches_single_process(dp, kind, bucket_bytes):
    x, y = make_data()
    model = run_fit(kind, x, y, bucket_bytes=bucket_bytes)
    plan = model.optimizer.communication_plan()
    n_buckets = len(plan["buckets"])
    assert (n_buckets == 1) if bucket_bytes == 2**20 else (n_buckets == 8)
    assert model.optimizer.iterations.numpy() == STEPS
    assert_weights_close(model.get_weights(), reference_weights(kind, x, y))


@pytest.mark.parametrize("kind", ["adam"])   # Adam: its bias correction counts real steps
def test_backward_passes_per_step(dp, kind):
    """Two micro-batches per step equal one step on their union."""
    x, y = make_data(steps=2 * STEPS)
    model = run_fit(kind, x, y, backward_passes_per_step=2, bucket_bytes=200)
    assert model.optimizer.iterations.numpy() == STEPS
    assert_weights_close(model.get_weights(), reference_weights(kind, x, y, 2 * GLOBAL_BATCH))


def test_horovod_style_script_without_broadcast_trains_rank_0s_replica(grid_of):
    """A script written for Horovod without its broadcast callback: no transform,
    an unseeded model (each rank draws its own weights), DistributedOptimizer,
    fit with no callbacks. The optimizer's build takes rank 0's weights (with a
    warning on rank 0), so every rank trains rank 0's model on the global
    batches, as one process would (before: replicas 0.9 apart after 2 epochs)."""
    from tfhybrid.comm import backend

    grid = grid_of(1)
    keras.utils.set_random_seed(1000 + grid.rank)     # as unseeded: each rank its own draw
    model = keras.Sequential([keras.Input((6, 6, 2)), keras.layers.Conv2D(4, 3),
                              keras.layers.Flatten(), keras.layers.Dense(3)])
    world = tuple(range(grid.size))
    initial = [backend.broadcast(tf.constant(w), 0, world, f"test.initial.{i}").numpy()
               for i, w in enumerate(model.get_weights())]
    x, y = make_data()
    model.compile(optimizer=tfhybrid.DistributedOptimizer(make_optimizer("sgd")), loss=LOSS,
                  jit_compile=False)
    if grid.size > 1 and grid.rank == 0:
        with pytest.warns(UserWarning, match="weights differed between ranks"):
            model.fit(tfhybrid.data.shard(global_dataset(x, y)), epochs=1, verbose=0)
    else:
        model.fit(tfhybrid.data.shard(global_dataset(x, y)), epochs=1, verbose=0)
    reference = keras.Sequential([keras.Input((6, 6, 2)), keras.layers.Conv2D(4, 3),
                                  keras.layers.Flatten(), keras.layers.Dense(3)])
    reference.set_weights(initial)
    reference.compile(optimizer=make_optimizer("sgd"), loss=LOSS, jit_compile=False)
    reference.fit(x, y, batch_size=GLOBAL_BATCH, shuffle=False, epochs=1, verbose=0)
    assert_weights_close(model.get_weights(), reference.get_weights())
