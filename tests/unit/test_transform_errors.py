"""Bad input to tfhybrid.transform: every ValueError names the layer, the
strategy and the fix. Pure planning in one process (the grid is a
ProcessGrid value); the public-API cases go through ``transform`` itself.

Covers s/ds with an empty spatial region (a model without an image part, a
first convolution that cannot be split for the grid, overrides), the
``spatial`` and ``spatial_layers`` options, layers without a rule, group
sizes that do not divide units/filters/channels, overrides that cannot be
honoured, and subclassed models.
"""
import os
import re
import sys

import keras
import pytest

from tfhybrid.process_grid import ProcessGrid
from tfhybrid.compose import transform
from tfhybrid.transformer.graph import as_functional, describe_graph
from tfhybrid.transformer.options import make_options
from tfhybrid.transformer.planner import make_plan

sys.path.insert(0, os.path.dirname(__file__))
from test_transform_planner import cnn


def plan_of(model, strategy, size=4, m=4, **options):
    graph = describe_graph(as_functional(model))
    return make_plan(graph, make_options(strategy, **options), ProcessGrid(size, 0, m))


def mlp():
    i = keras.Input((8, 8, 3))
    x = keras.layers.Flatten(name="flat")(i)
    x = keras.layers.Dense(16, activation="relu", name="fc1")(x)
    return keras.Model(i, keras.layers.Dense(4, name="out")(x), name="mlp")


def conv_first(kernel=3, groups=1, size=8, channels=4):
    i = keras.Input((size, size, channels))
    x = keras.layers.Conv2D(4, kernel, padding="same", groups=groups, name="conv1")(i)
    x = keras.layers.Flatten(name="flat")(x)
    return keras.Model(i, keras.layers.Dense(4, name="out")(x), name="conv_first")


# -- s / ds with nothing spatial ----------------------------------------------------------

@pytest.mark.parametrize("strategy,size,m", [("s", 4, 4), ("ds", 4, 2)])
def test_model_without_an_image_part(strategy, size, m):
    grid = "4x1" if m == 4 else "2x1"
    with pytest.raises(ValueError, match=(
            rf"^Strategy '{strategy}' would split no layer spatially \(spatial='height', a "
            rf"{grid} grid\): layer 'flat' \(Flatten\) comes before any Conv2D and cannot run on "
            r"spatial blocks: a Flatten has no spatial rule .* Every rank would compute the "
            r"whole model on the same rows \(replicated, no speed-up\)\. To fix, use "
            r"strategy='d' \(data parallelism\)\.$")):
        plan_of(mlp(), strategy, size=size, m=m)


def test_dense_model_on_vectors():
    i = keras.Input((6,))
    model = keras.Model(i, keras.layers.Dense(4, name="fc")(i))
    with pytest.raises(ValueError, match=r"layer 'fc' \(Dense\) comes before any Conv2D.*"
                                         r"strategy='d'"):
        plan_of(model, "s")


def test_first_convolution_that_does_not_split_suggests_grids_that_do():
    # 6 rows (and 6 columns) do not split over 4 ranks; a 2x2 grid splits both in two.
    with pytest.raises(ValueError, match=(
            r"Strategy 's' would split no layer spatially \(spatial='height', a 4x1 grid\): "
            r"the first Conv2D, 'conv1', cannot be split: its input 6x6 / output 6x6 \(height "
            r"x width\) do not split over the 4x1 spatial grid: along height, size 6 does not "
            r"split evenly over 4 ranks\. .*To fix, use strategy='d' \(data parallelism\), or "
            r"spatial=\(2, 2\)\.$")):
        plan_of(conv_first(size=6), "s")


def test_halo_larger_than_a_block():
    # 7x7 'same' on 8 rows over 4 ranks: blocks of 2 rows, halo of 3.
    with pytest.raises(ValueError, match=r"'conv1', cannot be split: .*along height, the "
                                         r"blocks of 2 rows are smaller than the halo \(lo=3, "
                                         r"hi=3 rows\).*or spatial=\(2, 2\)\.$"):
        plan_of(conv_first(kernel=7), "s")
    assert plan_of(conv_first(kernel=7), "s", spatial=(2, 2)).node("conv1").kind == "spatial"


def test_grouped_first_convolution():
    with pytest.raises(ValueError, match=r"the first Conv2D, 'conv1', cannot be split: it is a "
                                         r"grouped convolution \(groups=2\).*strategy='d'"):
        plan_of(conv_first(groups=2), "s", size=2, m=2)


def test_fallback_replicate_does_not_hide_an_empty_region():
    with pytest.raises(ValueError, match=r"would split no layer spatially"):
        plan_of(mlp(), "s", fallback="replicate")


