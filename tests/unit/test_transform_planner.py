"""The transformer's planner (pure Python over a model's graph): strategies,
pairing, boundaries, options and every error message. Single process; the
grid is a ProcessGrid value, Horovod is not involved."""
import keras
import pytest

from tfhybrid.process_grid import ProcessGrid
from tfhybrid.transformer.graph import as_functional, describe_graph
from tfhybrid.transformer.options import make_options, spatial_grid
from tfhybrid.transformer.planner import make_plan
from tfhybrid.transformer.strategies import ccr


def cnn(filters=8, units=16, classes=4, size=8):
    i = keras.Input((size, size, 3))
    x = keras.layers.Conv2D(filters, 3, padding="same", activation="relu", name="conv1")(i)
    x = keras.layers.BatchNormalization(name="bn1")(x)
    x = keras.layers.MaxPooling2D(name="pool1")(x)
    x = keras.layers.Conv2D(filters, 3, padding="same", name="conv2")(x)
    x = keras.layers.ReLU(name="relu2")(x)
    x = keras.layers.Flatten(name="flat")(x)
    x = keras.layers.Dense(units, activation="relu", name="fc1")(x)
    x = keras.layers.Dropout(0.5, name="drop")(x)
    x = keras.layers.Dense(classes, activation="softmax", name="out")(x)
    return keras.Model(i, x, name="cnn")


def plan_of(model, strategy, size=4, m=4, **options):
    graph = describe_graph(as_functional(model))
    return make_plan(graph, make_options(strategy, **options), ProcessGrid(size, 0, m))


def kinds(plan):
    return {n.name: n.kind for n in plan.nodes}


def test_d_keeps_everything_replicated_and_splits_over_world():
    plan = plan_of(cnn(), "d", m=1)
    assert plan.batch_split == "world"
    assert set(kinds(plan).values()) == {"replicate", "syncbn"}
    assert plan.node("bn1").params["bn_groups"] == ("data", "model")
    assert all(c is None for n in plan.nodes for c in n.conversions)


def test_d_ignores_the_model_axis():
    plan = plan_of(cnn(), "d", m=2)
    assert kinds(plan)["fc1"] == "replicate" and plan.batch_split == "world"


def test_f_pairs_filter_then_channel_and_gathers_before_bn():
    plan = plan_of(cnn(classes=6), "f", fallback="replicate")
    k = kinds(plan)
    assert (k["conv1"], k["conv2"], k["fc1"], k["out"]) == ("filter", "filter", "filter",
                                                              "replicate")
    assert plan.node("conv1").params["output_layout"] == "replicated"   # BN follows
    assert plan.node("bn1").kind == "replicate"       # data_size 1: nothing to sync
    assert plan.batch_split == "data"


def test_f_pairs_dense_layers_through_dropout():
    plan = plan_of(cnn(classes=8), "f")
    assert plan.node("fc1").params["output_layout"] == "split"
    assert plan.node("out").kind == "channel"
    assert plan.node("out").params["input_layout"] == "split"
    assert plan.node("drop").output.kind == "channel"


def test_df_syncs_batchnorm_over_the_data_group():
    plan = plan_of(cnn(classes=8), "df", size=4, m=2)
    assert plan.node("bn1").kind == "syncbn"
    assert plan.node("bn1").params["bn_groups"] == ("data",)


def test_c_partitions_input_channels():
    plan = plan_of(cnn(classes=8), "c", fallback="replicate")
    k = kinds(plan)
    assert k["conv1"] == "replicate"      # 3 input channels do not split over 4
    assert k["conv2"] == "channel" and k["fc1"] == "channel" and k["out"] == "channel"


def test_s_scatters_the_input_and_gathers_before_flatten():
    plan = plan_of(cnn(), "s", size=2, m=2)
    assert plan.node("conv1").conversions == ("space_scatter",)
    assert plan.node("conv1").kind == plan.node("conv2").kind == "spatial"
    assert plan.node("pool1").kind == "spatial"
    assert plan.node("bn1").params["bn_groups"] == ("data", "model")
    assert plan.node("flat").conversions == ("space_gather",)
    assert plan.outputs == (None,)


