"""Keras' own ``save``/``save_weights``/``load_weights`` on transformed models,
as Horovod users call them (``if hvd.rank() == 0: model.save(path)``).

A model whose layers are all plain Keras layers holding full weights (``d``)
saves and loads as usual, on rank 0 alone; a model with split tfhybrid layers
raises a ValueError naming tfhybrid.save / gather / load instead of writing
this rank's shards (before: every rank wrote the same file, whichever came
last won, and the file needed this grid to load).
"""
import os

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfhybrid
from tfhybrid.comm import backend

from conftest import job_dir, randn, world_size


def make_model():
    keras.utils.set_random_seed(3)
    i = keras.Input((6, 6, 2))
    x = keras.layers.Conv2D(4, 3, padding="same", activation="relu", name="conv")(i)
    x = keras.layers.Flatten(name="flat")(x)
    return keras.Model(i, keras.layers.Dense(3, name="fc")(x), name="small")


def fitted(strategy, **options):
    model = tfhybrid.transform(make_model(), strategy, **options)
    model.compile(optimizer=tfhybrid.DistributedOptimizer(keras.optimizers.SGD(0.1)), loss="mse")
    x, y = randn((8, 6, 6, 2), "ks", "x"), randn((8, 3), "ks", "y")
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(8)
    model.fit(tfhybrid.data.shard(data, model=model), epochs=1, verbose=0)
    return model, x


def test_data_parallel_model_saves_on_rank_0_like_horovod(grid_of, tmp_path):
    grid_of(1)
    model, x = fitted("d")
    if backend.rank() == 0:
        path = str(tmp_path / "d.keras")
        model.save(path)                                    # rank 0 only, no collective
        loaded = keras.saving.load_model(path)
        np.testing.assert_allclose(loaded.predict(x, verbose=0), model(x).numpy(),
                                   rtol=1e-6, atol=1e-7)
        weights = str(tmp_path / "d.weights.h5")
        model.save_weights(weights)
        model.load_weights(weights)
    backend.barrier()


@pytest.mark.parametrize("method,arg,phrase", [
    ("save", "never.keras", r"Use tfhybrid.save\(model, path\) on every rank"),
    ("save_weights", "never.weights.h5", r"tfhybrid.gather\(model\) on every rank"),
    ("load_weights", "never.weights.h5", r"into the original model before tfhybrid.transform"),
])
@pytest.mark.parametrize("strategy", ["f", "p", "ls"])
def test_split_model_refuses_keras_save_and_load(grid_of, tmp_path, method, arg, phrase, strategy):
    mp, options = split_case(strategy)
    grid_of(mp)
    model, _ = fitted(strategy, **options)
    with pytest.raises(ValueError, match=phrase):
        getattr(model, method)(str(tmp_path / arg))
    assert not (tmp_path / arg).exists()


