"""Transfer learning as users write it: layers frozen before ``transform``, a
first ``fit`` of the head, then the base unfrozen on the transformed model
(``model.get_layer(name).trainable = True``), a recompile with a smaller
learning rate and a second ``fit``.

The weights equal one process doing the same; ``gather`` returns the layers'
current ``trainable`` flags (it rebuilt the flags recorded at ``transform``,
so a model saved after unfreezing loaded with its base frozen again).
"""
import os

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfhybrid

from conftest import assert_weights_like, reference_once, rng, world_size

BATCH = 16
FROZEN = ("c0", "bn0", "fc0")
CASES = [("d", 1), ("f", world_size()), ("s", world_size()), ("p", 2), ("df", 2), ("ds", 2)]


def _model():
    keras.utils.set_random_seed(3)
    inputs = keras.Input((8, 8, 3))
    h = keras.layers.Conv2D(8, 3, padding="same", name="c0")(inputs)
    h = keras.layers.BatchNormalization(name="bn0")(h)
    h = keras.layers.ReLU(name="relu0")(h)
    h = keras.layers.Conv2D(8, 3, padding="same", activation="relu", name="c1")(h)
    h = keras.layers.GlobalAveragePooling2D(name="pool")(h)
    h = keras.layers.Dense(8, activation="relu", name="fc0")(h)
    model = keras.Model(inputs, keras.layers.Dense(4, name="fc1")(h))
    for name in FROZEN:
        model.get_layer(name).trainable = False
    return model


def _options(strategy):
    return {"stages": 2} if strategy == "p" else {"fallback": "replicate"}


def _compile(model, optimizer, wrap):
    model.compile(optimizer=tfhybrid.DistributedOptimizer(optimizer) if wrap else optimizer,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))


def _fine_tune(model, fit, wrap):
    _compile(model, keras.optimizers.Adam(0.01), wrap)
    fit(model, 1)
    for name in FROZEN[:2]:                  # the base; fc0 stays frozen
        if name in getattr(model, "local_layer_names", (name,)):   # p: where it runs
            model.get_layer(name).trainable = True
    _compile(model, keras.optimizers.SGD(0.01, momentum=0.9), wrap)
    fit(model, 2)


def _data():
    return (rng("fine-tune-x").standard_normal((64, 8, 8, 3)).astype(np.float32),
            rng("fine-tune-y").integers(0, 4, 64))


def _reference_weights():
    """The weights after the same fine-tuning in one process (rank 0, once per run)."""
    def compute():
        x, y = _data()
        reference = _model()
        _fine_tune(reference, lambda m, epochs: m.fit(x, y, batch_size=BATCH, epochs=epochs,
                                                      shuffle=False, verbose=0), wrap=False)
        return reference.get_weights()
    return reference_once(compute, BATCH)


@pytest.mark.parametrize("strategy,mp", CASES, ids=lambda c: str(c))
def test_unfreezing_after_transform_trains_like_one_process(grid_of, strategy, mp):
    grid = grid_of(mp)
    if strategy in ("df", "ds") and grid.data_size == 1:
        pytest.skip("one data-parallel rank")
    x, y = _data()
    reference = _reference_weights()
    model = tfhybrid.transform(_model(), strategy, **_options(strategy))
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH)
    _fine_tune(model, lambda m, epochs: m.fit(tfhybrid.data.shard(ds, model=m),
                                              epochs=epochs, verbose=0), wrap=True)
    full = tfhybrid.gather(model)
    assert {l.name for l in full.layers if l.weights and not l.trainable} == {"fc0"}
    assert_weights_like(full, reference)    # c0's bias (before a BatchNormalization) ~ 0
    moved = np.max(np.abs(full.get_layer("c0").get_weights()[0]
                          - _model().get_layer("c0").get_weights()[0]))
    assert moved > 1e-3          # the unfrozen base did train


@pytest.mark.parametrize("strategy,mp", CASES[:4], ids=lambda c: str(c))
def test_checkpoint_after_unfreezing_resumes_like_one_process(grid_of, strategy, mp):
    """tfhybrid.save after unfreezing: the slots of the unfrozen weights were
    lined up against the frozen flags recorded at transform (4 trainable
    weights in the gathered model for 8 in the optimizer)."""
    from conftest import job_dir

    grid_of(mp)
    x, y = _data()
    reference = _reference_weights()
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH)
    model = tfhybrid.transform(_model(), strategy, **_options(strategy))
    _fine_tune(model, lambda m, epochs: m.fit(tfhybrid.data.shard(ds, model=m), epochs=1,
                                              verbose=0), wrap=True)      # 1 of the 2 epochs
    path = os.path.join(job_dir(), f"fine_tune_{strategy}.keras")
    tfhybrid.save(model, path, epoch=1)
    resumed = tfhybrid.load(path, **_options(strategy))
    resumed.fit(tfhybrid.data.shard(ds, model=resumed), epochs=2, verbose=0)
    assert_weights_like(tfhybrid.gather(resumed), reference)
