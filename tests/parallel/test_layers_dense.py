"""FilterParallelDense / ChannelParallelDense against keras.layers.Dense.

Run under ``horovodrun -np 2`` and ``-np 4`` (model_parallel 1, 2, 4).
Every rank builds the reference Dense from seeded weights and computes its
output and gradients on the full data; the parallel layer, converted with
``from_layer``, must match in every input/output layout, eagerly and in a
``tf.function``.
"""
import keras
import numpy as np
import pytest
import tensorflow as tf

from tfhybrid.layers import ChannelParallelDense, FilterParallelDense
from tfhybrid.layout import layout_of

from conftest import model_parallel_values, randn
from layers_testing import (FWD, GRAD, block, check_save_load, compare_partitioned,
                            count_horovod_ops, rank_path, value_and_grads)

MPS = model_parallel_values()
MODES = ["eager", "function"]
IN_DIM, UNITS, BATCH = 8, 12, 6
FILTER_CASES = [(i, o) for i in ("replicated", "replicated_partial_grad")
                for o in ("replicated", "replicated_partial_grad", "split")]
CHANNEL_CASES = [(i, o) for i in ("replicated", "replicated_partial_grad", "split")
                 for o in ("replicated", "partial")]


@pytest.fixture(params=MPS, ids=lambda m: f"mp{m}")
def grid(request, grid_of):
    return grid_of(request.param)


def dense(units, in_dim, *key, activation=None, use_bias=True):
    layer = keras.layers.Dense(units, activation=activation, use_bias=use_bias,
                               name=f"d{units}")
    layer.build((None, in_dim))
    weights = [randn((in_dim, units), "k", units, *key)]
    weights += [randn((units,), "b", units, *key)] if use_bias else []
    layer.set_weights(weights)
    return layer


compare = compare_partitioned


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("in_layout,out_layout", FILTER_CASES)
def test_filter_dense_matches_dense(grid, in_layout, out_layout, mode):
    x, u = randn((BATCH, IN_DIM), "x"), randn((BATCH, UNITS), "u")
    compare(FilterParallelDense, dense(UNITS, IN_DIM, "f"), in_layout, out_layout, mode, x, u)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("in_layout,out_layout", CHANNEL_CASES)
def test_channel_dense_matches_dense(grid, in_layout, out_layout, mode):
    x, u = randn((BATCH, IN_DIM), "x"), randn((BATCH, UNITS), "u")
    compare(ChannelParallelDense, dense(UNITS, IN_DIM, "c"), in_layout, out_layout, mode, x, u)


@pytest.mark.parametrize("cls", [FilterParallelDense, ChannelParallelDense])
@pytest.mark.parametrize("activation,use_bias", [("relu", True), ("tanh", False),
                                                 ("softmax", True), (None, False)])
def test_activation_and_bias(grid, cls, activation, use_bias):
    ref = dense(UNITS, IN_DIM, "act", activation=activation, use_bias=use_bias)
    x, u = randn((BATCH, 3, IN_DIM), "x3"), randn((BATCH, 3, UNITS), "u3")   # rank-3 input
    compare(cls, ref, "replicated", "replicated", "function", x, u)


