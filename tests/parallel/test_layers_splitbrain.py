"""ShardLayer, ModuloLayer ("BK", "B/K") and ModuloInverseLayer under horovodrun.

The boundary layers alone against numpy, then a SplitBrain-style network
(conv data-parallel over all ranks -> ModuloLayer -> filter/channel-parallel
Dense, a plain Dense, ShardLayer -> inverse -> loss) against single-process
training of the same Keras model on the global batch: each rank computes
the gradient of its own rows' mean loss, the gradients are reduced by the
variable layouts (world average / data-group average / group sum, times
grad_scale), and must equal the single-process gradient of the mean loss
over the global batch; then a few SGD steps.
"""
import keras
import numpy as np
import pytest
import tensorflow as tf

from tfhybrid.comm import backend
from tfhybrid.layers import (ChannelParallelDense, FilterParallelDense, ModuloInverseLayer,
                             ModuloLayer, ShardLayer)
from tfhybrid.layout import layout_of

from conftest import model_parallel_values, randn, rng
from layers_testing import FWD, GRAD, block, expected, rank_path, value_and_grads

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


# -- a SplitBrain network against single-process training --------------------------

def seeded(layer, shape, key):
    layer.build(shape)
    layer.set_weights([randn(w.shape, key, i) * 0.5 for i, w in enumerate(layer.weights)])
    return layer


def reference_layers():
    return [seeded(keras.layers.Conv2D(4, 3, activation="relu", name="conv"), (None,) + IMG, "c"),
            seeded(keras.layers.Dense(16, activation="relu", name="fc16"), (None, 64), "d16"),
            seeded(keras.layers.Dense(12, activation="relu", name="fc12"), (None, 16), "d12"),
            seeded(keras.layers.Dense(8, activation="tanh", name="fc8a"), (None, 12), "d8a"),
            seeded(keras.layers.Dense(8, activation="relu", name="fc8"), (None, 8), "d8"),
            seeded(keras.layers.Dense(CLASSES, name="logits"), (None, 8), "d8out")]


def clone(layer):
    new = type(layer).from_config(layer.get_config())
    new.build(layer._build_shapes_dict["input_shape"])
    new.set_weights(layer.get_weights())
    return new


def reference_model():
    conv, *fcs = reference_layers()
    return keras.Sequential([keras.Input(IMG), conv, keras.layers.Flatten()] + fcs)


def splitbrain_model(scheme, entry, exit_):
    """conv -> Flatten -> Modulo -> f(16) -> c(12) -> Dense(8) -> f(8) [-> Shard] -> f(8) -> inverse."""
    conv, d16, d12, d8a, d8, d5 = reference_layers()
    region = [
        FilterParallelDense.from_layer(d16, input_layout=PG if entry == PG else R,
                                       output_layout="split"),
        ChannelParallelDense.from_layer(d12, input_layout="split"),
        clone(d8a),                                          # a plain replicated Dense
    ]
    if exit_ == "shard":      # f(split) -> Shard -> f(partial grad, split) -> Shard -> inverse(P)
        region += [FilterParallelDense.from_layer(d8, output_layout="split"), ShardLayer(),
                   FilterParallelDense.from_layer(d5, input_layout=PG, output_layout="split"),
                   ShardLayer()]
        inverse_in = PG
    else:                     # f -> f(gather) -> inverse(R)
        region += [FilterParallelDense.from_layer(d8),
                   FilterParallelDense.from_layer(d5, output_layout=R)]
        inverse_in = R
    head = [keras.Input(IMG), clone(conv), keras.layers.Flatten()]
    if scheme == "BK":
        tail = [ModuloLayer("BK", output_layout=entry)] + region + \
            [ModuloInverseLayer(input_layout=inverse_in)]
    else:
        tail = [ModuloLayer("B/K", body=keras.Sequential(region), output_layout=entry,
                            inverse_input_layout=inverse_in)]
    return keras.Sequential(head + tail)


def global_batch(grid, step):
    x = randn((grid.size * B,) + IMG, "gx", step)
    y = rng("gy", step).integers(0, CLASSES, grid.size * B).astype(np.int32)
    return x, y


LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def grad_step(model, mode):
    """``step(x, y) -> (loss, grads)`` of the mean loss, traced once for tf.function."""
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = LOSS(y, model(x, training=True))
        return loss, tape.gradient(loss, model.trainable_weights)
    if mode == "function":
        step = tf.function(step)

    def run(x, y):
        loss, grads = step(tf.constant(x), tf.constant(y))
        return float(loss), [g.numpy() for g in grads]
    return run


def reduce_by_layout(variables, grads, grid):
    """The optimizer's rule, written out: sum over ranks, times a factor, times grad_scale."""
    out = []
    for i, (v, gr) in enumerate(zip(variables, grads)):
        lay = layout_of(v)
        if lay.kind == "sharded":
            ranks, factor = grid.group("data").ranks, 1.0 / grid.data_size
        elif lay.kind == "partial":
            ranks, factor = tuple(range(grid.size)), grid.model_size / grid.size
        else:
            ranks, factor = tuple(range(grid.size)), 1.0 / grid.size
        if len(ranks) > 1:
            gr = backend.allreduce(tf.constant(gr), ranks, f"test.reduce{i}").numpy()
        out.append(gr * factor * lay.grad_scale)
    return out


def world_mean(value, grid):
    if grid.size == 1:
        return value
    return float(backend.allreduce(tf.constant(value), tuple(range(grid.size)), "test.loss")
                 ) / grid.size


def check_grads(variables, grads, ref_grads, g):
    for v, gr, full in zip(variables, grads, ref_grads):
        np.testing.assert_allclose(gr, expected(v, full, g), err_msg=v.path, **GRAD)