def test_overrides_that_replicate_the_whole_region():
    with pytest.raises(ValueError, match=(
            r"Strategy 'ds' would split no layer spatially \(spatial='height', a 2x1 grid\): "
            r"layers= keeps every Conv2D of the spatial region replicated \('conv1', 'conv2'\)"
            r".*To fix, remove those overrides, or use strategy='d'")):
        plan_of(cnn(), "ds", size=4, m=2, layers={"conv1": "replicate", "conv2": "replicate"})
    plan = plan_of(cnn(), "ds", size=4, m=2, layers={"conv1": "replicate"})
    assert plan.node("conv2").kind == "spatial"


def test_empty_region_reaches_the_public_api():
    with pytest.raises(ValueError, match=r"Strategy 's' would split no layer spatially"):
        transform(mlp(), "s")


# -- the spatial options ------------------------------------------------------------------

def test_spatial_layers_beyond_a_convolution_that_does_not_split():
    with pytest.raises(ValueError, match=(
            r"^Layer 'conv2' \(Conv2D\) cannot be split spatially under strategy 's' "
            r"\(spatial='height', a 4x1 grid\): its input 2x2 / output 2x2 \(height x width\) "
            r"do not split over the 4x1 spatial grid: along height, size 2 does not split "
            r"evenly over 4 ranks\. spatial_layers=2 asks for 2 Conv2D layers and it comes "
            r"after number 1 \('conv1'\)\. Use spatial_layers=1 or fewer, or "
            r"spatial=\(2, 2\)\.$")):
        plan_of(cnn(size=4), "s", spatial_layers=2)


def test_spatial_layers_beyond_a_layer_without_spatial_rule():
    i = keras.Input((8, 8, 3))
    x = keras.layers.Conv2D(4, 3, padding="same", name="conv1")(i)
    x = keras.layers.UpSampling2D(interpolation="bicubic", name="up")(x)   # no spatial rule
    x = keras.layers.Conv2D(4, 3, padding="same", name="conv2")(x)
    model = keras.Model(i, keras.layers.Dense(2, name="out")(keras.layers.Flatten()(x)))
    with pytest.raises(ValueError, match=r"^Layer 'up' \(UpSampling2D\) cannot run on spatial "
                                         r"blocks under strategy 's' .*: a UpSampling2D has no "
                                         r"spatial rule .*Use spatial_layers=1 or fewer\.$"):
        plan_of(model, "s", size=2, m=2, spatial_layers=2)
    assert plan_of(model, "s", size=2, m=2).node("conv2").kind == "replicate"


def test_spatial_layers_more_than_the_model_has():
    with pytest.raises(ValueError, match=r"^Layer 'flat' \(Flatten\) cannot run on spatial "
                                         r"blocks under strategy 's' .*it comes after number 2 "
                                         r"\('conv2'\)\. Use spatial_layers=2 or fewer\.$"):
        plan_of(cnn(), "s", size=2, m=2, spatial_layers=3)
    i = keras.Input((8, 8, 3))       # fully convolutional: the model ends after conv2
    x = keras.layers.Conv2D(4, 3, padding="same", name="conv1")(i)
    model = keras.Model(i, keras.layers.Conv2D(2, 3, padding="same", name="conv2")(x))
    with pytest.raises(ValueError, match=r"Received spatial_layers=3 under strategy 's', but "
                                         r"the model has only 2 Conv2D layer\(s\) in its spatial "
                                         r"part \('conv1', 'conv2'\); use spatial_layers=2 or "
                                         r"fewer, or omit spatial_layers\."):
        plan_of(model, "s", size=2, m=2, spatial_layers=3)


def test_spatial_layers_on_a_model_without_an_image_part():
    with pytest.raises(ValueError, match=r"Strategy 's' would split no layer spatially.*"
                                         r"'flat' \(Flatten\)"):
        plan_of(mlp(), "s", spatial_layers=1)


def test_invalid_spatial_options():
    with pytest.raises(ValueError, match=r"invalid value for `spatial`: spatial='depth' for an "
                                         r"image \(4-D input\) model; expected one of "
                                         r"'height', 'width' or a tuple \(ph, pw\)"):
        plan_of(cnn(), "s", spatial="depth")
    with pytest.raises(ValueError, match=r"Received spatial=\(2, 1\) \(2 ranks\) for strategy "
                                         r"'ds' on model groups of 4 ranks.*spatial=\(4, 1\)"):
        plan_of(cnn(), "ds", spatial=(2, 1))
    with pytest.raises(ValueError, match=r"invalid value for `spatial_layers`, expected a "
                                         r"positive integer. Received: spatial_layers=0"):
        make_options("s", spatial_layers=0)
    with pytest.raises(ValueError, match=r"Option spatial='width' does not apply to strategy "
                                         r"'df'.*Remove it or use strategy='s'"):
        make_options("df", spatial="width")


