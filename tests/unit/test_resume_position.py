"""The first fit after tfhybrid.load continues at the saved data position (one
process): which epochs and how many steps it runs for a checkpoint saved
mid-epoch or at an epoch end, and what it does with data it cannot skip.
Exactness under horovodrun: tests/integration/test_resume_position.py."""
import os
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tfhybrid

BATCH, STEPS = 4, 4


@pytest.fixture(autouse=True)
def world_of_one():
    tfhybrid.init()
    yield
    tfhybrid.shutdown()


def data():
    rng = np.random.default_rng(0)
    return (rng.standard_normal((BATCH * STEPS, 3)).astype("float32"),
            rng.standard_normal((BATCH * STEPS, 1)).astype("float32"))


def batches():
    return tf.data.Dataset.from_tensor_slices(data()).batch(BATCH, drop_remainder=True)


def saved(tmp_path, epoch, step):
    keras.utils.set_random_seed(0)
    i = keras.Input((3,))
    model = tfhybrid.transform(keras.Model(i, keras.layers.Dense(1, name="fc")(i)), "d")
    model.compile(optimizer=tfhybrid.DistributedOptimizer(keras.optimizers.SGD(0.1)), loss="mse")
    path = str(tmp_path / "c.keras")
    tfhybrid.save(model, path, epoch=epoch, step=step)
    return tfhybrid.load(path)


def iterations(model):
    return int(model.optimizer.iterations.numpy())


def test_mid_epoch_checkpoint_skips_the_trained_steps_then_runs_whole_epochs(tmp_path):
    model = saved(tmp_path, epoch=1, step=3)
    history = model.fit(tfhybrid.data.shard(batches(), model=model), epochs=3, verbose=0)
    assert history.epoch == [1, 2] and len(history.history["loss"]) == 2
    assert iterations(model) == (STEPS - 3) + STEPS
    history = model.fit(batches(), epochs=1, verbose=0)        # later fits are plain
    assert history.epoch == [0] and iterations(model) == (STEPS - 3) + 2 * STEPS


def test_steps_per_epoch_counts_the_skipped_steps(tmp_path):
    model = saved(tmp_path, epoch=0, step=1)
    model.fit(batches().repeat(), epochs=1, steps_per_epoch=3, verbose=0)
    assert iterations(model) == 2


def test_epoch_end_checkpoint_starts_at_the_saved_epoch(tmp_path):
    model = saved(tmp_path, epoch=2, step=0)
    assert model.fit(batches(), epochs=3, verbose=0).epoch == [2]
    assert iterations(model) == STEPS


def test_explicit_initial_epoch_elsewhere_trains_whole_epochs(tmp_path):
    model = saved(tmp_path, epoch=1, step=3)
    assert model.fit(batches(), epochs=1, initial_epoch=0, verbose=0).epoch == [0]
    assert iterations(model) == STEPS


def test_arrays_cannot_skip_and_say_so(tmp_path):
    model = saved(tmp_path, epoch=0, step=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.fit(*data(), batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    assert any("saved after 2 batches of epoch 0, but fit received ndarray" in str(w.message)
               for w in caught)
    assert iterations(model) == STEPS
