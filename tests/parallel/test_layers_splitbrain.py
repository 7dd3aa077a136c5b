"""ShardLayer, ModuloLayer ("BK", "B", "B/K") and ModuloInverseLayer under horovodrun.

The boundary layers alone against numpy (values, and the gradient scaling by
K and 1/K), static shapes when Keras traces with an unknown batch, ``.keras``
round trips of SplitBrain networks and error messages. Training against a
single process is in test_layers_splitbrain_training.py.
"""
import keras
import numpy as np
import pytest
import tensorflow as tf

from tfhybrid.layers import ModuloInverseLayer, ModuloLayer, ShardLayer

from conftest import model_parallel_values, randn
from layers_testing import FWD, GRAD, block, check_save_load, rank_path, value_and_grads
from splitbrain_net import LOSS, global_batch, splitbrain_model

MPS = model_parallel_values()
PG, R = "replicated_partial_grad", "replicated"
B, IMG, CLASSES, LR = 4, (6, 6, 2), 8, 0.1


@pytest.fixture(params=MPS, ids=lambda m: f"mp{m}")
def grid(request, grid_of):
    return grid_of(request.param)


# -- the boundary layers alone -------------------------------------------------------

@pytest.mark.parametrize("mode", ["eager", "function"])
def test_shard_layer(grid, mode):
    g = grid.group("model")
    full = randn((B, 8), "full", g.ranks)
    ups = [randn((B, 8), "u", r) for r in g.ranks]           # P gradient
    y, dx, _ = value_and_grads(lambda t: _with_loss(ShardLayer()(t), ups[g.index]), [],
                               block(full, -1, g), mode)
    np.testing.assert_allclose(y, full, **FWD)
    np.testing.assert_allclose(dx, block(sum(ups), -1, g), **GRAD)


def _with_loss(y, u):
    return y, tf.reduce_sum(y * u)


@pytest.mark.parametrize("mode", ["eager", "function"])
@pytest.mark.parametrize("out_layout", [PG, R])
def test_modulo_bk_gathers_rows_and_scales_gradient_by_k(grid, out_layout, mode):
    g = grid.group("model")
    rows = [randn((B, 3), "x", r) for r in g.ranks]
    ups = [randn((B * g.size, 3), "u", r if out_layout == PG else 0) for r in g.ranks]
    layer = ModuloLayer("BK", output_layout=out_layout)
    y, dx, _ = value_and_grads(lambda t: _with_loss(layer(t), ups[g.index]), [],
                               rows[g.index], mode)
    np.testing.assert_allclose(y, np.concatenate(rows), **FWD)
    true_grad = sum(ups) if out_layout == PG else ups[0]      # P summed, or R
    np.testing.assert_allclose(dx, g.size * np.split(true_grad, g.size)[g.index], **GRAD)


@pytest.mark.parametrize("mode", ["eager", "function"])
@pytest.mark.parametrize("in_layout", [R, PG])
def test_inverse_keeps_own_rows_and_scales_gradient_by_1_over_k(grid, in_layout, mode):
    g = grid.group("model")
    full = randn((B * g.size, 3), "full", g.ranks)
    ups = [randn((B, 3), "u", r) for r in g.ranks]
    layer = ModuloInverseLayer(input_layout=in_layout)
    y, dx, _ = value_and_grads(lambda t: _with_loss(layer(t), ups[g.index]), [], full, mode)
    np.testing.assert_allclose(y, np.split(full, g.size)[g.index], **FWD)
    if in_layout == R:
        want = np.concatenate(ups)
    else:
        want = np.zeros_like(full)
        np.split(want, g.size)[g.index][...] = ups[g.index]
    np.testing.assert_allclose(dx, want / g.size, **GRAD)


# -- Keras logits behind a softmax output ---------------------------------------------

