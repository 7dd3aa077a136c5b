"""Volume (Conv3D) models under the spatial strategies, in one process: the
planner splits depth (by default), height, width or a (pd, ph, pw) grid; 3-D
pooling, zero padding and cropping join the spatial region; errors name the volume axes;
``describe`` counts 3-D halos. Multi-rank exactness is
tests/parallel/test_transform_3d.py."""
import keras
import pytest

from tfhybrid.transformer import rules
from tfhybrid.transformer.describe import _halo_bytes
from tfhybrid.transformer.graph import as_functional, describe_graph
from tfhybrid.spatial_geometry import spatial_grid
from tfhybrid.transformer.rewrite import _split_arg

from test_transform_spatial_cropping import plan_of


def volume_cnn(depth=12, size=6):
    i = keras.Input((depth, size, size, 2))
    x = keras.layers.Conv3D(4, 3, padding="same", activation="relu", name="conv1")(i)
    x = keras.layers.BatchNormalization(name="bn1")(x)
    x = keras.layers.ZeroPadding3D(((2, 2), (1, 1), (1, 1)), name="pad")(x)
    x = keras.layers.Cropping3D(((4, 4), (2, 2), (2, 2)), name="crop")(x)
    x = keras.layers.Conv3D(4, 3, padding="same", name="conv2")(x)
    x = keras.layers.MaxPooling3D(2, name="pool")(x)
    x = keras.layers.Flatten(name="flat")(x)
    return keras.Model(i, keras.layers.Dense(3, name="out")(x), name="volume_cnn")


def kinds(plan):
    return {n.name: n.kind for n in plan.nodes}


def test_spatial_grid_for_volumes():
    assert spatial_grid(None, 4, "s", ndim=3) == (4, 1, 1)
    assert spatial_grid("height", 2, "s", ndim=3) == (1, 2, 1)
    assert spatial_grid((2, 1, 2), 4, "ds", ndim=3) == (2, 1, 2)
    assert spatial_grid(None, 2, "s") == (2, 1)
    with pytest.raises(ValueError, match=r"spatial=\(2, 2\) for a volume \(5-D input\) model; "
                                         r"expected one of 'depth', 'height', 'width' or a "
                                         r"tuple \(pd, ph, pw\)"):
        spatial_grid((2, 2), 4, "s", ndim=3)
    with pytest.raises(ValueError, match=r"pd \* ph \* pw must equal model_parallel, e.g. "
                                         r"spatial=\(4, 1, 1\)"):
        spatial_grid((2, 1, 1), 4, "s", ndim=3)


@pytest.mark.parametrize("strategy,size,m,spatial,grid", [
    ("s", 2, 2, None, (2, 1, 1)), ("s", 2, 2, "height", (1, 2, 1)),
    ("s", 4, 4, (2, 2, 1), (2, 2, 1)), ("ds", 4, 2, "depth", (2, 1, 1))])
def test_volume_region_is_spatial_up_to_flatten(strategy, size, m, spatial, grid):
    options = {} if spatial is None else {"spatial": spatial}
    plan = plan_of(volume_cnn(), strategy, size, m, **options)
    k = kinds(plan)
    assert plan.context.spatial == grid
    assert (k["conv1"], k["pad"], k["crop"], k["conv2"], k["pool"]) == ("spatial",) * 5
    assert k["bn1"] == "syncbn" and plan.node("bn1").params["bn_groups"] == ("data", "model")
    assert plan.node("conv1").conversions == ("space_scatter",)
    assert plan.node("flat").conversions == ("space_gather",)
    assert plan.node("conv2").params["split"] == grid


def test_split_argument_of_the_spatial_layers():
    assert _split_arg((2, 1, 1)) == "depth" and _split_arg((1, 1, 2)) == "width"
    assert _split_arg((2, 2, 1)) == (2, 2, 1) and _split_arg((2, 1)) == "height"
    assert _split_arg((1, 1, 1)) == "depth"


def test_volume_that_does_not_split_names_depth_and_the_fix():
    # depth 10 over 4 ranks does not split evenly; height 6 does not either; width 6 neither
    with pytest.raises(ValueError, match=r"Strategy 's' would split no layer spatially "
                                         r"\(spatial='depth', a 4x1x1 grid\): the first Conv3D, "
                                         r"'conv1', cannot be split: its input 10x6x6 / output "
                                         r"10x6x6 \(depth x height x width\) do not split over "
                                         r"the 4x1x1 spatial grid: along depth"):
        plan_of(volume_cnn(depth=10), "s", 4, 4)


def test_explicit_spatial_override_on_a_conv3d():
    plan = plan_of(volume_cnn(), "s", spatial_layers=1)
    k = kinds(plan)
    assert (k["conv1"], k["pad"], k["crop"], k["conv2"], k["pool"]) == (
        "spatial", "spatial", "spatial", "replicate", "replicate")
    assert plan.node("conv2").conversions == ("space_gather",)


def test_f_and_c_partition_conv3d_like_conv2d():
    plan = plan_of(volume_cnn(), "f", fallback="replicate")   # out: 3 units over 2 ranks
    k = kinds(plan)
    assert k["conv1"] == k["conv2"] == "filter" and k["out"] == "replicate"
    assert rules.rule_for("Conv3D") is rules.rule_for("Conv2D")
    k = kinds(plan_of(volume_cnn(), "c"))
    assert k["conv1"] == k["conv2"] == k["out"] == "channel"


def test_describe_counts_3d_halos():
    graph = describe_graph(as_functional(volume_cnn()))
    node = next(n for n in graph.nodes if n.name == "conv1")
    ctx = rules.Context("s", 2, 1, (2, 1, 1))
    # depth split: (3 - 1) planes of the 6x6 block x 2 channels x 4 bytes, per row
    assert _halo_bytes(node, 8, ctx) == 8 * 2 * 36 * 2 * 4
    ctx = rules.Context("s", 4, 1, (2, 2, 1))
    # depth: 2 planes of 3x6; height: 2 rows of 6x6 (local depth 6, width 6)
    assert _halo_bytes(node, 1, ctx) == (2 * 3 * 6 + 2 * 6 * 6) * 2 * 4
