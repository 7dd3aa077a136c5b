"""Collectives of dtypes Horovod 0.28.1 does not take together or at all.

* ``mixed_bfloat16``: the activations f/c layers exchange are bfloat16, which
  Horovod's TensorFlow ops refuse ("DataType bfloat16 not in list of allowed
  values"), so they travel as float32.
* A model of float64 and float32 layers: a grouped allreduce refuses mixed
  dtypes ("types [float32, ..., float64] that don't all match"), so the
  gradient buckets issue one grouped allreduce per dtype.
"""
import keras
import numpy as np
import pytest

import tfhybrid
from tfhybrid.comm import backend

from conftest import world_size


def _data():
    rng = np.random.RandomState(0)
    return rng.randn(64, 8).astype(np.float32), rng.randint(0, 4, 64)


def _model(output_dtype=None):
    keras.utils.set_random_seed(1)
    inp = keras.Input((8,))
    h = keras.layers.Dense(16, activation="relu", name="fc0")(inp)
    h = keras.layers.Dense(12, activation="relu", name="fc1")(h)
    out = keras.layers.Dense(4, activation="softmax", name="out", dtype=output_dtype)(h)
    return keras.Model(inp, out)


def _train(model, distributed, x, y, blocks=1, index=0):
    opt = keras.optimizers.SGD(0.1)
    model.compile(optimizer=tfhybrid.DistributedOptimizer(opt) if distributed else opt,
                  loss="sparse_categorical_crossentropy")
    return model.fit(x[index::blocks], y[index::blocks], batch_size=16 // blocks, epochs=2,
                     shuffle=False, verbose=0).history["loss"]


@pytest.fixture
def policy():
    yield keras.mixed_precision.set_global_policy
    keras.mixed_precision.set_global_policy("float32")


@pytest.mark.parametrize("strategy", ["f", "c"])
def test_mixed_bfloat16_split_layers_train_like_one_process(grid_of, policy, strategy):
    grid_of(world_size())
    policy("mixed_bfloat16")
    x, y = _data()
    ref = _model("float32")
    want = _train(ref, False, x, y)
    ref_weights = ref.get_weights()
    pmodel = tfhybrid.transform(_model("float32"), strategy=strategy)
    got = _train(pmodel, True, x, y)
    # bfloat16 keeps ~3 significant digits: the partial sums add in another order
    np.testing.assert_allclose(got, want, rtol=2e-3)
    scale = max(float(np.max(np.abs(w))) for w in ref_weights)
    for a, b in zip(tfhybrid.gather(pmodel).get_weights(), ref_weights):
        assert float(np.max(np.abs(a - b))) < 1e-2 * scale
    backend.barrier()


def test_float64_and_float32_layers_reduce_in_one_bucket_each(grid_of, policy):
    grid = grid_of(1)
    policy("float64")
    x, y = _data()
    ref = _model("float32")
    want = _train(ref, False, x, y)
    pmodel = tfhybrid.transform(_model("float32"), strategy="d")
    got = _train(pmodel, True, x, y, grid.size, grid.rank)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    for a, b in zip(tfhybrid.gather(pmodel).get_weights(), ref.get_weights()):
        assert a.dtype == b.dtype
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-9)
    backend.barrier()


def _embedding_model():
    keras.utils.set_random_seed(1)
    inp = keras.Input((10,), dtype="int32")
    h = keras.layers.Embedding(50, 8, name="emb")(inp)
    h = keras.layers.Conv1D(8, 3, padding="same", activation="relu", name="conv")(h)
    h = keras.layers.GlobalAveragePooling1D(name="gap")(h)
    h = keras.layers.Dense(16, activation="relu", name="fc0")(h)
    return keras.Model(inp, keras.layers.Dense(4, activation="softmax", name="out")(h))


@pytest.mark.parametrize("strategy,mp", [("d", 1), ("gmp", 2)] + (
    [("df", 2)] if world_size() > 2 else []))
@pytest.mark.parametrize("optimizer", ["adam", "rmsprop"])
def test_embedding_sparse_gradients_train_like_one_process(grid_of, strategy, mp, optimizer):
    """An Embedding's gradient is IndexedSlices; Keras' Adam/RMSprop update the
    rows of a sparse gradient their own way, so densifying it before the inner
    optimizer would train another model. Its rows are gathered from every
    rank, as Horovod does."""
    grid = grid_of(mp)
    rng = np.random.RandomState(0)
    x = rng.randint(0, 50, size=(64, 10)).astype(np.int32)
    y = rng.randint(0, 4, 64)

    def train(model, distributed, blocks=1, index=0):
        opt = keras.optimizers.get({"class_name": optimizer,
                                    "config": {"learning_rate": 0.01}})
        model.compile(optimizer=tfhybrid.DistributedOptimizer(opt) if distributed else opt,
                      loss="sparse_categorical_crossentropy")
        return model.fit(x[index::blocks], y[index::blocks], batch_size=16 // blocks,
                         epochs=2, shuffle=False, verbose=0).history["loss"]

    ref = _embedding_model()
    want = train(ref, False)
    blocks, index = ((grid.size, grid.rank) if strategy in ("d", "gmp")
                     else (grid.data_size, grid.data_rank))
    kwargs = {"fallback": "replicate"} if strategy == "df" else {}
    pmodel = tfhybrid.transform(_embedding_model(), strategy=strategy, **kwargs)
    got = train(pmodel, True, blocks, index)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    for a, b in zip(tfhybrid.gather(pmodel).get_weights(), ref.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
    backend.barrier()
