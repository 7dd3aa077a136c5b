"""Cropping2D under spatial strategies, in one process: the border geometry
(cropping is padding by a negative number of rows), the planner's rule, the
rewrite on a world of one rank, and SpatialCropping2D/3D's arguments and
config. The multi-rank exactness is tests/parallel/test_transform_cropping.py.
"""
import keras
import numpy as np
import pytest

from tfhybrid.process_grid import ProcessGrid
from tfhybrid.layers import SpatialCropping2D, SpatialCropping3D
from tfhybrid.spatial_geometry import AxisGeometry, AxisPlan
from tfhybrid.compose import transform
from tfhybrid.transformer import rules
from tfhybrid.transformer.graph import as_functional, describe_graph
from tfhybrid.transformer.options import make_options
from tfhybrid.transformer.planner import make_plan

CROP = ((3, 1), (1, 3))


def unet_like(size=20, crop=CROP):
    """U-Net-like skip: a 'valid' convolution joined with the cropped encoder map."""
    i = keras.Input((size, size, 3))
    enc = keras.layers.Conv2D(4, 3, padding="same", activation="relu", name="enc")(i)
    kernel = sum(crop[0]) + 1
    main = keras.layers.Conv2D(4, kernel, activation="relu", name="main")(enc)
    skip = keras.layers.Cropping2D(crop, name="crop")(enc)
    x = keras.layers.Add(name="join")([main, skip])
    x = keras.layers.MaxPooling2D(2, name="pool")(x)
    x = keras.layers.Conv2D(4, 3, padding="same", name="dec")(x)
    x = keras.layers.Flatten(name="flat")(x)
    return keras.Model(i, keras.layers.Dense(3, name="out")(x), name="unet_like")


def plan_of(model, strategy, size=2, m=2, **options):
    graph = describe_graph(as_functional(model))
    return make_plan(graph, make_options(strategy, **options), ProcessGrid(size, 0, m))


# -- geometry ---------------------------------------------------------------------------

def test_symmetric_crop_over_two_ranks_drops_only_border_rows():
    geom = AxisGeometry(20, 2, 1, 1, (-2, -2))      # blocks 10 -> 8
    assert geom.problem() is None and geom.out_size == 16 and geom.exchange() == (0, 0)
    first, last = AxisPlan(geom, 0), AxisPlan(geom, 1)
    assert first.need == (-2, 0) and last.need == (0, -2)
    assert first.take(True) == (-2, 0) and last.take(True) == (0, -2)
    assert first.pads() == last.pads() == (0, 0)      # nothing is padded


def test_asymmetric_crop_moves_rows_between_neighbours():
    geom = AxisGeometry(20, 4, 1, 1, (-3, -1))      # blocks 5 -> 4
    assert geom.problem() is None
    assert [AxisPlan(geom, i).need for i in range(4)] == [(-3, 2), (-2, 1), (-1, 0), (0, -1)]
    assert geom.exchange() == (0, 2)
    assert all(AxisPlan(geom, i).pads() == (0, 0) for i in range(4))


def test_crop_that_does_not_split_or_needs_more_than_a_block():
    assert "does not split evenly over 4 ranks" in AxisGeometry(20, 4, 1, 1, (-1, -1)).problem()
    # 8 rows over 4 ranks cropped to 4: rank 0 needs 4 rows of rank 1's 2-row block.
    assert "smaller than the halo" in AxisGeometry(8, 4, 1, 1, (-4, 0)).problem()


# -- the rule and the planner ----------------------------------------------------------------

def test_cropping_inside_the_region_is_spatial():
    plan = plan_of(unet_like(), "s")
    kinds = {n.name: n.kind for n in plan.nodes}
    assert kinds["crop"] == "spatial" and plan.node("crop").conversions == (None,)
    assert plan.node("crop").params["split"] == (2, 1)
    assert kinds["main"] == kinds["dec"] == kinds["pool"] == "spatial"
    assert plan.node("join").conversions == (None, None)
    assert plan.node("enc").conversions == ("space_scatter",)
    assert plan.node("flat").conversions == ("space_gather",)


@pytest.mark.parametrize("strategy,size,m,spatial", [("s", 4, 4, "height"), ("s", 4, 4, (2, 2)),
                                                     ("ds", 4, 2, "width")])
def test_cropping_under_other_grids(strategy, size, m, spatial):
    plan = plan_of(unet_like(), strategy, size=size, m=m, spatial=spatial)
    assert plan.node("crop").kind == "spatial"