@pytest.mark.parametrize("mode", ["eager", "function"])
@pytest.mark.parametrize("scheme", ["BK", "B", "B/K"])
def test_softmax_rows_carry_keras_logits_to_the_loss(grid, scheme, mode):
    """Keras' crossentropy of a softmax output reads its ``_keras_logits``, not the
    probabilities clipped to [1e-7, 1 - 1e-7]; the rows leaving the region carry
    them, so confidently wrong rows keep their true loss and gradient."""
    g = grid.group("model")
    dense = keras.layers.Dense(CLASSES, activation="softmax")
    dense.build((None, 3))
    dense.set_weights([10 * randn((3, CLASSES), "logits-w"), randn((CLASSES,), "logits-b")])
    own = randn((B * g.size, 3), "logits-x", g.ranks)[g.index * B:(g.index + 1) * B]
    # each row's label is its least likely class: confidently wrong on every rank
    kernel, bias = dense.get_weights()
    labels = np.argmin(own @ kernel + bias, axis=-1)
    if scheme == "BK":
        model = keras.Sequential([ModuloLayer("BK", output_layout=R), dense,
                                  ModuloInverseLayer()])
    else:
        model = ModuloLayer(scheme, body=dense, output_layout=R)

    def call(t):
        loss = keras.losses.sparse_categorical_crossentropy(labels, model(t))
        return loss, tf.reduce_sum(loss)

    def logits_call(t):
        logits = tf.matmul(t, dense.kernel) + dense.bias
        loss = keras.losses.sparse_categorical_crossentropy(labels, logits, from_logits=True)
        return loss, tf.reduce_sum(loss)

    loss, dx, _ = value_and_grads(call, [], own, mode)
    want, want_dx, _ = value_and_grads(logits_call, [], own, "eager")
    assert want.max() > 20, "no probability below 1e-7: the comparison would be vacuous"
    np.testing.assert_allclose(loss, want, **FWD)
    np.testing.assert_allclose(dx, want_dx, **GRAD)


# -- a SplitBrain network against single-process training --------------------------


@pytest.mark.parametrize("scheme,exit_", [("BK", "shard"), ("B/K", "gather")])
def test_static_shapes_with_unknown_batch(grid, scheme, exit_):
    """Keras fit traces with batch None: outputs and gradients keep static shapes."""
    par = splitbrain_model(scheme, PG, exit_)

    @tf.function(input_signature=[tf.TensorSpec((None,) + IMG), tf.TensorSpec([None], tf.int32)])
    def step(x, y):
        with tf.GradientTape() as tape:
            out = par(x, training=True)
            loss = LOSS(y, out)
        assert out.shape.as_list() == [None, CLASSES]
        for v, gr in zip(par.trainable_weights, tape.gradient(loss, par.trainable_weights)):
            assert gr.shape == v.shape, v.path
        return loss

    x, y = global_batch(grid, 0)
    own = slice(grid.rank * B, (grid.rank + 1) * B)
    step(x[own], y[own])


def test_save_load_round_trip(grid, tmp_path):
    for scheme in ("BK", "B", "B/K"):
        model = splitbrain_model(scheme, PG, "shard")
        x = randn((B,) + IMG, "save", grid.rank)
        check_save_load(model, x, rank_path(tmp_path, f"splitbrain_{scheme.replace('/', '')}"))


# -- errors ---------------------------------------------------------------------

def test_b_over_k_batch_not_divisible(grid_of):
    grid_of(2)
    layer = ModuloLayer("B/K", body=keras.layers.Dense(3), name="mod")
    with pytest.raises(ValueError, match=r"'mod': scheme='B/K' needs a local batch divisible "
                                         r"by K: local batch=3 is not divisible by the 2 "
                                         r"ranks"):
        layer(np.zeros((3, 4), np.float32))


def test_modulo_argument_errors(grid):
    with pytest.raises(ValueError, match=r"'m1'.*scheme='B/K' .* pass body="):
        ModuloLayer("B/K", name="m1")
    with pytest.raises(ValueError, match=r"`scheme`: scheme='BB'; expected one of"):
        ModuloLayer("BB")
    with pytest.raises(ValueError, match=r"'m2'.*scheme='B' .* pass body="):
        ModuloLayer("B", name="m2")
    with pytest.raises(ValueError, match=r"`input_layout`: input_layout='split'"):
        ModuloInverseLayer(input_layout="split")
