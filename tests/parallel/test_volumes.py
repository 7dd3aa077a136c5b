"""tfhybrid.data.volumes feeding transformed volume models under horovodrun.

Every rank writes the same synthetic volumes to ``.npy`` files (one file of
all samples, and a directory of per-sample files) and trains the transformed
model on ``volumes(...)`` of them: each rank reads its rows and, under
``s``/``ds``, only its spatial block, which the model's input scatter then
passes through. The reference is ``fit`` of the unmodified model in one
process on the whole arrays in the same shuffled order (one seed); the
gathered weights after two epochs must equal it (1e-4): a CosmoFlow-like
regression (per-sample targets; its output is gathered) and a 3-D U-Net
(per-voxel labels read as blocks: its output stays split).

Run under ``horovodrun -np 2`` and ``-np 4``.
"""
import keras
import numpy as np
import pytest
import tensorflow as tf

import tfhybrid
from tfhybrid.compose import transform
from tfhybrid.transformer import gather

from conftest import randn, reference_once, rng, world_size
from unet_models import unet3d

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


def reference(build, x, y, loss="mse", eager=False):
    """Weights after 2 epochs in one process (rank 0, once per run: conftest.reference_once)."""
    def compute():
        model = build()
        model.compile(optimizer=keras.optimizers.SGD(LR), loss=loss, jit_compile=False,
                      run_eagerly=eager)
        order = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(
            SAMPLES, seed=SEED, reshuffle_each_iteration=True).batch(BATCH, drop_remainder=True)
        model.fit(order, epochs=2, verbose=0, shuffle=False)
        return model.get_weights()
    return reference_once(compute, build, x, y, loss, eager, LR, SAMPLES, SEED, BATCH)


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


def unet_volume():
    return unet3d((16, 8, 8, 1), classes=3, filters=2, depth=2, seed=1)


def test_unet_per_voxel_labels_in_blocks(grid_of, tmp_path):
    """A 3-D U-Net under s (depth): its output stays in blocks, so volumes
    reads both the inputs and the per-voxel labels as this rank's blocks
    (from per-sample files); two epochs equal single-process training."""
    grid = grid_of(N)
    x = randn((SAMPLES, 16, 8, 8, 1), "volumes", "ux")
    y = rng("volumes", "uy").integers(0, 3, (SAMPLES, 16, 8, 8)).astype(np.int32)
    loss = "sparse_categorical_crossentropy"
    expected = reference(unet_volume, x, y, loss, eager=True)
    model = transform(unet_volume(), "s")
    model.compile(optimizer=tfhybrid.DistributedOptimizer(keras.optimizers.SGD(LR)), loss=loss,
                  jit_compile=False, run_eagerly=True)     # 2 steps: cheaper than tracing
    xs, _ = write(tmp_path, x, np.zeros(1), per_sample=True)
    (tmp_path / "y").mkdir()
    for i, sample in enumerate(y):
        np.save(tmp_path / "y" / f"{i:04d}.npy", sample)
    ds = tfhybrid.data.volumes(xs, str(tmp_path / "y"), batch_size=BATCH, model=model,
                               shuffle=True, seed=SEED)
    block = (BATCH // grid.data_size, 16 // grid.size, 8, 8)
    assert tuple(ds.element_spec[0].shape) == block + (1,)
    assert tuple(ds.element_spec[1].shape) == block           # labels: the output's block
    model.fit(ds, epochs=2, verbose=0, shuffle=False)
    initial = unet_volume().get_weights()
    moved = max(float(np.max(np.abs(e - i))) for e, i in zip(expected, initial))
    assert moved > 1e-3, "the reference did not train: the comparison would be vacuous"
    for i, (a, e) in enumerate(zip(gather(model).get_weights(), expected)):
        np.testing.assert_allclose(a, e, rtol=1e-4, atol=1e-6, err_msg=f"weight {i}")


def test_unseeded_shuffle_agrees_within_model_groups(grid_of):
    """shuffle=True without a seed: one seed drawn on rank 0 and broadcast, so the
    ranks of a model group read the same rows and the data groups' rows partition
    every global batch, epoch after epoch."""
    from tfhybrid.comm import backend

    grid = grid_of(2)
    ids = np.broadcast_to(np.arange(SAMPLES, dtype=np.float32)[:, None, None, None, None],
                          (SAMPLES, D, H, W, C))
    ds = tfhybrid.data.volumes(ids, batch_size=BATCH, spatial="depth", shuffle=True)
    epochs = [[int(v) for b in ds for v in b[:, 0, 0, 0, 0].numpy()] for _ in range(2)]
    rows = np.asarray(epochs, np.int32).reshape(1, -1)
    every = backend.allgather(tf.constant(rows), tuple(range(N)), "test.volumes.order").numpy()
    for group in range(grid.data_size):
        members = grid.model_group_ranks(group)
        assert all((every[r] == every[members[0]]).all() for r in members)
    firsts = every[[grid.model_group_ranks(g)[0] for g in range(grid.data_size)]]
    firsts = firsts.reshape(grid.data_size, 2, SAMPLES // BATCH, BATCH // grid.data_size)
    for epoch in range(2):
        batches_ = np.concatenate(list(firsts[:, epoch]), axis=-1)     # global batches
        assert sorted(batches_.ravel().tolist()) == list(range(SAMPLES))
    assert (firsts[:, 0] != firsts[:, 1]).any()          # a new order each epoch
