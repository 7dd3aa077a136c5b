"""FilterParallelConv2D / ChannelParallelConv2D against keras.layers.Conv2D.

Run under ``horovodrun -np 2`` and ``-np 4`` (model_parallel 1, 2, 4): the
reference Conv2D is built on every rank from seeded weights; paddings,
strides, dilation, activation, bias on/off and every input/output layout.
"""
import keras
import pytest

from tfhybrid.layers import ChannelParallelConv2D, FilterParallelConv2D

from conftest import model_parallel_values, randn
from layers_testing import (check_conv_stack, check_conv_to_layer, check_save_load,
                            compare_conv, conv_config_id as config_id, conv_of_config, rank_path,
                            seeded_conv)

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


def conv(filters, in_ch, *key, kernel_size=3, padding="same", **options):
    return seeded_conv(keras.layers.Conv2D, filters, in_ch, *key, kernel_size=kernel_size,
                       padding=padding, **options)


@pytest.mark.parametrize("mode", ["eager", "function"])
@pytest.mark.parametrize("cls", [FilterParallelConv2D, ChannelParallelConv2D],
                         ids=["filter", "channel"])
@pytest.mark.parametrize("config", CONFIGS, ids=config_id)
def test_conv_matches_conv2d(grid, config, cls, mode):
    ref = conv_of_config(keras.layers.Conv2D, FILTERS, IN_SHAPE[-1], config)
    compare_conv(cls, ref, IN_SHAPE, "replicated", "replicated", mode)


@pytest.mark.parametrize("in_layout,out_layout", FILTER_LAYOUTS)
def test_filter_conv_layouts(grid, in_layout, out_layout):
    ref = conv(FILTERS, IN_SHAPE[-1], "fl", strides=2, activation="relu")
    compare_conv(FilterParallelConv2D, ref, IN_SHAPE, in_layout, out_layout, "function")


@pytest.mark.parametrize("in_layout,out_layout", CHANNEL_LAYOUTS)
def test_channel_conv_layouts(grid, in_layout, out_layout):
    ref = conv(FILTERS, IN_SHAPE[-1], "cl", padding="valid")
    compare_conv(ChannelParallelConv2D, ref, IN_SHAPE, in_layout, out_layout, "function")


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
    """f(split) -> c(split): values, gradients; in a train step one allreduce
    forward, one for dx."""
    layers = stack_layers()
    ref = keras.Sequential([keras.Input(IN_SHAPE[1:])] + layers)
    check_conv_stack(ref, stack_parallel(layers), randn(IN_SHAPE, "sx"),
                     randn((2, 4, 4, 6), "su"), grid.group("model"), mode)


def test_to_layer_and_config(grid):
    ref = conv(FILTERS, IN_SHAPE[-1], "to", kernel_size=(3, 1), strides=2, dilation_rate=1)
    check_conv_to_layer(ref, [(FilterParallelConv2D, {}),
                              (ChannelParallelConv2D, {"input_layout": "split"})])


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
