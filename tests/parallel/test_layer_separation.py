"""Stanza's layer separation ``ls`` under horovodrun: after 3 fit steps the
gathered weights equal single-process training on the same global batches
(1e-4 relative); evaluate and predict equal single-process too.

-np 2: (n_c, n_f) = (1, 1); -np 4: (3, 1) and (2, 2). Models: a CNN with a big
FC head (SplitBrain VGG in miniature) and a small residual CNN.
"""
import os

import keras
import numpy as np
import pytest

import tfhybrid
from conftest import world_size

B, STEPS, IMG, CLASSES = 12, 3, (8, 8, 2), 5


def vgg_fc_head():
    x = keras.Input(IMG)
    h = keras.layers.Conv2D(4, 3, padding="same", activation="relu", name="conv1")(x)
    h = keras.layers.MaxPooling2D(name="pool1")(h)
    h = keras.layers.Conv2D(6, 3, padding="same", activation="relu", name="conv2")(h)
    h = keras.layers.MaxPooling2D(name="pool2")(h)
    h = keras.layers.Flatten(name="flat")(h)
    h = keras.layers.Dense(32, activation="relu", name="fc0")(h)
    h = keras.layers.Dense(16, activation="relu", name="fc1")(h)
    return keras.Model(x, keras.layers.Dense(CLASSES, name="logits")(h), name="vgg_ls")


def residual_cnn():
    x = keras.Input(IMG)
    h = keras.layers.Conv2D(4, 3, padding="same", activation="relu", name="stem")(x)
    r = keras.layers.Conv2D(4, 3, padding="same", activation="relu", name="res_a")(h)
    r = keras.layers.Conv2D(4, 3, padding="same", name="res_b")(r)
    h = keras.layers.Activation("relu", name="res_relu")(keras.layers.Add(name="res_add")([h, r]))
    h = keras.layers.GlobalAveragePooling2D(name="gap")(h)
    return keras.Model(x, keras.layers.Dense(CLASSES, name="logits")(h), name="res_ls")


def _data():
    rng = np.random.default_rng(7)
    x = rng.standard_normal((B * STEPS,) + IMG).astype("float32")
    y = rng.integers(0, CLASSES, B * STEPS)
    return x, y


def _compile(model, distributed):
    opt = keras.optimizers.SGD(0.1, momentum=0.5)
    model.compile(tfhybrid.DistributedOptimizer(opt) if distributed else opt,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])


def _rel(a, b):
    return float(np.max(np.abs(a - b)) / (np.max(np.abs(b)) + 1e-12))


def _fc_worker_values():
    return [1] if world_size() == 2 else [1, 2]


@pytest.mark.parametrize("make", [vgg_fc_head, residual_cnn])
def test_ls_fit_evaluate_predict_equal_single_process(make):
    tfhybrid.init()
    x, y = _data()
    for n_f in _fc_worker_values():
        keras.utils.set_random_seed(3)
        model = make()
        reference = keras.models.clone_model(model)
        reference.set_weights(model.get_weights())
        _compile(reference, False)
        reference.fit(x, y, batch_size=B, epochs=1, shuffle=False, verbose=0)

        pmodel = tfhybrid.transform(model, "ls", fc_workers=n_f)
        assert (pmodel.n_c, pmodel.n_f) == (world_size() - n_f, n_f)
        text = tfhybrid.describe(pmodel, batch_size=B, print_fn=None).text
        assert f"{world_size() - n_f} CONV workers" in text and "bytes sent per step" in text
        _compile(pmodel, True)
        lb = tfhybrid.data.local_batch_size(B, pmodel)
        xl, yl = tfhybrid.data.shard((x, y), model=pmodel, batch_size=B)
        pmodel.fit(xl, yl, batch_size=lb, epochs=1, shuffle=False, verbose=0)
        full = tfhybrid.gather(pmodel)
        for got, want, w in zip(full.get_weights(), reference.get_weights(), reference.weights):
            assert _rel(got, want) < 1e-4, (n_f, w.path, _rel(got, want))

        want = reference.evaluate(x, y, batch_size=B, verbose=0, return_dict=True)
        got = pmodel.evaluate(xl, yl, batch_size=lb, verbose=0, return_dict=True)
        assert abs(got["loss"] - want["loss"]) <= 1e-4 * abs(want["loss"]), (got, want)
        assert abs(got["accuracy"] - want["accuracy"]) < 1e-6, (got, want)

        if n_f == 1:       # tfhybrid.save: FC part copied to every CONV worker (Stanza §5.3)
            path = f"/tmp/tfh_ls_{os.environ.get('HOROVOD_GLOO_RENDEZVOUS_PORT', 'x')}.keras"
            tfhybrid.save(pmodel, path, epoch=1)
            saved = keras.saving.load_model(path, compile=False)
            for got, want in zip(saved.get_weights(), reference.get_weights()):
                assert _rel(got, want) < 1e-4
            side = np.load(path + ".state.npz", allow_pickle=True)
            momenta = [k for k in side.files if "momentum" in k]
            assert len(momenta) == len(reference.trainable_weights), side.files

        pred = pmodel.predict(xl, batch_size=lb, verbose=0)
        if pmodel.role == "CONV":
            np.testing.assert_allclose(pred, reference.predict(xl, batch_size=lb, verbose=0),
                                       rtol=1e-4, atol=1e-5)


def test_ls_bad_input():
    tfhybrid.init()
    dense_only = keras.Sequential([keras.Input((6,)), keras.layers.Dense(4, name="d0"),
                                   keras.layers.Dense(2, name="d1")])
    with pytest.raises(ValueError, match="no convolution or pooling before its first Dense"):
        tfhybrid.transform(dense_only, "ls", fc_workers=1)
    from tfhybrid.transformer.layer_separation import assign_workers
    chosen = tfhybrid.transform(vgg_fc_head(), "ls")     # n_f from Stanza's model (oracle)
    assert chosen.n_f == assign_workers(vgg_fc_head(), world_size())
    bad = 3 if world_size() == 4 else 2
    with pytest.raises(ValueError, match=f"fc_workers={bad}"):
        tfhybrid.transform(vgg_fc_head(), "ls", fc_workers=bad)
