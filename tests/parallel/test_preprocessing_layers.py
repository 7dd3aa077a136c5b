"""Keras preprocessing layers at the model's input.

* An adapted ``Normalization`` keeps its mean and variance as tensors that
  ``finalize_state`` derives from its weights; ``set_weights`` does not call
  it, so a transformed (or gathered) model must call it, or it would
  normalise with a freshly built layer's statistics, silently.
* ``s``/``ds`` take models starting with preprocessing or augmentation
  layers (``RandomFlip``, ``Resizing``, ``Normalization``...), which cannot
  run on spatial blocks: they run on the whole input before the blocks are cut.
"""
import keras
import numpy as np
import pytest

import tfhybrid
from tfhybrid.comm import backend

from conftest import reference_once, world_size

RNG = np.random.RandomState(0)
X = (3.0 + 2.0 * RNG.randn(32, 16, 16, 4)).astype(np.float32)
Y = RNG.randint(0, 4, 32)


def _model(prefix):
    keras.utils.set_random_seed(1)
    inp = keras.Input((16, 16, 4))
    h = inp
    if prefix == "normalization":
        norm = keras.layers.Normalization(name="norm")
        norm.adapt(X)
        h = norm(h)
    elif prefix == "augment":
        h = keras.layers.RandomFlip("vertical", seed=3, name="flip")(h)
        h = keras.layers.Resizing(16, 16, name="resize")(h)
    h = keras.layers.Conv2D(8, 3, padding="same", activation="relu", name="c0")(h)
    h = keras.layers.MaxPooling2D(2, name="p0")(h)
    h = keras.layers.Conv2D(8, 3, padding="same", activation="relu", name="c1")(h)
    h = keras.layers.Flatten(name="flat")(h)
    h = keras.layers.Dense(16, activation="relu", name="fc0")(h)
    return keras.Model(inp, keras.layers.Dense(4, activation="softmax", name="out")(h))


def _grid(grid_of, strategy):
    mp = {"d": 1, "gmp": 2, "ls": 1, "df": 2, "ds": 2}.get(strategy, world_size())
    return grid_of(mp)


def _rows(grid, strategy):
    if strategy in ("d", "gmp"):
        return grid.size, grid.rank
    if strategy in ("p", "ls"):
        return 1, 0          # fed through data.shard below
    return grid.data_size, grid.data_rank


CASES = ["d", "f", "s", "p", "ls"] + (["df", "ds"] if world_size() > 2 else [])


@pytest.mark.parametrize("strategy", CASES)
def test_adapted_normalization_survives_transform_fit_and_gather(grid_of, strategy):
    grid = _grid(grid_of, strategy)

    def compute():      # predictions of X[:8] before and after one epoch
        ref = _model("normalization")
        want_before = ref.predict(X[:8], verbose=0)
        ref.compile(optimizer=keras.optimizers.SGD(0.05), loss="sparse_categorical_crossentropy")
        ref.fit(X, Y, batch_size=8, epochs=1, shuffle=False, verbose=0)
        return want_before, ref.predict(X[:8], verbose=0)
    want_before, want_after = reference_once(compute, X, Y)
    kwargs = {"fallback": "replicate"} if strategy in ("f", "df") else {}
    pmodel = tfhybrid.transform(_model("normalization"), strategy=strategy, **kwargs)
    pmodel.compile(optimizer=tfhybrid.DistributedOptimizer(keras.optimizers.SGD(0.05)),
                   loss="sparse_categorical_crossentropy")
    if strategy in ("p", "ls"):
        xl, yl = tfhybrid.data.shard((X, Y), model=pmodel, batch_size=8)
        local = tfhybrid.data.local_batch_size(8, pmodel)
    else:
        blocks, index = _rows(grid, strategy)
        xl, yl, local = X[index::blocks], Y[index::blocks], 8 // blocks
    before = pmodel.predict(xl[:local], batch_size=local, verbose=0)
    if strategy not in ("p", "ls"):     # their predict returns this rank's rows' part
        # xl[:local]: rows index, index + blocks, ... of X[:8]
        np.testing.assert_allclose(before, want_before[index::blocks][:local],
                                   rtol=1e-5, atol=1e-6)
    pmodel.fit(xl, yl, batch_size=local, epochs=1, shuffle=False, verbose=0)
    full = tfhybrid.gather(pmodel)
    np.testing.assert_allclose(full.predict(X[:8], verbose=0), want_after,
                               rtol=1e-4, atol=1e-6)
    assert np.max(np.abs(want_before - want_after)) > 1e-6   # it trained
    backend.barrier()


@pytest.mark.parametrize("strategy", ["s"] + (["ds"] if world_size() > 2 else []))
def test_spatial_split_starts_after_augmentation_layers(grid_of, strategy):
    grid = _grid(grid_of, strategy)

    def compute():
        return _model("augment").predict(X[:8], verbose=0)
    want = reference_once(compute, X)
    pmodel = tfhybrid.transform(_model("augment"), strategy=strategy)
    from tfhybrid.transformer.rewrite import find_layer
    assert type(find_layer(pmodel, "c0")).__name__ == "SpatialConv2D"   # split after them
    assert type(find_layer(pmodel, "flip")).__name__ == "RandomFlip"
    np.testing.assert_allclose(pmodel.predict(X[:8], batch_size=8, verbose=0),
                               want, rtol=1e-5, atol=1e-6)
    pmodel.compile(optimizer=tfhybrid.DistributedOptimizer(keras.optimizers.SGD(0.05)),
                   loss="sparse_categorical_crossentropy")
    blocks, index = grid.data_size, grid.data_rank
    h = pmodel.fit(X[index::blocks], Y[index::blocks], batch_size=8 // blocks, epochs=1,
                   shuffle=False, verbose=0)     # the guards check the model group's weights
    assert np.isfinite(h.history["loss"][0])
    backend.barrier()