CASES = [("BK", PG, "gather", "function"), ("BK", R, "shard", "function"),
         ("B/K", PG, "shard", "function"), ("B/K", R, "gather", "function"),
         ("BK", PG, "gather", "eager"), ("B/K", PG, "gather", "eager")]


@pytest.mark.parametrize("scheme,entry,exit_,mode", CASES)
def test_splitbrain_training_equals_single_process(grid, scheme, entry, exit_, mode):
    ref, par = reference_model(), splitbrain_model(scheme, entry, exit_)
    g, own = grid.group("model"), slice(grid.rank * B, (grid.rank + 1) * B)
    assert all(layout_of(v).grad_scale == 1.0 for v in par.trainable_weights)
    ref_step, par_step = grad_step(ref, "eager"), grad_step(par, mode)
    for step in range(3):
        x, y = global_batch(grid, step)
        ref_loss, ref_grads = ref_step(x, y)
        loss, grads = par_step(x[own], y[own])
        np.testing.assert_allclose(world_mean(loss, grid), ref_loss, **FWD)
        reduced = reduce_by_layout(par.trainable_weights, grads, grid)
        check_grads(par.trainable_weights, reduced, ref_grads, g)
        for v, gr in zip(ref.trainable_weights, ref_grads):
            v.assign_sub(LR * gr)
        for v, gr in zip(par.trainable_weights, reduced):
            v.assign_sub(LR * gr)
    for v, w in zip(par.trainable_weights, ref.trainable_weights):
        np.testing.assert_allclose(v.numpy(), expected(v, w.numpy(), g), err_msg=v.path, **GRAD)


def test_splitbrain_with_distributed_optimizer(grid):
    tfhybrid_opt = pytest.importorskip("tfhybrid.optimizer")
    ref, par = reference_model(), splitbrain_model("BK", PG, "shard")
    opt = tfhybrid_opt.DistributedOptimizer(keras.optimizers.SGD(LR))
    ref_opt = keras.optimizers.SGD(LR)
    own = slice(grid.rank * B, (grid.rank + 1) * B)
    ref_step, par_step = grad_step(ref, "eager"), grad_step(par, "function")
    for step in range(2):
        x, y = global_batch(grid, step)
        _, ref_grads = ref_step(x, y)
        _, grads = par_step(x[own], y[own])
        ref_opt.apply(ref_grads, ref.trainable_weights)
        opt.apply(grads, par.trainable_weights)
    g = grid.group("model")
    for v, w in zip(par.trainable_weights, ref.trainable_weights):
        np.testing.assert_allclose(v.numpy(), expected(v, w.numpy(), g), err_msg=v.path, **GRAD)


@pytest.mark.parametrize("scheme,exit_", [("BK", "gather"), ("BK", "shard"),
                                           ("B/K", "gather"), ("B/K", "shard")])
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


@pytest.mark.parametrize("scheme", ["BK", "B/K"])
def test_splitbrain_model_fit_with_distributed_optimizer(grid, scheme):
    """model.fit on own rows + DistributedOptimizer == SGD on the global batches."""
    tfhybrid_opt = pytest.importorskip("tfhybrid.optimizer")
    ref, par = reference_model(), splitbrain_model(scheme, PG, "gather")
    ref_step = grad_step(ref, "eager")
    batches = [global_batch(grid, step) for step in range(2)]
    for x, y in batches:
        for v, gr in zip(ref.trainable_weights, ref_step(x, y)[1]):
            v.assign_sub(LR * gr)
    own = slice(grid.rank * B, (grid.rank + 1) * B)
    par.compile(optimizer=tfhybrid_opt.DistributedOptimizer(keras.optimizers.SGD(LR)),
                loss=LOSS, jit_compile=False)
    par.fit(np.concatenate([x[own] for x, _ in batches]),
            np.concatenate([y[own] for _, y in batches]),
            batch_size=B, epochs=1, shuffle=False, verbose=0)
    g = grid.group("model")
    for v, w in zip(par.trainable_weights, ref.trainable_weights):
        np.testing.assert_allclose(v.numpy(), expected(v, w.numpy(), g), err_msg=v.path, **GRAD)


def test_save_load_round_trip(grid, tmp_path):
    for scheme in ("BK", "B/K"):
        model = splitbrain_model(scheme, PG, "shard")
        x = randn((B,) + IMG, "save", grid.rank)
        path = rank_path(tmp_path, f"splitbrain_{scheme.replace('/', '')}")
        model.save(path)
        loaded = keras.models.load_model(path)
        assert [type(a) for a in loaded.layers] == [type(b) for b in model.layers]
        for a, b in zip(loaded.weights, model.weights):
            np.testing.assert_array_equal(a.numpy(), b.numpy())
            assert layout_of(a) == layout_of(b)
        np.testing.assert_allclose(loaded(x), model(x), **FWD)


# -- errors ---------------------------------------------------------------------

def test_b_over_k_batch_not_divisible(grid_of):
    grid_of(2)
    layer = ModuloLayer("B/K", body=keras.layers.Dense(3), name="mod")
    with pytest.raises(ValueError, match=r"'mod': scheme='B/K' needs a local batch divisible "
                                         r"by the group size; received batch 3 for K=2"):
        layer(np.zeros((3, 4), np.float32))


def test_modulo_argument_errors(grid):
    with pytest.raises(ValueError, match=r"'m1'.*scheme='B/K' .* pass body="):
        ModuloLayer("B/K", name="m1")
    with pytest.raises(ValueError, match=r"`scheme`: scheme='B'; expected one of"):
        ModuloLayer("B")
    with pytest.raises(ValueError, match=r"`input_layout`: input_layout='split'"):
        ModuloInverseLayer(input_layout="split")
