"""tfhybrid.batch_losses and source.finalize_states in one process.

The multi-process behaviour (losses and penalties equal to one process under
d, df, gmp, f, c, s, ds, p, ls) is tests/parallel/test_loss_reductions.py;
here the arithmetic each rank does and the pieces that need no peers.
"""
import keras
import numpy as np
import pytest

import tfhybrid
from tfhybrid import batch_losses
from tfhybrid.transformer import rules
from tfhybrid.transformer.graph import describe_graph
from tfhybrid.transformer.source import finalize_states


@pytest.fixture(autouse=True)
def _one_process():
    tfhybrid.init()
    yield


Y = np.array([0, 1, 2, 1])
P = np.array([[0.7, 0.2, 0.1], [0.1, 0.8, 0.1], [0.2, 0.2, 0.6], [0.3, 0.4, 0.3]], np.float32)
W = np.array([1.0, 0.5, 2.0, 0.25], np.float32)


def _loss(reduction):
    return keras.losses.SparseCategoricalCrossentropy(reduction=reduction)


def test_sum_is_the_blocks_share_times_the_blocks():
    wrapped = batch_losses.BlockRowsLoss(_loss("sum"), "sum", 4, ())
    np.testing.assert_allclose(float(wrapped(Y, P)), 4 * float(_loss("sum")(Y, P)), rtol=1e-6)


def test_weighted_mean_divides_by_the_weight_sum_times_the_blocks():
    # one block (no peers): D x (weighted sum) / (own weight sum)
    wrapped = batch_losses.BlockRowsLoss(_loss("mean_with_sample_weight"),
                                         "mean_with_sample_weight", 2, ())
    want = 2 * float(_loss("mean_with_sample_weight")(Y, P, W))
    np.testing.assert_allclose(float(wrapped(Y, P, W)), want, rtol=1e-6)
    # without weights it is the plain mean
    np.testing.assert_allclose(float(wrapped(Y, P)), float(_loss("mean_with_sample_weight")(Y, P)),
                               rtol=1e-6)


def test_row_blocks_follow_the_batch_split_and_the_models_own_roles():
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    assert batch_losses.row_blocks(model) == (1, (0,))
    model._tfhybrid_batch_split = "world"
    assert batch_losses.row_blocks(model) == (1, (0,))

    class Roles:
        def row_blocks(self):
            return 3, (0, 1, 2)
    assert batch_losses.row_blocks(Roles()) == (3, (0, 1, 2))


def test_one_block_leaves_the_compiled_losses_alone():
    model = tfhybrid.transform(keras.Sequential([keras.Input((3,)), keras.layers.Dense(3)]), "d")
    model.compile(optimizer="sgd", loss=_loss("sum"))
    model.fit(np.zeros((4, 3), np.float32), Y, verbose=0)
    assert not any(isinstance(e.loss, batch_losses.BlockRowsLoss)
                   for e in model._compile_loss._flat_losses)


def test_finalize_states_restores_an_adapted_normalizations_statistics():
    data = (5.0 + 3.0 * np.random.RandomState(0).randn(64, 3)).astype(np.float32)
    adapted = keras.layers.Normalization()
    adapted.adapt(data)
    copy = keras.layers.Normalization.from_config(adapted.get_config())
    copy.build((None, 3))
    copy.set_weights(adapted.get_weights())
    assert not np.allclose(copy(data[:4]), adapted(data[:4]), atol=1e-3)   # set_weights alone
    finalize_states(copy)
    np.testing.assert_allclose(copy(data[:4]), adapted(data[:4]), rtol=1e-6, atol=1e-6)


def test_nested_model_and_preprocessing_layers_are_marked_in_the_graph():
    base = keras.Sequential([keras.Input((8, 8, 2)), keras.layers.Conv2D(4, 3)], name="base")
    inp = keras.Input((8, 8, 2))
    h = keras.layers.RandomFlip(name="flip")(inp)
    out = keras.layers.GlobalAveragePooling2D(name="gap")(base(h))
    graph = describe_graph(keras.Model(inp, out))
    nodes = {n.name: n for n in graph.nodes}
    assert nodes["base"].attr("nested_model") and "Build the model flat" in \
        rules.nested_model_hint(nodes["base"])
    assert nodes["flip"].attr("preprocessing") and not nodes["gap"].attr("preprocessing")
    assert rules.nested_model_hint(nodes["gap"]) == ""
