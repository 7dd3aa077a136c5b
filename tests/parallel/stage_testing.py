"""Shared pieces of the rank-heterogeneous strategy tests (``p``, ``ls``):
the data, the compiled optimizer, the single-process reference run and the
checks of gathered weights, evaluate and ``tfhybrid.save`` against it."""
import os

import keras
import numpy as np

import tfhybrid

from conftest import job_dir

B, STEPS, IMG, CLASSES = 12, 3, (8, 8, 2), 5


def data():
    rng = np.random.default_rng(7)
    x = rng.standard_normal((B * STEPS,) + IMG).astype("float32")
    y = rng.integers(0, CLASSES, B * STEPS)
    return x, y


def compile_sgd(model, distributed):
    opt = keras.optimizers.SGD(0.1, momentum=0.5)
    model.compile(tfhybrid.DistributedOptimizer(opt) if distributed else opt,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])


def rel(a, b):
    return float(np.max(np.abs(a - b)) / (np.max(np.abs(b)) + 1e-12))


def model_and_reference(make, x, y):
    """``make()`` (seeded) and a single-process copy of it trained one epoch on (x, y)."""
    keras.utils.set_random_seed(3)
    model = make()
    reference = keras.models.clone_model(model)
    reference.set_weights(model.get_weights())
    compile_sgd(reference, False)
    reference.fit(x, y, batch_size=B, epochs=1, shuffle=False, verbose=0)
    return model, reference


def check_gathered(pmodel, reference, case):
    full = tfhybrid.gather(pmodel)
    for got, want, w in zip(full.get_weights(), reference.get_weights(), reference.weights):
        assert rel(got, want) < 1e-4, (case, w.path, rel(got, want))


def check_evaluate(pmodel, reference, x, y, xl, yl, lb):
    want = reference.evaluate(x, y, batch_size=B, verbose=0, return_dict=True)
    got = pmodel.evaluate(xl, yl, batch_size=lb, verbose=0, return_dict=True)
    assert abs(got["loss"] - want["loss"]) <= 1e-4 * abs(want["loss"]), (got, want)
    assert abs(got["accuracy"] - want["accuracy"]) < 1e-6, (got, want)


def check_save(pmodel, reference, stem):
    """``tfhybrid.save`` writes the reference's weights and one momentum slot per
    trainable weight; returns the side file."""
    path = os.path.join(job_dir(), f"{stem}.keras")
    tfhybrid.save(pmodel, path, epoch=1)
    saved = keras.saving.load_model(path, compile=False)
    for got, want in zip(saved.get_weights(), reference.get_weights()):
        assert rel(got, want) < 1e-4
    side = np.load(path + ".state.npz", allow_pickle=True)
    momenta = [k for k in side.files if "momentum" in k]
    assert len(momenta) == len(reference.trainable_weights), side.files
    return side
