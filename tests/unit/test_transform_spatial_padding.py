"""ZeroPadding2D under spatial strategies (pure Python: geometry and planner).

A ZeroPadding2D that only feeds a ``valid`` Conv2D or pooling folds into that
layer (``border_padding``: zeros at the global border, the unpadded tensor is
split; ResNet-50's ``conv1_pad`` and ``pool1_pad``). Another ZeroPadding2D on a
space-split tensor becomes SpatialZeroPadding2D when the padded sizes still
split evenly (re-blocking within one neighbour block). Single process; the
grid is a ProcessGrid value.
"""
import functools

import keras
import pytest

from tfhybrid.process_grid import ProcessGrid
from tfhybrid.spatial_geometry import AxisGeometry, AxisPlan, window_output
from tfhybrid.transformer import rules
from tfhybrid.transformer.graph import as_functional, describe_graph
from tfhybrid.transformer.options import make_options
from tfhybrid.transformer.planner import make_plan


def stem(size=32, pad=3, pool_pad=1):
    """ResNet-50's stem: pad -> 7x7/2 valid conv -> BN -> ReLU -> pad -> 3x3/2 max pool."""
    i = keras.Input((size, size, 3))
    x = keras.layers.ZeroPadding2D(pad, name="conv1_pad")(i)
    x = keras.layers.Conv2D(8, 7, strides=2, name="conv1_conv")(x)
    x = keras.layers.BatchNormalization(name="conv1_bn")(x)
    x = keras.layers.ReLU(name="conv1_relu")(x)
    x = keras.layers.ZeroPadding2D(pool_pad, name="pool1_pad")(x)
    x = keras.layers.MaxPooling2D(3, strides=2, name="pool1_pool")(x)
    x = keras.layers.Conv2D(8, 3, padding="same", name="conv2")(x)
    x = keras.layers.GlobalAveragePooling2D(name="gap")(x)
    x = keras.layers.Dense(4, activation="softmax", name="out")(x)
    return keras.Model(i, x, name="stem")


def plan_of(model, strategy, size=2, m=2, **options):
    graph = describe_graph(as_functional(model))
    return make_plan(graph, make_options(strategy, **options), ProcessGrid(size, 0, m))


@pytest.mark.parametrize("size,lo,hi", [(32, 3, 3), (16, 1, 1), (8, 0, 2), (8, 2, 0)])
def test_explicit_padding_output_size(size, lo, hi):
    out, before = window_output(size, 1, 1, (lo, hi))
    assert (out, before) == (size + lo + hi, lo)
    assert window_output(size + lo + hi, 7, 2, "valid")[0] == window_output(size, 7, 2,
                                                                           (lo, hi))[0] \
        if (lo, hi) == (3, 3) else True


def test_symmetric_padding_over_two_ranks_pads_only_the_border():
    geom = AxisGeometry(32, 2, 1, 1, (3, 3))
    assert geom.problem() is None and geom.exchange() == (0, 0)
    first, last = AxisPlan(geom, 0), AxisPlan(geom, 1)
    assert first.pads() == (3, 0) and last.pads() == (0, 3)
    assert first.take(True) == (0, 0) and last.take(True) == (0, 0)


def test_padding_that_shifts_block_boundaries_moves_rows_between_neighbours():
    geom = AxisGeometry(32, 4, 1, 1, (4, 4))        # blocks 8 -> 10
    assert geom.problem() is None
    assert [AxisPlan(geom, i).need for i in range(4)] == [(4, -2), (2, 0), (0, 2), (-2, 4)]
    assert geom.exchange() == (2, 2)
    assert AxisPlan(geom, 0).pads() == (4, 0) and AxisPlan(geom, 3).pads() == (0, 4)


def test_padding_that_cannot_split_evenly_is_a_problem():
    geom = AxisGeometry(32, 4, 1, 1, (3, 3))        # 38 rows over 4 ranks
    assert "does not split evenly over 4 ranks" in geom.problem()


