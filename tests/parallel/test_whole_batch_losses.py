"""Losses that reduce over the batch or the volume themselves (Dice, Tversky).

Run under ``horovodrun -np 2`` and ``-np 4``.

``keras.losses.Dice()`` (``axis=None``: one ratio for the whole batch) and a
per-sample Dice (``axis=(1, 2, 3)``) are not means of per-row or per-voxel
values: averaged over row blocks (``d``, ``df``, ``p``, ``gmp``) or spatial
blocks (``s``, ``ds``) they would train other weights than one process,
silently. tfhybrid computes such a loss on the gathered batch / volume (tfhybrid.batch_losses,
tfhybrid.layers.spatial.output). Each case: fit History, ``evaluate`` and the
gathered weights against one process on the whole batches. The labels are
skewed per row and per half-volume so that a block average is far from the
whole batch's value (checked by ``test_the_data_tells_blocks_from_the_whole``).
"""
import keras
import numpy as np
import pytest
import tensorflow as tf

import tfhybrid
from tfhybrid.transformer import gather

from conftest import reference_once, world_size

N = world_size()
L = keras.layers
BATCH, ROWS, EPOCHS = 8, 16, 2


def _volumes():
    r = np.random.default_rng(0)
    x = r.standard_normal((ROWS, 16, 16, 1)).astype(np.float32)
    # rows 0-3 of each batch mostly ones, rows 4-7 mostly zeros; the lower half sparser
    p = np.tile(np.array([0.1] * 4 + [0.95] * 4), ROWS // 8).reshape(ROWS, 1, 1, 1)
    y = (r.random((ROWS, 16, 16, 1)) > p).astype(np.float32)
    y[:, 8:] *= r.random((ROWS, 8, 16, 1)) > 0.8
    w = (0.5 + r.random(ROWS)).astype(np.float32)
    return x, y, w


def _unet():
    keras.utils.set_random_seed(1)
    i = keras.Input((16, 16, 1))
    e0 = L.Conv2D(4, 3, padding="same", activation="relu")(i)
    x = L.Conv2D(8, 3, padding="same", activation="relu")(L.MaxPooling2D(2)(e0))
    x = L.Concatenate()([e0, L.UpSampling2D(2)(x)])
    return keras.Model(i, L.Conv2D(1, 1, activation="sigmoid")(x))


def _classifier():
    keras.utils.set_random_seed(1)
    return keras.Sequential([keras.Input((16, 16, 1)), L.Conv2D(4, 3, activation="relu"),
                             L.Flatten(), L.Dense(8, activation="relu"),
                             L.Dense(3, activation="sigmoid")])


LOSSES = {
    "dice": lambda: keras.losses.Dice(),
    "dice_per_sample": lambda: keras.losses.Dice(axis=(1, 2, 3)),
    "tversky": lambda: keras.losses.Tversky(alpha=0.7, beta=0.3),
    "sample_mean": lambda: (lambda t, p: tf.reduce_mean(tf.abs(t - p), axis=[1, 2, 3])),
}


def dice_coef(y_true, y_pred):
    """A user's metric: one Dice coefficient for the whole batch."""
    y_true = tf.cast(y_true, y_pred.dtype)
    return 2 * tf.reduce_sum(y_true * y_pred) / (tf.reduce_sum(y_true) + tf.reduce_sum(y_pred))


def sample_dice(y_true, y_pred):
    """Per sample, over its voxels (on a split output: the whole volume's)."""
    y_true = tf.cast(y_true, y_pred.dtype)
    axes = list(range(1, y_pred.shape.rank))
    return 2 * tf.reduce_sum(y_true * y_pred, axes) / (
        tf.reduce_sum(y_true, axes) + tf.reduce_sum(y_pred, axes))


METRICS = [dice_coef, sample_dice, "binary_accuracy"]


def _run(strategy, loss, mp, per_voxel=True, weighted=False, **options):
    tfhybrid.shutdown()
    tfhybrid.init(model_parallel=mp)
    x, y, w = _volumes()
    if not per_voxel:
        y = y.reshape(ROWS, -1)[:, :3]
    make = _unet if per_voxel else _classifier
    want, want_eval, want_weights, paths = _reference(loss, per_voxel, weighted)
    model = tfhybrid.transform(make(), strategy, **options)
    if strategy in ("s", "ds"):       # the loss sees blocks (else nothing to test here)
        assert model._tfhybrid_split_outputs == (True,)
    model.compile(optimizer=tfhybrid.DistributedOptimizer(keras.optimizers.SGD(0.5)),
                  loss=LOSSES[loss](), metrics=METRICS)
    rows = (x, y, w) if weighted else (x, y)
    data = tfhybrid.data.shard(tf.data.Dataset.from_tensor_slices(rows), model=model,
                               batch_size=BATCH)
    got = model.fit(data, epochs=EPOCHS, verbose=0,
                    callbacks=tfhybrid.callbacks.standard()).history
    got_eval = model.evaluate(data, verbose=0)
    assert set(got) == set(want)
    for key in want:                # the loss and every metric (dice_coef: batch-level)
        np.testing.assert_allclose(got[key], want[key], rtol=2e-5, err_msg=key)
    np.testing.assert_allclose(got_eval, want_eval, rtol=2e-5)
    whole = gather(model)
    for a, b, path in zip(whole.get_weights(), want_weights, paths):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6, err_msg=path)
    tfhybrid.shutdown()