def split_case(strategy):
    """(model_parallel, transform options) of a model whose ranks hold parts:
    f's blocks, p's stages (before: Keras' NotImplementedError from
    PipelineModel.get_config, at the end of epoch 1 under ModelCheckpoint),
    ls's CONV/FC workers."""
    return {"f": (world_size(), {"fallback": "replicate"}), "p": (2, {}),
            "ls": (1, {"fc_workers": world_size() // 2})}[strategy]


def compiled_split(grid_of, strategy):
    """(a compiled model of :func:`split_case`, x, y), untrained."""
    mp, options = split_case(strategy)
    grid_of(mp)
    model = tfhybrid.transform(make_model(), strategy, **options)
    model.compile(optimizer=tfhybrid.DistributedOptimizer(keras.optimizers.SGD(0.1)), loss="mse")
    return model, randn((8, 6, 6, 2), "ks", "x"), randn((8, 3), "ks", "y")


class CountingCheckpoint(keras.callbacks.ModelCheckpoint):
    saves = 0

    def _save_model(self, epoch, batch, logs):
        self.saves += 1
        return super()._save_model(epoch, batch, logs)


def shared_dir():
    """A directory every rank of this job names alike (removed after the session)."""
    return job_dir()


def test_keras_model_checkpoint_writes_on_rank_0_only_for_plain_layers(grid_of):
    grid_of(1)
    path = os.path.join(shared_dir(), "d-{epoch}.keras")
    checkpoint = CountingCheckpoint(path)
    model = tfhybrid.transform(make_model(), "d")
    model.compile(optimizer=tfhybrid.DistributedOptimizer(keras.optimizers.SGD(0.1)), loss="mse")
    x, y = randn((8, 6, 6, 2), "ks", "x"), randn((8, 3), "ks", "y")
    model.fit(x, y, batch_size=8 // world_size(), epochs=2, verbose=0, callbacks=[checkpoint])
    assert checkpoint.saves == (2 if backend.rank() == 0 else 0)
    backend.barrier()
    loaded = keras.saving.load_model(path.format(epoch=2))
    np.testing.assert_allclose(loaded.predict(x, verbose=0), model(x).numpy(), rtol=1e-6, atol=1e-7)
    backend.barrier()


@pytest.mark.parametrize("strategy", ["f", "p", "ls"])
def test_keras_model_checkpoint_on_split_layers_is_refused_before_training(grid_of, tmp_path,
                                                                           strategy):
    model, x, y = compiled_split(grid_of, strategy)
    callback = keras.callbacks.ModelCheckpoint(str(tmp_path / "w.weights.h5"),
                                               save_weights_only=True)
    with pytest.raises(ValueError, match=r"save_weights\(\).*tfhybrid.callbacks.Checkpoint\("
                                         r"'.*w.keras'\)"):
        model.fit(x, y, epochs=1, verbose=0, callbacks=[callback])
    assert int(model.optimizer.iterations.numpy()) == 0


class Interrupt(keras.callbacks.Callback):
    def on_epoch_begin(self, epoch, logs=None):
        if epoch == 2:
            raise RuntimeError("interrupted at the start of epoch 3")


def test_keras_backup_and_restore_resumes_a_data_parallel_run(grid_of):
    """BackupAndRestore as in Keras' fault-tolerance guide: an interrupted fit
    and a new fit on a new model resume at the backed-up epoch on every rank
    and end where 3 uninterrupted single-process epochs end (before: the
    ranks all wrote one HDF5 file; rank 1 failed with a lock error)."""
    x, y = randn((16, 6, 6, 2), "bar", "x"), randn((16, 3), "bar", "y")
    ref = make_model()
    ref.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    ref.fit(x, y, batch_size=8, epochs=3, shuffle=False, verbose=0)
    grid_of(1)
    backup = os.path.join(shared_dir(), f"backup-{world_size()}")
    if backend.rank() == 0 and os.path.exists(backup):
        import shutil
        shutil.rmtree(backup)
    backend.barrier()

    def build():
        model = tfhybrid.transform(make_model(), "d")
        model.compile(optimizer=tfhybrid.DistributedOptimizer(keras.optimizers.Adam(0.01)),
                      loss="mse")
        return model

    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(8)
    first = build()
    with pytest.raises(RuntimeError, match="interrupted"):
        first.fit(tfhybrid.data.shard(data, model=first), epochs=3, verbose=0,
                  callbacks=[keras.callbacks.BackupAndRestore(backup), Interrupt()])
    second = build()
    history = second.fit(tfhybrid.data.shard(data, model=second), epochs=3, verbose=0,
                         callbacks=[keras.callbacks.BackupAndRestore(backup)])
    assert len(history.history["loss"]) == 1          # epoch 3 only
    for a, e in zip(second.get_weights(), ref.get_weights()):
        np.testing.assert_allclose(a, e, rtol=1e-5, atol=1e-6)
    backend.barrier()
    assert not os.path.exists(backup)                 # rank 0 deleted it at the end


@pytest.mark.parametrize("strategy", ["f", "p", "ls"])
def test_keras_backup_and_restore_on_split_models_is_refused_before_training(grid_of, tmp_path,
                                                                             strategy):
    model, x, y = compiled_split(grid_of, strategy)
    with pytest.raises(ValueError, match=r"BackupAndRestore.*tfhybrid.callbacks.Checkpoint\("
                                         r".*tfhybrid.load\("):
        model.fit(x, y, epochs=1, verbose=0,
                  callbacks=[keras.callbacks.BackupAndRestore(str(tmp_path / "b"))])
    assert int(model.optimizer.iterations.numpy()) == 0


def test_a_save_that_fails_on_rank_0_raises_on_every_rank(grid_of, monkeypatch):
    """tfhybrid.save writes on rank 0 while the others wait; a write that fails
    there (here an injected full disk) raises on every rank (rank 0 its
    OSError, the others a RuntimeError naming the save), so a script catching
    it does not leave the other ranks waiting in rank 0's next collective, and
    the next collective pairs up."""
    import tfhybrid.checkpoint as checkpoint

    grid_of(world_size())                    # f: one model group over the world
    model, _ = fitted("f", fallback="replicate")

    def full_disk(*_, **__):
        raise OSError(28, "No space left on device")

    if backend.rank() == 0:
        monkeypatch.setattr(checkpoint, "_write_side_file", full_disk)
    path = os.path.join(job_dir(), "full_disk.keras")
    with pytest.raises((OSError, RuntimeError)) as err:
        tfhybrid.save(model, path, epoch=1)
    if backend.rank() == 0:
        assert err.type is OSError and "No space left" in str(err.value)
    else:
        assert err.type is RuntimeError and "tfhybrid.save" in str(err.value)
    monkeypatch.undo()
    tfhybrid.save(model, path, epoch=1)      # in step: the next save works on every rank
    assert os.path.exists(path)


def test_a_sharded_save_that_fails_on_one_rank_raises_on_every_rank(grid_of, monkeypatch):
    """Sharded checkpoints: every rank writes its own file. A write that fails on
    the last rank (an injected full disk) raises on every rank, not there alone
    (which would leave the others waiting), no checkpoint directory is
    published, and the next save works."""
    import tfhybrid.checkpoint as checkpoint

    grid_of(world_size())                    # f: one model group over the world
    model, _ = fitted("f", fallback="replicate")
    last = world_size() - 1

    def full_disk(*_, **__):
        raise OSError(28, "No space left on device")

    if backend.rank() == last:
        monkeypatch.setattr(checkpoint, "_rank_file", full_disk)
    path = os.path.join(job_dir(), "full_disk_sharded")
    with pytest.raises((OSError, RuntimeError)) as err:
        tfhybrid.save(model, path, epoch=1, sharded=True)
    if backend.rank() == last:
        assert err.type is OSError and "No space left" in str(err.value)
    else:
        assert err.type is RuntimeError and "sharded=True" in str(err.value)
    assert not os.path.exists(path)
    monkeypatch.undo()
    backend.barrier()
    tfhybrid.save(model, path, epoch=1, sharded=True)
    assert os.path.isdir(path)