def test_s_runs_the_region_through_both_paddings_of_the_stem():
    plan = plan_of(stem(), "s")
    kinds = {n.name: n.kind for n in plan.nodes}
    # both paddings fold into their layer: the blocks are cut before conv1_pad
    assert kinds["conv1_pad"] == kinds["pool1_pad"] == "fold"
    assert plan.node("conv1_pad").conversions == ("space_scatter",)
    assert plan.node("conv1_conv").conversions == (None,)
    assert plan.node("conv1_conv").params["border_padding"] == ((3, 3), (3, 3))
    assert plan.node("pool1_pool").params["border_padding"] == ((1, 1), (1, 1))
    assert kinds["conv1_conv"] == kinds["pool1_pool"] == "spatial"
    assert kinds["conv2"] == "spatial" and kinds["conv1_bn"] == "syncbn"
    assert plan.node("pool1_pad").conversions == (None,)
    assert plan.node("gap").conversions == (None,) and kinds["gap"] == "spatial"
    assert plan.node("gap").output.kind == "replicated"   # summed blocks: no gather


def test_padding_folds_only_where_the_unpadded_input_splits():
    graph = describe_graph(as_functional(stem(size=30)))
    folded = rules.fold_padding(graph, (4, 1))           # 30 rows do not split over 4
    assert not folded.node("conv1_pad").attr("folded_into")
    folded = rules.fold_padding(graph, (2, 1))
    assert folded.node("conv1_pad").attr("folded_into") == "conv1_conv"
    assert folded.node("conv1_conv").attr("border_padding") == ((3, 3), (3, 3))
    assert folded.node("conv1_conv").in_shapes[0][1:3] == (30, 30)


def test_ds_spatial_layers_counts_only_convolutions():
    plan = plan_of(stem(), "ds", size=4, m=2, spatial_layers=1)
    kinds = {n.name: n.kind for n in plan.nodes}
    assert kinds["conv1_conv"] == kinds["pool1_pool"] == "spatial"
    assert kinds["pool1_pad"] == "fold"
    assert kinds["conv2"] == "replicate"
    assert plan.node("conv2").conversions == ("space_gather",)


def test_padding_folded_into_its_convolution_splits_the_unpadded_input():
    # 4 ranks along height: conv1_pad would make conv1_conv's input 38 rows, which do
    # not split; folded, the 32 unpadded rows split and the stem runs on blocks.
    plan = plan_of(stem(), "s", size=4, m=4)
    kinds = {n.name: n.kind for n in plan.nodes}
    assert kinds["conv1_conv"] == kinds["pool1_pool"] == kinds["conv2"] == "spatial"
    # A 2x2 block grid splits every axis in two: the stem runs spatially too.
    plan = plan_of(stem(), "s", size=4, m=4, spatial=(2, 2))
    assert plan.node("pool1_pool").kind == "spatial"


def test_padding_that_does_not_split_leaves_nothing_spatial_and_raises():
    # 30 rows do not split over 4 ranks (no fold); padded, conv1_conv's output of 15
    # rows does not either: nothing would be spatial.
    with pytest.raises(ValueError, match=r"Strategy 's' would split no layer spatially "
                                         r"\(spatial='height', a 4x1 grid\): the first Conv2D, "
                                         r"'conv1_conv', cannot be split: its input 36x36 .*"
                                         r"along height, the output size 15 .*does not split "
                                         r"evenly over 4 ranks"):
        plan_of(stem(size=30), "s", size=4, m=4)


def test_explicit_region_names_the_convolution_a_padding_leaves_unsplittable():
    with pytest.raises(ValueError, match=r"Strategy 's' would split no layer spatially.*"
                                         r"'conv1_conv', cannot be split: its input 36x36"):
        plan_of(stem(size=30), "s", size=4, m=4, spatial_layers=1)