def _reference(loss, per_voxel, weighted):
    """(History, evaluate results, weights, weight paths) of the unmodified model
    trained in one process (by rank 0, once per run: conftest.reference_once)."""
    def compute():
        x, y, w = _volumes()
        if not per_voxel:
            y = y.reshape(ROWS, -1)[:, :3]
        reference = (_unet if per_voxel else _classifier)()
        reference.compile(optimizer=keras.optimizers.SGD(0.5), loss=LOSSES[loss](),
                          metrics=METRICS)
        kw = {"sample_weight": w} if weighted else {}
        want = reference.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0,
                             **kw).history
        want_eval = reference.evaluate(x, y, batch_size=BATCH, verbose=0, **kw)
        return want, want_eval, reference.get_weights(), [v.path for v in reference.weights]
    return reference_once(compute, loss, per_voxel, weighted, BATCH, ROWS, EPOCHS)


def test_the_data_tells_blocks_from_the_whole():
    """The block means of each loss differ from its whole-batch value by far more
    than the tolerance: a test that averaged blocks would fail."""
    x, y, _ = _volumes()
    p = tf.sigmoid(tf.constant(x[:BATCH]))
    t = tf.constant(y[:BATCH])
    for name in ("dice", "dice_per_sample", "tversky"):
        loss = LOSSES[name]()
        whole = float(loss(t, p))
        rows = np.mean([float(loss(t[i:i + BATCH // 2], p[i:i + BATCH // 2]))
                        for i in (0, BATCH // 2)])
        halves = np.mean([float(loss(t[:, i:i + 8], p[:, i:i + 8])) for i in (0, 8)])
        assert abs(rows - whole) > 1e-3 or name == "dice_per_sample", (name, rows, whole)
        assert abs(halves - whole) > 1e-3, (name, halves, whole)


@pytest.mark.parametrize("loss", ["dice", "tversky"])
def test_data_parallel_batch_level_loss(loss):
    _run("d", loss, 1, per_voxel=False)


def test_data_parallel_dice_with_sample_weights():
    _run("d", "dice", 1, per_voxel=False, weighted=True)


def test_data_parallel_dice_on_volumes():
    _run("d", "dice", 1)


@pytest.mark.parametrize("loss", ["dice", "dice_per_sample", "tversky", "sample_mean"])
def test_spatial_whole_volume_loss(loss):
    _run("s", loss, N)


def test_spatial_per_sample_dice_with_sample_weights():
    _run("s", "dice_per_sample", N, weighted=True)


@pytest.mark.skipif(N < 4, reason="data and spatial groups both > 1 need 4 ranks")
@pytest.mark.parametrize("loss", ["dice", "dice_per_sample"])
def test_ds_whole_batch_and_volume(loss):
    _run("ds", loss, 2)


@pytest.mark.skipif(N < 4, reason="two row blocks of a model group need 4 ranks")
@pytest.mark.parametrize("strategy", ["df", "gmp", "ls"])
def test_model_parallel_row_blocks(strategy):
    _run(strategy, "dice", 2, per_voxel=False, fallback="replicate")


@pytest.mark.skipif(N < 4, reason="two pipelines need 4 ranks")
def test_pipelines():
    _run("p", "dice", 2, per_voxel=False, fallback="replicate")


def test_uneven_row_blocks():
    """Per-rank slices of unequal length (the last batch 3 rows on rank 0, 2 on
    rank 1 at 2 ranks): the gathered batch is still the single-process batch."""
    tfhybrid.shutdown()
    grid = tfhybrid.init(model_parallel=1)
    x, y, _ = _volumes()
    x, y = x[:13], y.reshape(ROWS, -1)[:13, :3]

    def compute():
        reference = _classifier()
        reference.compile(optimizer=keras.optimizers.SGD(0.5), loss=keras.losses.Dice())
        want = reference.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False,
                             verbose=0).history["loss"]
        return want, reference.get_weights()
    want, want_weights = reference_once(compute, x, y, BATCH, EPOCHS)
    model = tfhybrid.transform(_classifier(), "d")
    model.compile(optimizer=tfhybrid.DistributedOptimizer(keras.optimizers.SGD(0.5)),
                  loss=keras.losses.Dice())
    local = BATCH // grid.size
    idx = np.concatenate([np.arange(b, min(b + BATCH, len(x)))[grid.rank::grid.size]
                          for b in range(0, len(x), BATCH)])
    got = model.fit(x[idx], y[idx], batch_size=local, epochs=EPOCHS, shuffle=False, verbose=0,
                    callbacks=tfhybrid.callbacks.standard()).history["loss"]
    np.testing.assert_allclose(got, want, rtol=2e-5)
    for a, b in zip(gather(model).get_weights(), want_weights):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
    tfhybrid.shutdown()
