"""tfhybrid.transform of a volume (Conv3D) CNN under ``s`` and ``ds``: depth,
height or a (pd, ph, pw) block grid, with SyncBatchNormalization over the
spatial blocks, a Cropping3D and a MaxPooling3D inside the spatial region,
trained like the single-process original.

Run under ``horovodrun -np 2`` and ``-np 4``. The reference is ``fit`` of the
unmodified model on the global batches in one process (every rank computes
it); the transformed model is fed ``tfhybrid.data.shard`` and compiled with
``tfhybrid.DistributedOptimizer``. Its predictions must match the
original's before training (rtol 1e-5) and, after STEPS steps, its gathered
weights the reference's (rtol 1e-4, atol 1e-6).
"""
import keras
import numpy as np
import pytest
import tensorflow as tf

import tfhybrid
from tfhybrid.layers import SpatialConv3D, SpatialCropping3D, SpatialMaxPooling3D
from tfhybrid.transform import gather, transform

from conftest import randn, rng, world_size

N = world_size()
STEPS, BATCH, LR, DEPTH, SIZE, CLASSES = 2, 8, 0.1, 12, 6, 3
LOSS = "sparse_categorical_crossentropy"


def volume_cnn(seed=0):
    """Conv3D -> BN -> Cropping3D -> Conv3D -> MaxPooling3D -> Dense, on 12x6x6x2 volumes."""
    keras.utils.set_random_seed(seed)
    i = keras.Input((DEPTH, SIZE, SIZE, 2))
    x = keras.layers.Conv3D(4, 3, padding="same", activation="relu", name="conv1")(i)
    x = keras.layers.BatchNormalization(name="bn1")(x)
    x = keras.layers.Cropping3D(((2, 2), (1, 1), (1, 1)), name="crop")(x)
    x = keras.layers.Conv3D(4, 3, padding="same", activation="tanh", name="conv2")(x)
    x = keras.layers.MaxPooling3D(2, name="pool")(x)
    x = keras.layers.Flatten(name="flat")(x)
    return keras.Model(i, keras.layers.Dense(CLASSES, activation="softmax", name="out")(x),
                       name="volume_cnn")


def data():
    x = randn((STEPS * BATCH, DEPTH, SIZE, SIZE, 2), "volume", "x")
    y = rng("volume", "y").integers(0, CLASSES, size=STEPS * BATCH).astype(np.int32)
    return x, y


def dataset(x, y):
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH, drop_remainder=True)


_REFERENCE = {}


def reference(x, y):
    """Single-process fit of the unmodified model (computed once per session)."""
    if not _REFERENCE:
        model = volume_cnn()
        model.compile(optimizer=keras.optimizers.SGD(LR), loss=LOSS, jit_compile=False)
        model.fit(dataset(x, y), epochs=1, shuffle=False, verbose=0)
        _REFERENCE["weights"] = model.get_weights()
    return _REFERENCE["weights"]


# (strategy, model_parallel, options): s over every rank, ds with data groups.
CASES = {2: [("s", 2, {}), ("s", 2, {"spatial": "height"}), ("ds", 1, {})],
         4: [("s", 4, {}), ("s", 4, {"spatial": (2, 2, 1)}), ("ds", 2, {"spatial": "depth"})]
         }.get(N, [])


@pytest.mark.parametrize("strategy,mp,options", CASES,
                         ids=[f"{s}-mp{m}-{o.get('spatial', 'default')}" for s, m, o in CASES])
def test_volume_cnn_fit_equals_single_process(grid_of, strategy, mp, options):
    grid_of(mp)
    x, y = data()
    expected = reference(x, y)
    original = volume_cnn()
    initial = original.get_weights()
    pmodel = transform(original, strategy, **options)
    assert isinstance(pmodel.get_layer("conv1"), SpatialConv3D)
    assert isinstance(pmodel.get_layer("crop"), SpatialCropping3D)
    assert isinstance(pmodel.get_layer("pool"), SpatialMaxPooling3D)
    pmodel.compile(optimizer=tfhybrid.DistributedOptimizer(keras.optimizers.SGD(LR)),
                   loss=LOSS, jit_compile=False)
    blocks, index = tfhybrid.data.batch_split(pmodel)
    rows = slice(index * BATCH // blocks, (index + 1) * BATCH // blocks)
    np.testing.assert_allclose(pmodel.predict(x[rows], batch_size=BATCH, verbose=0),
                               original(x[rows]), rtol=1e-5, atol=1e-6)
    pmodel.fit(tfhybrid.data.shard(dataset(x, y), model=pmodel), epochs=1, shuffle=False,
               verbose=0)
    actual = gather(pmodel).get_weights()
    moved = max(float(np.max(np.abs(e - i))) for e, i in zip(expected, initial))
    assert moved > 1e-3, "the reference did not train: the comparison would be vacuous"
    for i, (a, e) in enumerate(zip(actual, expected)):
        np.testing.assert_allclose(a, e, rtol=1e-4, atol=1e-6, err_msg=f"weight {i}")
    diff = max(float(np.max(np.abs(a - e))) for a, e in zip(actual, expected))
    print(f"\n{strategy} mp{mp} {options}: max |gathered - reference| = {diff:.2e} "
          f"(largest update {moved:.2e})")
