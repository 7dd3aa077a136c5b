"""The pipeline ``p`` (GPipe) under horovodrun: after 3 fit steps the gathered
weights equal single-process training on the same global batches (1e-4
relative); evaluate and predict equal single-process too.

-np 2: 2 stages, micro-batches 1, 2 and 4 (4 on the CNN only). -np 4: 4
stages, and 2 stages x 2 data groups (p x d). Models: a CNN with an FC head
(an L2 kernel regularizer in its first stage) and a small residual CNN with
BatchNormalization inside the block (the stage joins its micro-batches and
syncs the moments over its data group).
"""
import keras
import numpy as np
import pytest

import tfhybrid
from conftest import world_size
from stage_testing import (B, CLASSES, IMG, check_evaluate, check_gathered, check_save,
                           compile_sgd, data, model_and_reference, rel)


def cnn_fc_head():
    x = keras.Input(IMG)
    h = keras.layers.Conv2D(4, 3, padding="same", activation="relu", name="conv1",
                            kernel_regularizer=keras.regularizers.L2(0.01))(x)
    h = keras.layers.MaxPooling2D(name="pool1")(h)
    h = keras.layers.Conv2D(6, 3, padding="same", activation="relu", name="conv2")(h)
    h = keras.layers.MaxPooling2D(name="pool2")(h)
    h = keras.layers.Flatten(name="flat")(h)
    h = keras.layers.Dense(32, activation="relu", name="fc0")(h)
    h = keras.layers.Dense(16, activation="relu", name="fc1")(h)
    return keras.Model(x, keras.layers.Dense(CLASSES, name="logits")(h), name="cnn_p")


def residual_cnn():
    x = keras.Input(IMG)
    h = keras.layers.Conv2D(4, 3, padding="same", activation="relu", name="stem")(x)
    r = keras.layers.Conv2D(4, 3, padding="same", use_bias=False, name="res_a")(h)
    r = keras.layers.BatchNormalization(name="res_bn")(r)
    r = keras.layers.Activation("relu", name="res_a_relu")(r)
    r = keras.layers.Conv2D(4, 3, padding="same", name="res_b")(r)
    h = keras.layers.Activation("relu", name="res_relu")(keras.layers.Add(name="res_add")([h, r]))
    h = keras.layers.Conv2D(6, 3, padding="same", activation="relu", name="head_conv")(h)
    h = keras.layers.GlobalAveragePooling2D(name="gap")(h)
    return keras.Model(x, keras.layers.Dense(CLASSES, name="logits")(h), name="res_p")


def _configs(make):
    """(model_parallel, stages, micro_batches) to test at this world size."""
    if world_size() == 2:
        return [(2, 2, 1), (2, 2, 2)] + ([(2, 2, 4)] if make is cnn_fc_head else [])
    return [(4, 4, 2), (2, 2, 2)]


@pytest.mark.parametrize("make", [cnn_fc_head, residual_cnn])
def test_p_fit_evaluate_predict_equal_single_process(make, grid_of):
    x, y = data()
    for mp, stages, m in _configs(make):
        grid_of(mp)
        model, reference = model_and_reference(make, x, y)

        pmodel = tfhybrid.transform(model, "p", stages=stages, micro_batches=m)
        assert (pmodel.stages, pmodel.micro_batches) == (stages, m)
        text = tfhybrid.describe(pmodel, batch_size=B, print_fn=None).text
        assert f"{stages} stages x {world_size() // mp} data groups" in text, text
        assert "bytes sent per step" in text
        mine = {w.path for w in pmodel.trainable_weights}
        assert len(pmodel.trainable_weights) < len(model.trainable_weights), mine
        compile_sgd(pmodel, True)
        lb = tfhybrid.data.local_batch_size(B, pmodel)
        xl, yl = tfhybrid.data.shard((x, y), model=pmodel, batch_size=B)
        history = pmodel.fit(xl, yl, batch_size=lb, epochs=1, shuffle=False, verbose=0)
        assert np.isfinite(history.history["loss"][-1])
        check_gathered(pmodel, reference, (mp, stages, m))
        check_evaluate(pmodel, reference, x, y, xl, yl, lb)

        pred = pmodel.predict(xl, batch_size=lb, verbose=0)
        np.testing.assert_allclose(pred, reference.predict(xl, batch_size=lb, verbose=0),
                                   rtol=1e-4, atol=1e-5)

        if m == 2 and make is cnn_fc_head and world_size() == 2:   # tfhybrid.save
            side = check_save(pmodel, reference, "tfh_p")
            ref_m = [v.numpy() for v in reference.optimizer.variables if "momentum" in v.path]
            got_m = [side[f"slot/momentum/{i}"] for i in range(len(ref_m))]
            for got, want in zip(got_m, ref_m):
                assert rel(got, want) < 1e-4


def test_p_bad_input(grid_of):
    grid_of(2)
    with pytest.raises(ValueError, match="stages=4"):
        tfhybrid.transform(cnn_fc_head(), "p", stages=4)
    tiny = keras.Sequential([keras.Input((6,)), keras.layers.Dense(4, name="d0")])
    with pytest.raises(ValueError, match="stages=2 .* cut at only 0 places"):
        tfhybrid.transform(tiny, "p", stages=2)
    pmodel = tfhybrid.transform(cnn_fc_head(), "p", stages=2, micro_batches=4)
    compile_sgd(pmodel, True)
    x, y = data()
    with pytest.raises(ValueError, match="micro_batches=4, which does not divide the local "
                                         "batch of 6"):
        pmodel.fit(x[:6], y[:6], batch_size=6, epochs=1, verbose=0)


def test_p_get_layer_finds_this_stages_layers_and_names_the_others(grid_of):
    """model.get_layer('conv1') on a p model failed with Keras' "No such layer:
    conv1. Existing layers are: ['p_stage_0']" on every rank."""
    grid_of(2)
    pmodel = tfhybrid.transform(cnn_fc_head(), "p", stages=2)
    mine = pmodel.local_layer_names
    assert mine and set(mine) <= {l.name for l in cnn_fc_head().layers}
    for name in mine:
        assert pmodel.get_layer(name).name == name
    other = next(n for n in ("conv1", "logits") if n not in mine)
    with pytest.raises(ValueError, match=rf"Layer '{other}' runs on pipeline stage \d .*"
                                         r"local_layer_names.*tfhybrid.gather"):
        pmodel.get_layer(other)
    with pytest.raises(ValueError, match="No such layer: 'nope'"):
        pmodel.get_layer("nope")