def test_s_spatial_layers_limits_the_region():
    plan = plan_of(cnn(), "ds", size=4, m=2, spatial_layers=1)
    assert plan.node("conv2").kind == "replicate"
    assert plan.node("conv2").conversions == ("space_gather",)


def test_s_width_and_block_grids():
    assert plan_of(cnn(), "s", spatial="width").context.spatial == (1, 4)
    assert plan_of(cnn(), "s", spatial=(2, 2)).context.spatial == (2, 2)
    assert spatial_grid("height", 2, "s") == (2, 1)


def test_gmp_partitions_high_ccr_dense_behind_a_modulo_layer():
    plan = plan_of(cnn(units=64, classes=8), "gmp", size=4, m=2, ccr_threshold=0)
    assert plan.batch_split == "world"
    assert kinds(plan)["conv1"] == "replicate"
    assert plan.node("fc1").conversions == ("modulo",)
    assert plan.node("fc1").params["output_layout"] == "split"
    assert plan.node("out").kind == "channel"
    assert plan.outputs == ("unmodulo",)


def test_gmp_ccr_threshold_selects_layers():
    plan = plan_of(cnn(units=64), "gmp", size=4, m=2, ccr_threshold=20)
    node = describe_graph(as_functional(cnn(units=64))).node("fc1")
    assert ccr(node) == pytest.approx(6 * 128 * 64 / (4 * 192))
    assert kinds(plan)["fc1"] == "filter" and kinds(plan)["out"] == "replicate"
    assert plan.node("fc1").params["output_layout"] == "replicated"


def test_overrides_choose_per_layer_kinds():
    plan = plan_of(cnn(classes=8), "df", size=4, m=2,
                   layers={"conv1": "replicate", "fc1": "f", "out": "c"})
    k = kinds(plan)
    assert k["conv1"] == "replicate" and k["fc1"] == "filter" and k["out"] == "channel"


def test_sequential_models_are_read():
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, name="a"),
                              keras.layers.Dense(4, name="b")])
    assert kinds(plan_of(model, "f")) == {"a": "filter", "b": "channel"}


def test_residual_add_keeps_layouts():
    i = keras.Input((8, 8, 4))
    x = keras.layers.Conv2D(4, 3, padding="same", name="c1")(i)
    y = keras.layers.Add(name="add")([i, x])
    model = keras.Model(i, keras.layers.Dense(4, name="d")(keras.layers.Flatten()(y)))
    plan = plan_of(model, "s", size=2, m=2)
    assert plan.node("add").output.kind == "space"
    assert plan.node("add").conversions == ("space_scatter", None)   # shortcut: local slice
    assert plan.node("c1").conversions == ("space_scatter",)


# -- errors ----------------------------------------------------------------------------

def test_unknown_strategy():
    with pytest.raises(ValueError, match=r"unknown strategy: strategy='xyz'.*'gmp'"):
        make_options("xyz")


def test_option_that_does_not_apply():
    with pytest.raises(ValueError, match=r"mp=2 does not apply to strategy 'df'.*'gmp'"):
        make_options("df", mp=2)
    with pytest.raises(ValueError, match=r"spatial_layers=2 does not apply to strategy 'f'"):
        make_options("f", spatial_layers=2)
    with pytest.raises(ValueError, match=r"unknown option bogus=1"):
        make_options("d", bogus=1)


def test_invalid_option_values():
    with pytest.raises(ValueError, match=r"fallback='maybe'"):
        make_options("f", fallback="maybe")
    with pytest.raises(ValueError, match=r"layers\['fc1'\]='x'"):
        make_options("f", layers={"fc1": "x"})
    with pytest.raises(ValueError, match=r"ccr_threshold=-1"):
        make_options("gmp", ccr_threshold=-1)
    with pytest.raises(ValueError, match=r"mp=0"):
        make_options("gmp", mp=0)
    with pytest.raises(ValueError, match=r"scheme='BK2'.*\('BK', 'B', 'B/K'\)"):
        make_options("gmp", scheme="BK2")
    with pytest.raises(ValueError, match=r"scheme='B/K' does not apply to strategy 'df'.*'gmp'"):
        make_options("df", scheme="B/K")
    assert make_options("gmp").scheme == "BK" and make_options("gmp", scheme="B/K").scheme == "B/K"
    with pytest.warns(DeprecationWarning, match="'modulo' is deprecated; use 'scheme'"):
        assert make_options("gmp", modulo="B/K").scheme == "B/K"
    with pytest.raises(ValueError, match="both modulo= .deprecated. and scheme="):
        make_options("gmp", modulo="B/K", scheme="BK")