def test_weight_layouts(grid):
    f = FilterParallelDense.from_layer(dense(UNITS, IN_DIM, "l"))
    c = ChannelParallelDense.from_layer(dense(UNITS, IN_DIM, "l"), output_layout="partial")
    k = grid.model_size
    assert f.kernel.shape == (IN_DIM, UNITS // k) and f.bias.shape == (UNITS // k,)
    assert c.kernel.shape == (IN_DIM // k, UNITS) and c.bias.shape == (UNITS,)
    assert (layout_of(f.kernel).kind, layout_of(f.kernel).axis) == ("sharded", -1)
    assert (layout_of(f.bias).kind, layout_of(f.bias).axis) == ("sharded", -1)
    assert (layout_of(c.kernel).kind, layout_of(c.kernel).axis) == ("sharded", -2)
    assert layout_of(c.bias).kind == "partial"
    c2 = ChannelParallelDense.from_layer(dense(UNITS, IN_DIM, "l"))
    assert layout_of(c2.bias).kind == "replicated"


def stack_reference():
    layers = [dense(16, 8, "s1", activation="relu"), dense(12, 16, "s2", activation="relu"),
              dense(8, 12, "s3", activation="tanh"), dense(4, 8, "s4")]
    return keras.Sequential([keras.Input((8,))] + layers), layers


def stack_parallel(layers):
    return keras.Sequential([
        keras.Input((8,)),
        FilterParallelDense.from_layer(layers[0], output_layout="split"),
        ChannelParallelDense.from_layer(layers[1], input_layout="split"),
        FilterParallelDense.from_layer(layers[2]),
        layers[3]])                                  # a plain replicated Dense


@pytest.mark.parametrize("mode", MODES)
def test_stack_f_c_f_dense(grid, mode):
    ref, layers = stack_reference()
    x, u = randn((BATCH, 8), "sx"), randn((BATCH, 4), "su")
    y_ref, dx_ref, _ = value_and_grads(lambda t: (ref(t), tf.reduce_sum(ref(t) * u)),
                                       [], x, "eager")
    ref_grads = value_and_grads(lambda t: (ref(t), tf.reduce_sum(ref(t) * u)),
                                ref.trainable_weights, x, "eager")[2]
    par = stack_parallel(layers)
    y, dx, dw = value_and_grads(lambda t: (par(t), tf.reduce_sum(par(t) * u)),
                                par.trainable_weights, x, mode)
    np.testing.assert_allclose(y, y_ref, **FWD)
    np.testing.assert_allclose(dx, dx_ref, **GRAD)
    g = grid.group("model")
    for v, gr, full in zip(par.trainable_weights, dw, ref_grads):
        lay = layout_of(v)
        want = block(full, lay.axis, g) if lay.kind == "sharded" and g.size > 1 else full
        np.testing.assert_allclose(gr, want, err_msg=v.path, **GRAD)


@pytest.mark.parametrize("input_grad", [False, True])
def test_filter_channel_pair_collective_count(grid, input_grad):
    """f(split) -> c(split): one allreduce forward; one more backward only for dx."""
    _, layers = stack_reference()
    f = FilterParallelDense.from_layer(layers[0], output_layout="split")
    c = ChannelParallelDense.from_layer(layers[1], input_layout="split")
    x = tf.constant(randn((BATCH, 8), "cx"))

    @tf.function
    def train_step(x):
        with tf.GradientTape() as tape:
            if input_grad:
                tape.watch(x)
            loss = tf.reduce_sum(c(f(x)))
        sources = [x] if input_grad else []
        return tape.gradient(loss, sources + f.trainable_weights + c.trainable_weights)

    concrete = train_step.get_concrete_function(x)
    train_step(x)                                  # the collectives run
    allreduces = (1 + int(input_grad)) if grid.model_size > 1 else 0
    expect = {"HorovodAllreduce": allreduces} if allreduces else {}
    assert count_horovod_ops(concrete) == expect


def test_to_layer_gathers_full_weights(grid):
    ref = dense(UNITS, IN_DIM, "to")
    for cls, kw in [(FilterParallelDense, {}), (ChannelParallelDense, {"input_layout": "split"})]:
        plain = cls.from_layer(ref, **kw).to_layer()
        assert type(plain) is keras.layers.Dense and plain.name == ref.name
        assert plain.get_config() == ref.get_config()
        for a, b in zip(plain.get_weights(), ref.get_weights()):
            np.testing.assert_array_equal(a, b)


def test_config_round_trip(grid):
    for layer in [FilterParallelDense(UNITS, activation="relu", output_layout="split"),
                  ChannelParallelDense(UNITS, use_bias=False, input_layout="split",
                                       output_layout="partial")]:
        clone = type(layer).from_config(layer.get_config())
        assert clone.get_config() == layer.get_config()


def test_save_load_round_trip(grid, tmp_path):
    _, layers = stack_reference()
    model = stack_parallel(layers)
    x = randn((BATCH, 8), "save")
    check_save_load(model, x, rank_path(tmp_path, "dense"))


# -- errors ---------------------------------------------------------------------

def test_units_not_divisible(grid_of):
    grid_of(2)
    with pytest.raises(ValueError, match=r"'fp': units=7 is not divisible by the 2 ranks of the 'model' group"):
        FilterParallelDense(7, name="fp")


def test_input_features_not_divisible(grid_of):
    grid_of(2)
    layer = ChannelParallelDense(4, name="cp")
    with pytest.raises(ValueError, match=r"'cp': input channels=5 is not divisible by .* 2"):
        layer.build((None, 5))


def test_from_layer_errors(grid):
    unbuilt = keras.layers.Dense(4, name="raw")
    with pytest.raises(ValueError, match=r"layer 'raw' is not built"):
        FilterParallelDense.from_layer(unbuilt)
    with pytest.raises(TypeError, match=r"expects a keras.layers.Dense; received Conv2D"):
        ChannelParallelDense.from_layer(keras.layers.Conv2D(4, 3))


def test_layout_and_activation_errors(grid):
    with pytest.raises(ValueError, match=r"`output_layout`: output_layout='partial'"):
        FilterParallelDense(8, output_layout="partial")
    with pytest.raises(ValueError, match=r"activation='softmax' mixes the channel axis"):
        FilterParallelDense(8, activation="softmax", output_layout="split")
    with pytest.raises(ValueError, match=r"output_layout='partial' .* activation='relu'"):
        ChannelParallelDense(8, activation="relu", output_layout="partial")
    with pytest.raises(ValueError, match=r"`units`.*Received: units=0"):
        FilterParallelDense(0)
