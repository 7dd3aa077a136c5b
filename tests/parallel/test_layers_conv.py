"""FilterParallelConv2D / ChannelParallelConv2D against keras.layers.Conv2D.

Run under ``horovodrun -np 2`` and ``-np 4`` (model_parallel 1, 2, 4): the
reference Conv2D is built on every rank from seeded weights; paddings,
strides, dilation, activation, bias on/off and every input/output layout.
"""
import keras
import numpy as np
import pytest
import tensorflow as tf

from tfhybrid.layers import ChannelParallelConv2D, FilterParallelConv2D
from tfhybrid.layout import layout_of

from conftest import model_parallel_values, randn
from layers_testing import (FWD, GRAD, block, check_save_load, compare_partitioned, value_and_grads,
                            count_horovod_ops, rank_path)

MPS = model_parallel_values()
IN_SHAPE = (2, 9, 9, 4)
FILTERS = 8
# (kernel_size, strides, padding, dilation_rate, activation, use_bias)
CONFIGS = [
    (3, 1, "same", 1, None, True),
    (3, 2, "valid", 1, "relu", True),
    (3, 1, "valid", 2, "tanh", False),
    (1, 1, "valid", 1, None, False),
    ((5, 3), (2, 1), "same", 1, "relu", True),
    (3, 1, "same", (2, 1), "softmax", True),
]
FILTER_LAYOUTS = [("replicated_partial_grad", "replicated_partial_grad"),
                  ("replicated", "split")]
CHANNEL_LAYOUTS = [("replicated_partial_grad", "replicated"), ("split", "partial")]


@pytest.fixture(params=MPS, ids=lambda m: f"mp{m}")
def grid(request, grid_of):
    return grid_of(request.param)


def conv(filters, in_ch, *key, kernel_size=3, strides=1, padding="same", dilation_rate=1,
         activation=None, use_bias=True):
    layer = keras.layers.Conv2D(filters, kernel_size, strides=strides, padding=padding,
                                dilation_rate=dilation_rate, activation=activation,
                                use_bias=use_bias, name=f"conv{filters}")
    layer.build((None, None, None, in_ch))
    layer.set_weights([randn(w.shape, "w", i, *key) for i, w in enumerate(layer.weights)])
    return layer


def compare(cls, ref, in_layout, out_layout, mode):
    u = randn(ref.compute_output_shape(IN_SHAPE), "u", ref.name)
    compare_partitioned(cls, ref, in_layout, out_layout, mode, randn(IN_SHAPE, "x"), u)


def config_id(c):
    return "k{}-s{}-{}-d{}-{}-{}".format(*c).replace(" ", "")


@pytest.mark.parametrize("mode", ["eager", "function"])
@pytest.mark.parametrize("cls", [FilterParallelConv2D, ChannelParallelConv2D],
                         ids=["filter", "channel"])
@pytest.mark.parametrize("config", CONFIGS, ids=config_id)
def test_conv_matches_conv2d(grid, config, cls, mode):
    ks, st, pad, dil, act, bias = config
    ref = conv(FILTERS, IN_SHAPE[-1], "cfg", config_id(config), kernel_size=ks, strides=st,
               padding=pad, dilation_rate=dil, activation=act, use_bias=bias)
    compare(cls, ref, "replicated", "replicated", mode)


@pytest.mark.parametrize("in_layout,out_layout", FILTER_LAYOUTS)
def test_filter_conv_layouts(grid, in_layout, out_layout):
    ref = conv(FILTERS, IN_SHAPE[-1], "fl", strides=2, activation="relu")
    compare(FilterParallelConv2D, ref, in_layout, out_layout, "function")


@pytest.mark.parametrize("in_layout,out_layout", CHANNEL_LAYOUTS)
def test_channel_conv_layouts(grid, in_layout, out_layout):
    ref = conv(FILTERS, IN_SHAPE[-1], "cl", padding="valid")
    compare(ChannelParallelConv2D, ref, in_layout, out_layout, "function")


def stack_layers():
    return [conv(8, 4, "s1", activation="relu"),
            conv(6, 8, "s2", padding="valid", strides=2, activation="relu")]