def test_crop_that_does_not_split_is_gathered_and_ends_the_region():
    # 20 -> 18 rows: 18 does not split over 4 ranks along height.
    model = unet_like(crop=((1, 1), (1, 1)))
    graph = describe_graph(as_functional(model))
    node = graph.node("crop")
    assert not rules.spatial_window(node, (4, 1)) and rules.spatial_window(node, (2, 1))
    assert rules.spatial_problem(node, (4, 1)) == (
        "its input 20x20 / output 18x18 (height x width) do not split over the 4x1 spatial "
        "grid: along height, the output size 18 (stride 1, padding '(-1, -1)') does not "
        "split evenly over 4 ranks")
    decision = rules.rule_for("Cropping2D").plan(node, [rules.Layout("space")], "replicate",
                                                 rules.Context("s", 4, 1, (4, 1)))
    assert decision.needs == ("replicated",) and decision.kind == "replicate"
    # The 'valid' 3x3 convolution's 18 output rows do not split either: the region is 'enc'.
    plan = plan_of(model, "s", size=4, m=4)
    assert [n.name for n in plan.nodes if n.kind == "spatial"] == ["enc"]
    assert plan.node("crop").conversions == ("space_gather",)


def test_cropping_before_the_first_convolution_runs_on_the_full_input():
    i = keras.Input((18, 18, 3))
    x = keras.layers.Cropping2D(1, name="crop")(i)            # 18 rows do not split over 4
    x = keras.layers.Conv2D(4, 3, padding="same", name="conv")(x)
    model = keras.Model(i, keras.layers.Dense(2, name="out")(keras.layers.Flatten()(x)))
    plan = plan_of(model, "s", size=4, m=4)
    assert plan.node("crop").kind == "replicate"
    assert plan.node("conv").kind == "spatial"


def test_border_rows_of_padding_and_cropping():
    graph = describe_graph(as_functional(unet_like()))
    assert rules.border_rows(graph.node("crop")) == ((-3, -1), (-1, -3))


# -- the rewrite on a world of one rank --------------------------------------------------------

@pytest.mark.parametrize("strategy", ["s", "ds"])
def test_transform_builds_spatial_cropping_and_computes_the_original(strategy):
    keras.utils.set_random_seed(0)
    model = unet_like()
    pmodel = transform(model, strategy)
    assert isinstance(pmodel.get_layer("crop"), SpatialCropping2D)
    assert pmodel.get_layer("crop").cropping == CROP
    x = np.random.default_rng(0).standard_normal((2, 20, 20, 3)).astype("float32")
    np.testing.assert_allclose(pmodel(x), model(x), rtol=1e-5, atol=1e-6)


# -- the layers' arguments and config ----------------------------------------------------

def test_spatial_cropping_round_trips_through_its_config():
    layer = SpatialCropping2D(((1, 2), (0, 1)), split="width", name="crop")
    again = SpatialCropping2D.from_config(layer.get_config())
    assert again.cropping == ((1, 2), (0, 1)) and again.split == "width"
    assert again.name == "crop" and again.supports_jit is False
    copy = SpatialCropping2D.from_layer(keras.layers.Cropping2D(2, name="c"), split=(2, 2))
    assert copy.cropping == ((2, 2), (2, 2)) and copy.name == "c" and copy.split == (2, 2)
    cube = SpatialCropping3D.from_config(SpatialCropping3D(1, split="height").get_config())
    assert cube.cropping == ((1, 1), (1, 1), (1, 1)) and cube.split == "height"
    again = keras.saving.deserialize_keras_object(keras.saving.serialize_keras_object(layer))
    assert isinstance(again, SpatialCropping2D)


def test_spatial_cropping_argument_errors():
    with pytest.raises(TypeError, match=r"from_layer: Received layer=.*expected a "
                                        r"keras.layers.Cropping2D"):
        SpatialCropping2D.from_layer(keras.layers.ZeroPadding2D(1))
    with pytest.raises(TypeError, match=r"expected a keras.layers.Cropping3D"):
        SpatialCropping3D.from_layer(keras.layers.Cropping2D(1))
    with pytest.raises(ValueError, match=r"SpatialCropping2D 'c'.*channels_last"):
        SpatialCropping2D(1, data_format="channels_first", name="c")
    with pytest.raises(ValueError, match=r"SpatialCropping2D 'c'.*Received an invalid value for "
                                         r"`split`: 'depth'"):
        SpatialCropping2D(1, split="depth", name="c")