def test_shape_only_layers_before_the_first_convolution_run_on_the_full_input():
    # 30 rows do not split over 4 ranks, but the padding runs before the region (on the
    # replicated input); the convolution's 32 input rows split.
    i = keras.Input((30, 30, 3))
    x = keras.layers.ZeroPadding2D(1, name="pad")(i)
    x = keras.layers.Conv2D(4, 3, padding="same", name="conv")(x)
    model = keras.Model(i, keras.layers.Dense(2, name="out")(keras.layers.Flatten()(x)))
    plan = plan_of(model, "s", size=4, m=4)
    assert plan.node("pad").kind == "replicate"
    assert plan.node("conv").kind == "spatial"
    assert plan.node("conv").conversions == ("space_scatter",)


def test_space_split_padding_that_does_not_split_is_gathered():
    # pool1_pad: 16 -> 18 rows; 18 does not split over 4 ranks along height.
    graph = describe_graph(as_functional(stem()))
    node = graph.node("pool1_pad")
    assert not rules.spatial_window(node, (4, 1))
    assert rules.spatial_window(node, (2, 2)) and rules.spatial_window(node, (1, 2))
    ctx = rules.Context("s", 4, 1, (4, 1))
    decision = rules.rule_for("ZeroPadding2D").plan(node, [rules.Layout("space")], "replicate",
                                                    ctx)
    assert decision.needs == ("replicated",) and decision.kind == "replicate"


@functools.lru_cache(maxsize=1)
def resnet50_graph():
    """ResNet-50's graph, read once (building the model takes seconds)."""
    model = keras.applications.ResNet50(weights=None, input_shape=(32, 32, 3), classes=10)
    return describe_graph(as_functional(model))


def resnet50_plan(strategy, size=2, m=2, **options):
    return make_plan(resnet50_graph(), make_options(strategy, **options),
                     ProcessGrid(size, 0, m))


@pytest.mark.parametrize("strategy,size,m,spatial", [("s", 2, 2, "height"), ("ds", 4, 2, "height"),
                                                     ("s", 4, 4, (2, 2))])
def test_resnet50_default_region_gathers_before_the_1x1_stage(strategy, size, m, spatial):
    """32x32 inputs: conv4 runs on 2x2 maps; conv5_block1 would make them 1x1, which
    does not split, so the region ends there and conv4's output is gathered (for the
    shortcut and the main branch)."""
    plan = resnet50_plan(strategy, size=size, m=m, spatial=spatial)
    kinds = {n.name: n.kind for n in plan.nodes}
    assert kinds["conv1_pad"] == kinds["pool1_pad"] == "fold"
    assert kinds["pool1_pool"] == "spatial"
    assert plan.node("conv1_pad").conversions == ("space_scatter",)
    assert kinds["conv4_block6_3_conv"] == "spatial" and kinds["conv4_block6_3_bn"] == "syncbn"
    assert plan.node("conv4_block6_add").conversions == (None, None)
    assert kinds["conv5_block1_1_conv"] == kinds["conv5_block1_0_conv"] == "replicate"
    gathers = sorted(n.name for n in plan.nodes if "space_gather" in n.conversions)
    assert gathers == ["conv5_block1_0_conv", "conv5_block1_1_conv"]
    bn = plan.node("conv5_block1_1_bn")      # replicated rows: synced over data groups only
    assert (bn.kind, bn.params.get("bn_groups")) == (("syncbn", ("data",)) if size > m
                                                     else ("replicate", None))
    # conv1, pool1_pool (the paddings fold), then 3/4/6 blocks of 3 convolutions + a shortcut
    assert sum(k == "spatial" for k in kinds.values()) == 1 + 1 + 10 + 13 + 19


def test_resnet50_spatial_layers_moves_the_gather_earlier():
    plan = resnet50_plan("s", spatial_layers=1)
    kinds = {n.name: n.kind for n in plan.nodes}
    assert kinds["conv1_conv"] == kinds["pool1_pool"] == "spatial"
    assert kinds["conv2_block1_1_conv"] == kinds["conv2_block1_0_conv"] == "replicate"
    gathers = sorted(n.name for n in plan.nodes if "space_gather" in n.conversions)
    assert gathers == ["conv2_block1_0_conv", "conv2_block1_1_conv"]
