"""A model compiled before ``transform`` (a script that adds one line before ``fit``).

An uncompiled transformed model would make ``fit`` fail with Keras' "You
must call `compile()` before using the model". The transformed model is
compiled like its source (loss, loss weights, metrics; a plain optimizer
wrapped in ``DistributedOptimizer``, a trained one copied from its config).
Each case: History and gathered weights vs one process training the
unmodified model with the same compile arguments.
"""
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfhybrid

from conftest import world_size

N, BATCH, CLASSES = 48, 16, 4
CASES = [("d", 1), ("f", world_size()), ("p", 2)]


def _data():
    rng = np.random.RandomState(11)
    return rng.randn(N, 6, 6, 2).astype(np.float32), rng.randint(0, CLASSES, N)


def _model():
    keras.utils.set_random_seed(5)
    return keras.Sequential([
        keras.Input((6, 6, 2)),
        keras.layers.Conv2D(4, 3, padding="same", activation="relu", name="conv"),
        keras.layers.Flatten(name="flat"),
        keras.layers.Dense(8, activation="relu", name="fc0"),
        keras.layers.Dense(CLASSES, name="fc1")])


def _compile(model):
    model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    return model


def _fit(model, x, y, epochs=2):
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH)
    return model.fit(tfhybrid.data.shard(ds, model=model), epochs=epochs, verbose=0)


def _close(got, want, tol=1e-5):
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=tol, atol=tol * (np.max(np.abs(b)) + 1e-12))


@pytest.mark.parametrize("strategy,mp", CASES, ids=lambda c: str(c))
def test_model_compiled_before_transform_trains_like_one_process(grid_of, strategy, mp):
    grid_of(mp)
    x, y = _data()
    reference = _compile(_model())
    want = reference.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = tfhybrid.transform(_compile(_model()), strategy)
    assert model.compiled
    if strategy != "p":      # p reduces its stages' gradients itself (any optimizer)
        assert isinstance(model.optimizer, tfhybrid.DistributedOptimizer)
        warned = any("wrapped in tfhybrid.DistributedOptimizer" in str(w.message) for w in caught)
        assert warned == (tfhybrid.rank() == 0)        # rank 0 speaks for the job
    got = _fit(model, x, y)
    for key in ("loss", "accuracy"):
        np.testing.assert_allclose(got.history[key], want.history[key], rtol=1e-5, atol=1e-6)
    _close(tfhybrid.gather(model).get_weights(), reference.get_weights())


def test_trained_source_gets_a_fresh_copy_of_its_optimizer(grid_of):
    """Fine-tune on one process, then parallelise: the source's optimizer holds
    slots for the source's variables; the transformed model starts a copy."""
    grid_of(world_size())
    x, y = _data()
    source = _compile(_model())
    source.fit(x[:BATCH], y[:BATCH], batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    reference = _compile(keras.models.clone_model(source))
    reference.set_weights(source.get_weights())
    reference.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = tfhybrid.transform(source, "f")
    assert model.optimizer.inner_optimizer is not source.optimizer
    _fit(model, x, y, epochs=1)
    _close(tfhybrid.gather(model).get_weights(), reference.get_weights())


def test_uncompiled_source_stays_uncompiled(grid_of):
    grid_of(1)
    model = tfhybrid.transform(_model(), "d")
    assert not model.compiled


@pytest.mark.parametrize("strategy", ["p", "ls"])
def test_pipeline_and_ls_refuse_horovods_keras_optimizer(grid_of, strategy):
    """p/ls run their own optimizer step (no wrapping compile): Horovod's Keras
    optimizer failed inside it with a tf.keras 2 error; it is refused at compile."""
    import horovod.tensorflow.keras as hvd_keras

    grid_of(2 if strategy == "p" else world_size())
    model = tfhybrid.transform(_model(), strategy)
    with pytest.raises(ValueError, match=r"horovod.tensorflow.keras.DistributedOptimizer "
                                         r"\(SGD\).*tfhybrid.DistributedOptimizer"):
        model.compile(hvd_keras.DistributedOptimizer(keras.optimizers.SGD(0.1)), "mse")
    _compile(model)        # a Keras optimizer still compiles
    assert model.compiled
