"""Stanza's layer separation ``ls`` under horovodrun: after 3 fit steps the
gathered weights equal single-process training on the same global batches
(1e-4 relative); evaluate and predict equal single-process too.

-np 2: (n_c, n_f) = (1, 1); -np 4: (3, 1) and (2, 2). Models: a CNN with a big
FC head (SplitBrain VGG in miniature), a small residual CNN, and a CNN with
BatchNormalization in both parts (moments of the whole global batch: at -np 4
over 3 or 2 CONV workers, and over 2 FC workers).
"""
import keras
import numpy as np
import pytest

import tfhybrid
from conftest import world_size
from stage_testing import (B, CLASSES, IMG, check_evaluate, check_gathered, check_save,
                           compile_sgd, data, model_and_reference)


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


def bn_cnn():
    # No bias before a BatchNormalization: its gradient is zero up to rounding
    # (~1e-8 here), so a relative comparison of it would compare noise.
    x = keras.Input(IMG)
    h = keras.layers.Conv2D(4, 3, padding="same", use_bias=False, name="conv1")(x)
    h = keras.layers.BatchNormalization(momentum=0.5, name="bn1")(h)
    h = keras.layers.Activation("relu", name="relu1")(h)
    h = keras.layers.MaxPooling2D(name="pool1")(h)
    h = keras.layers.Flatten(name="flat")(h)
    h = keras.layers.Dense(16, use_bias=False, name="fc0")(h)
    h = keras.layers.BatchNormalization(momentum=0.5, name="fc_bn")(h)
    h = keras.layers.Activation("relu", name="fc_relu")(h)
    return keras.Model(x, keras.layers.Dense(CLASSES, name="logits")(h), name="bn_ls")


def _fc_worker_values():
    return [1] if world_size() == 2 else [1, 2]


@pytest.mark.parametrize("make", [vgg_fc_head, residual_cnn])
def test_ls_fit_evaluate_predict_equal_single_process(make):
    tfhybrid.init()
    x, y = data()
    for n_f in _fc_worker_values():
        model, reference = model_and_reference(make, x, y)

        pmodel = tfhybrid.transform(model, "ls", fc_workers=n_f)
        assert (pmodel.n_c, pmodel.n_f) == (world_size() - n_f, n_f)
        text = tfhybrid.describe(pmodel, batch_size=B, print_fn=None).text
        assert f"{world_size() - n_f} CONV workers" in text and "bytes sent per step" in text
        compile_sgd(pmodel, True)
        lb = tfhybrid.data.local_batch_size(B, pmodel)
        xl, yl = tfhybrid.data.shard((x, y), model=pmodel, batch_size=B)
        pmodel.fit(xl, yl, batch_size=lb, epochs=1, shuffle=False, verbose=0)
        check_gathered(pmodel, reference, n_f)
        check_evaluate(pmodel, reference, x, y, xl, yl, lb)

        if n_f == 1:       # tfhybrid.save: FC part copied to every CONV worker (Stanza §5.3)
            check_save(pmodel, reference, "tfh_ls")

        pred = pmodel.predict(xl, batch_size=lb, verbose=0)
        if pmodel.role == "CONV":
            np.testing.assert_allclose(pred, reference.predict(xl, batch_size=lb, verbose=0),
                                       rtol=1e-4, atol=1e-5)


def test_ls_batch_norm_equals_single_process():
    """BatchNormalization in the CONV part normalizes with the moments of the
    whole global batch (synchronised over the CONV workers), in the FC part
    with those of all FC workers' rows: after 3 SGD steps every weight,
    moving mean/variance included, and the History's loss equal one process."""
    tfhybrid.init()
    x, y = data()
    keras.utils.set_random_seed(3)
    model = bn_cnn()
    reference = keras.models.clone_model(model)
    reference.set_weights(model.get_weights())
    compile_sgd(reference, False)
    want = reference.fit(x, y, batch_size=B, epochs=1, shuffle=False, verbose=0).history
    for n_f in _fc_worker_values():
        pmodel = tfhybrid.transform(model, "ls", fc_workers=n_f)
        compile_sgd(pmodel, True)
        lb = tfhybrid.data.local_batch_size(B, pmodel)
        xl, yl = tfhybrid.data.shard((x, y), model=pmodel, batch_size=B)
        got = pmodel.fit(xl, yl, batch_size=lb, epochs=1, shuffle=False, verbose=0).history
        case = (pmodel.n_c, pmodel.n_f, pmodel.role)
        assert abs(got["loss"][0] - want["loss"][0]) <= 1e-5 * abs(want["loss"][0]), \
            (case, got, want)
        assert abs(got["accuracy"][0] - want["accuracy"][0]) < 1e-6, (case, got, want)
        check_gathered(pmodel, reference, case)
        check_evaluate(pmodel, reference, x, y, xl, yl, lb)


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


def test_ls_get_layer_finds_layers_of_both_parts():
    """model.get_layer('conv1') on an ls model failed with Keras' "No such layer"
    (its layers are 'functional', 'ls_conv_part' and 'ls_fc_part')."""
    tfhybrid.init()
    model = tfhybrid.transform(vgg_fc_head(), "ls", fc_workers=1)
    for name in ("conv1", "fc0", "logits"):
        assert model.get_layer(name).name == name
    with pytest.raises(ValueError, match="nope"):
        model.get_layer("nope")


def test_ls_refuses_trainable_changed_after_transform():
    """Unfreezing after transform under ls: the frozen part's flags are reset by
    Keras and the trained set is fixed at transform (checkpoint slots, gather)."""
    tfhybrid.init()
    model = tfhybrid.transform(vgg_fc_head(), "ls", fc_workers=1)
    compile_sgd(model, True)
    x, y = data()
    model.get_layer("conv1").trainable = False      # on every rank, as scripts do
    with pytest.raises(ValueError, match=r"Layers .* of ls model .* frozen or unfrozen "
                                         r"after tfhybrid.transform.*tfhybrid.gather"):
        model.fit(x, y, batch_size=B, epochs=1, verbose=0)
    with pytest.raises(ValueError, match=r"frozen or unfrozen after tfhybrid.transform"):
        tfhybrid.gather(model)