def stack_parallel(layers):
    return keras.Sequential([
        keras.Input(IN_SHAPE[1:]),
        FilterParallelConv2D.from_layer(layers[0], output_layout="split"),
        ChannelParallelConv2D.from_layer(layers[1], input_layout="split")])


@pytest.mark.parametrize("mode", ["eager", "function"])
def test_stack_filter_then_channel(grid, mode):
    layers = stack_layers()
    ref = keras.Sequential([keras.Input(IN_SHAPE[1:])] + layers)
    x, u = randn(IN_SHAPE, "sx"), randn((2, 4, 4, 6), "su")

    def loss_of(model):
        return lambda t: (model(t), tf.reduce_sum(model(t) * u))

    y_ref, dx_ref, dw_ref = value_and_grads(loss_of(ref), ref.trainable_weights, x, "eager")
    par = stack_parallel(layers)
    y, dx, dw = value_and_grads(loss_of(par), par.trainable_weights, x, mode)
    np.testing.assert_allclose(y, y_ref, **FWD)
    np.testing.assert_allclose(dx, dx_ref, **GRAD)
    g = grid.group("model")
    for v, gr, full in zip(par.trainable_weights, dw, dw_ref):
        lay = layout_of(v)
        want = block(full, lay.axis, g) if lay.kind == "sharded" and g.size > 1 else full
        np.testing.assert_allclose(gr, want, err_msg=v.path, **GRAD)


def test_conv_pair_collective_count(grid):
    """f(split) -> c(split) in a train step: one allreduce forward, one for dx."""
    par = stack_parallel(stack_layers())
    x = tf.constant(randn(IN_SHAPE, "cx"))

    @tf.function
    def train_step(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            loss = tf.reduce_sum(par(x))
        return tape.gradient(loss, [x] + par.trainable_weights)

    concrete = train_step.get_concrete_function(x)
    train_step(x)
    expect = {"HorovodAllreduce": 2} if grid.model_size > 1 else {}
    assert count_horovod_ops(concrete) == expect


def test_to_layer_and_config(grid):
    ref = conv(FILTERS, IN_SHAPE[-1], "to", kernel_size=(3, 1), strides=2, dilation_rate=1)
    for cls, kw in [(FilterParallelConv2D, {}), (ChannelParallelConv2D, {"input_layout": "split"})]:
        layer = cls.from_layer(ref, **kw)
        assert type(layer).from_config(layer.get_config()).get_config() == layer.get_config()
        plain = layer.to_layer()
        assert type(plain) is keras.layers.Conv2D
        assert plain.get_config() == ref.get_config()
        for a, b in zip(plain.get_weights(), ref.get_weights()):
            np.testing.assert_array_equal(a, b)


def test_save_load_round_trip(grid, tmp_path):
    model = stack_parallel(stack_layers())
    x = randn(IN_SHAPE, "save")
    check_save_load(model, x, rank_path(tmp_path, "conv"))


# -- errors ---------------------------------------------------------------------

def test_filters_not_divisible(grid_of):
    grid_of(2)
    with pytest.raises(ValueError, match=r"'fc': filters=5 is not divisible by the 2 ranks of the 'model' group"):
        FilterParallelConv2D(5, 3, name="fc")


def test_input_channels_not_divisible(grid_of):
    grid_of(2)
    layer = ChannelParallelConv2D(4, 3, name="cc")
    with pytest.raises(ValueError, match=r"'cc': input channels=3 is not divisible by .* 2"):
        layer.build((None, 8, 8, 3))


def test_conv_argument_errors(grid):
    with pytest.raises(ValueError, match=r"data_format='channels_first'.*channels_last"):
        FilterParallelConv2D(4, 3, data_format="channels_first")
    with pytest.raises(ValueError, match=r"padding='causal'"):
        ChannelParallelConv2D(4, 3, padding="causal")
    grouped = keras.layers.Conv2D(4, 3, groups=2, name="grouped")
    grouped.build((None, 8, 8, 4))
    with pytest.raises(ValueError, match=r"'grouped' has groups=2"):
        FilterParallelConv2D.from_layer(grouped)
    with pytest.raises(ValueError, match=r"layer 'raw' is not built"):
        ChannelParallelConv2D.from_layer(keras.layers.Conv2D(4, 3, name="raw"))