def test_units_not_divisible_names_layer_strategy_and_fix():
    with pytest.raises(ValueError, match=r"Layer 'out' \(Dense\) cannot be made filter-parallel "
                                         r"under strategy 'f': units=6 .* model group size 4"
                                         r".*fallback='replicate'"):
        plan_of(cnn(classes=6, units=12), "f", size=4, m=4)


def test_gmp_suggests_valid_mp():
    with pytest.raises(ValueError, match=r"'out' \(Dense\).*units=6.*Use fallback='replicate'"
                                         r".*or use mp=2"):
        plan_of(cnn(classes=6), "gmp", size=4, m=4, ccr_threshold=0)
    with pytest.raises(ValueError, match=r"mp=3 for strategy 'gmp' on 4 ranks.*\[1, 2, 4\]"):
        plan_of(cnn(), "gmp", size=4, m=2, mp=3)


def test_gmp_mp_must_match_grid():
    with pytest.raises(ValueError, match=r"tfhybrid.init\(model_parallel=4\)"):
        plan_of(cnn(), "gmp", size=4, m=2, mp=4)


def test_whole_world_strategies_need_model_parallel_world():
    with pytest.raises(ValueError, match=r"Strategy 'f' partitions the model over all 4 ranks.*"
                                         r"model_parallel=4.*strategy='df'"):
        plan_of(cnn(), "f", size=4, m=2)


def test_spatial_height_not_divisible():
    with pytest.raises(ValueError, match=r"Layer 'conv2' \(Conv2D\) cannot be split spatially "
                                         r"under strategy 's'.*spatial_layers"):
        plan_of(cnn(size=4), "s", size=4, m=4, spatial_layers=2)


def test_spatial_grid_must_match_group():
    with pytest.raises(ValueError, match=r"spatial=\(2, 1\).*model groups of 4 ranks"):
        plan_of(cnn(), "s", spatial=(2, 1))


def test_layer_without_rule():
    i = keras.Input((8, 8, 4))
    x = keras.layers.DepthwiseConv2D(3, name="dw")(i)
    model = keras.Model(i, keras.layers.Dense(4, name="d")(keras.layers.Flatten()(x)))
    with pytest.raises(ValueError, match=r"Layer 'dw' \(DepthwiseConv2D\) has weights but .*"
                                         r"strategy 'f'.*fallback='replicate'"):
        plan_of(model, "f")
    assert kinds(plan_of(model, "f", fallback="replicate"))["dw"] == "replicate"


def test_override_errors():
    with pytest.raises(ValueError, match=r"no layer 'nope'"):
        plan_of(cnn(), "df", size=4, m=2, layers={"nope": "f"})
    with pytest.raises(ValueError, match=r"'bn1' is a BatchNormalization; 'f' applies"):
        plan_of(cnn(), "df", size=4, m=2, layers={"bn1": "f"})
    with pytest.raises(ValueError, match=r"'s'\} under strategy 'df'"):
        plan_of(cnn(), "df", size=4, m=2, layers={"conv1": "s"})
    with pytest.raises(ValueError, match=r"under strategy 'd'"):
        plan_of(cnn(), "d", size=4, m=1, layers={"fc1": "f"})


def test_subclassed_model_is_rejected():
    class Net(keras.Model):
        def __init__(self):
            super().__init__()
            self.d = keras.layers.Dense(4)

        def call(self, x):
            return self.d(x)

    net = Net()
    net(keras.ops.zeros((1, 3)))
    with pytest.raises(ValueError, match=r"subclassed model .*functional API"):
        as_functional(net)


def test_unbuilt_sequential_is_rejected():
    with pytest.raises(ValueError, match=r"unbuilt Sequential model"):
        as_functional(keras.Sequential([keras.layers.Dense(3)]))