def test_spatial_override_that_does_not_split():
    with pytest.raises(ValueError, match=(
            r"Layer 'conv2' \(Conv2D\) cannot be made spatial-parallel under strategy 's': its "
            r"input 2x2 .* Remove the override layers=\{'conv2': 's'\} or set it to "
            r"'replicate' \(fallback='replicate' does not apply to layers named in layers=\)\.$")):
        plan_of(cnn(size=4), "s", spatial_layers=1, layers={"conv2": "s"}, fallback="replicate")


# -- model-parallel strategies ---------------------------------------------------------------

def test_filters_not_divisible():
    with pytest.raises(ValueError, match=r"Layer 'conv1' \(Conv2D\) cannot be made filter-"
                                         r"parallel under strategy 'df': filters=6 is not "
                                         r"divisible by the model group size 4\. Use fallback="
                                         r"'replicate' \(or layers=\{'conv1': 'replicate'\}\) to "
                                         r"keep it replicated, or use model_parallel=2\.$"):
        plan_of(cnn(filters=6), "df", size=8, m=4)


def test_channels_not_divisible():
    with pytest.raises(ValueError, match=r"Layer 'conv1' \(Conv2D\) cannot be made channel-"
                                         r"parallel under strategy 'c': its 3 input channels are "
                                         r"not divisible by the model group size 4\. Use "
                                         r"fallback='replicate' \(or layers=\{'conv1': "
                                         r"'replicate'\}\) to keep it replicated\.$"):
        plan_of(cnn(), "c")
    with pytest.raises(ValueError, match=r"its 6 input channels are not divisible by the model "
                                         r"group size 4\..* or run on 2 ranks\.$"):
        plan_of(conv_first(channels=6), "c")


def test_units_not_divisible_under_f_suggests_df():
    with pytest.raises(ValueError, match=r"'out' \(Dense\) cannot be made filter-parallel under "
                                         r"strategy 'f': units=6 .*or run on 2 ranks \(or "
                                         r"strategy='df' with model_parallel=2\)\.$"):
        plan_of(cnn(classes=6, units=12), "f")


def test_filter_override_that_does_not_divide():
    with pytest.raises(ValueError, match=r"'out' \(Dense\) cannot be made filter-parallel under "
                                         r"strategy 'gmp': units=6 .*Remove the override "
                                         r"layers=\{'out': 'f'\} or set it to 'replicate' .*, or "
                                         r"use mp=2\.$"):
        plan_of(cnn(classes=6), "gmp", layers={"out": "f"}, fallback="replicate")


def test_grouped_convolution_under_df_has_no_group_size_hint():
    with pytest.raises(ValueError, match=r"'conv1' \(Conv2D\) cannot be made filter-parallel "
                                         r"under strategy 'df': it is a grouped convolution "
                                         r"\(groups=2\)\. Use fallback='replicate' \(or "
                                         r"layers=\{'conv1': 'replicate'\}\) to keep it "
                                         r"replicated\.$"):
        plan_of(conv_first(groups=2), "df", size=4, m=2)


@pytest.mark.parametrize("strategy,size,m", [("f", 4, 4), ("df", 4, 2), ("c", 4, 4)])
def test_weighted_layer_without_a_rule(strategy, size, m):
    i = keras.Input((8, 8, 4))
    x = keras.layers.DepthwiseConv2D(3, name="dw")(i)
    model = keras.Model(i, keras.layers.Dense(4, name="d")(keras.layers.Flatten()(x)))
    with pytest.raises(ValueError, match=(
            rf"^Layer 'dw' \(DepthwiseConv2D\) has weights but tfhybrid has no rule to "
            rf"partition a DepthwiseConv2D under strategy '{strategy}'\. Use fallback="
            r"'replicate' or layers=\{'dw': 'replicate'\} to keep it replicated\.$")):
        plan_of(model, strategy, size=size, m=m)


def test_unknown_strategy_and_options_reach_the_public_api():
    from tfhybrid.strategy_names import TRANSFORM_NAMES
    with pytest.raises(ValueError, match=r"unknown strategy: strategy='zz'; expected one of "
                                         + re.escape(str(TRANSFORM_NAMES))):
        transform(cnn(), "zz")
    with pytest.raises(ValueError, match=r"Option ccr_threshold=10 does not apply to strategy "
                                         r"'s'.*'gmp'.*Remove it or use strategy='gmp'"):
        transform(cnn(), "s", ccr_threshold=10)


def test_subclassed_model_reaches_the_public_api():
    class Net(keras.Model):
        def __init__(self):
            super().__init__(name="net")
            self.d = keras.layers.Dense(4)

        def call(self, x):
            return self.d(x)

    net = Net()
    net(keras.ops.zeros((1, 3)))
    with pytest.raises(ValueError, match=r"Received a subclassed model 'net' \(Net\); "
                                         r"tfhybrid.transform reads .* functional API"):
        transform(net, "df")
