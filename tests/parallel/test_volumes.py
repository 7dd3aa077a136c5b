"""tfhybrid.data.volumes feeding transformed volume models under horovodrun.

Every rank writes the same synthetic volumes to ``.npy`` files (one file of
all samples, and a directory of per-sample files) and trains the transformed
model on ``volumes(...)`` of them: each rank reads its rows and, under
``s``/``ds``, only its spatial block, which the model's input scatter then
passes through. The reference is ``fit`` of the unmodified model in one
process on the whole arrays in the same shuffled order (one seed); the
gathered weights after two epochs must equal it (1e-4).

Run under ``horovodrun -np 2`` and ``-np 4``.
"""
import keras
import numpy as np
import pytest
import tensorflow as tf

import tfhybrid
from tfhybrid.transformer import gather, transform

from conftest import randn, world_size

N = world_size()
SAMPLES, BATCH, D, H, W, C, SEED, LR = 8, 4, 8, 4, 4, 2, 5, 0.05


def cosmoflow_like(seed=0):
    """Conv3D -> MaxPooling3D -> Conv3D -> MaxPooling3D -> Dense(4): per-sample regression."""
    keras.utils.set_random_seed(seed)
    i = keras.Input((D, H, W, C))
    x = keras.layers.Conv3D(4, 3, padding="same", activation="relu", name="conv1")(i)
    x = keras.layers.MaxPooling3D(2, name="pool1")(x)
    x = keras.layers.Conv3D(4, 3, padding="same", activation="tanh", name="conv2")(x)
    x = keras.layers.Flatten(name="flat")(x)
    return keras.Model(i, keras.layers.Dense(4, name="targets")(x), name="cosmo_like")


def fully_conv(seed=0):
    """Two Conv3D and a per-voxel 1x1x1 head: per-voxel regression."""
    keras.utils.set_random_seed(seed)
    i = keras.Input((D, H, W, C))
    x = keras.layers.Conv3D(4, 3, padding="same", activation="relu", name="conv1")(i)
    x = keras.layers.Conv3D(1, 1, name="head")(x)
    return keras.Model(i, x, name="voxel_head")


def reference(build, x, y):
    model = build()
    model.compile(optimizer=keras.optimizers.SGD(LR), loss="mse", jit_compile=False)
    order = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(
        SAMPLES, seed=SEED, reshuffle_each_iteration=True).batch(BATCH, drop_remainder=True)
    model.fit(order, epochs=2, verbose=0, shuffle=False)
    return model.get_weights()


def write(tmp_path, x, y, per_sample):
    np.save(tmp_path / "y.npy", y)
    if not per_sample:
        np.save(tmp_path / "x.npy", x)
        return str(tmp_path / "x.npy"), str(tmp_path / "y.npy")
    (tmp_path / "x").mkdir()
    for i, sample in enumerate(x):
        np.save(tmp_path / "x" / f"{i:04d}.npy", sample)
    return str(tmp_path / "x"), str(tmp_path / "y.npy")


CASES = {2: [("s", 2, {}, False), ("ds", 1, {}, True), ("s", 2, {"spatial": "height"}, True)],
         4: [("s", 4, {}, True), ("s", 4, {"spatial": (2, 2, 1)}, False),
             ("ds", 2, {}, False)]}.get(N, [])


@pytest.mark.parametrize("strategy,mp,options,per_sample", CASES,
                         ids=[f"{c[0]}-mp{c[1]}-{c[2].get('spatial', 'depth')}-"
                              f"{'files' if c[3] else 'npy'}" for c in CASES])
def test_fit_on_volumes_equals_single_process(grid_of, tmp_path, strategy, mp, options,
                                              per_sample):
    grid = grid_of(mp)
    x = randn((SAMPLES, D, H, W, C), "volumes", "x")
    y = randn((SAMPLES, 4), "volumes", "y")
    expected = reference(cosmoflow_like, x, y)
    original = cosmoflow_like()
    initial = original.get_weights()
    model = transform(original, strategy, **options)
    model.compile(optimizer=tfhybrid.DistributedOptimizer(keras.optimizers.SGD(LR)), loss="mse",
                  jit_compile=False)
    xs, ys = write(tmp_path, x, y, per_sample)
    ds = tfhybrid.data.volumes(xs, ys, batch_size=BATCH, model=model, shuffle=True, seed=SEED)
    layout = tfhybrid.volumes.plan(model)
    shape = ds.element_spec[0].shape
    assert shape[0] == BATCH // grid.data_size
    assert tuple(shape[1:4]) == tuple(s // k for s, k in zip((D, H, W), layout.parts))
    assert np.prod(layout.parts) == mp                  # blocks, not whole volumes
    model.fit(ds, epochs=2, verbose=0, shuffle=False)
    actual = gather(model).get_weights()
    moved = max(float(np.max(np.abs(e - i))) for e, i in zip(expected, initial))
    assert moved > 1e-3, "the reference did not train: the comparison would be vacuous"
    for i, (a, e) in enumerate(zip(actual, expected)):
        np.testing.assert_allclose(a, e, rtol=1e-4, atol=1e-6, err_msg=f"weight {i}")
    # The model still takes whole volumes too (its scatter splits them).
    np.testing.assert_allclose(model.predict(x[:2], batch_size=2, verbose=0),
                               gather(model)(x[:2]), rtol=1e-4, atol=1e-5)


def test_per_voxel_labels_with_gathered_output(grid_of, tmp_path):
    """A fully convolutional model under s: its output is gathered, so the
    per-voxel labels are read whole while the inputs are read as blocks."""
    grid = grid_of(N)
    x = randn((SAMPLES, D, H, W, C), "volumes", "vx")
    y = randn((SAMPLES, D, H, W, 1), "volumes", "vy")
    expected = reference(fully_conv, x, y)
    model = transform(fully_conv(), "s")
    model.compile(optimizer=tfhybrid.DistributedOptimizer(keras.optimizers.SGD(LR)), loss="mse",
                  jit_compile=False)
    xs, ys = write(tmp_path, x, y, per_sample=False)
    ds = tfhybrid.data.volumes(xs, ys, batch_size=BATCH, model=model, shuffle=True, seed=SEED)
    out_shape = tuple(model.outputs[0].shape[1:4])
    assert ds.element_spec[0].shape[1] == D // grid.size
    assert tuple(ds.element_spec[1].shape[1:4]) == out_shape
    model.fit(ds, epochs=2, verbose=0, shuffle=False)
    for i, (a, e) in enumerate(zip(gather(model).get_weights(), expected)):
        np.testing.assert_allclose(a, e, rtol=1e-4, atol=1e-6, err_msg=f"weight {i}")
