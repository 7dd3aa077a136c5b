"""Conv3D filter and channel parallelism (the CosmoFlow part).

Run under ``horovodrun -np 2`` and ``-np 4``. Layer tests: FilterParallelConv3D
and ChannelParallelConv3D against ``keras.layers.Conv3D`` built on every rank
from seeded weights (outputs, input and weight gradients, every layout, the
f -> c pair's collectives, to_layer/config/save). Model tests: a small
CosmoFlow-like 3-D regression CNN (Conv3D, MaxPooling3D, BatchNormalization,
Flatten, Dense, linear output, MSE) transformed under ``f``, ``c``, ``df``
(and ``s``/``ds``) and trained with ``fit``; its gathered weights equal
single-process training of the unmodified model (rtol 1e-4).
"""
import keras
import numpy as np
import pytest
import tensorflow as tf

import tfhybrid
from tfhybrid.layers import (ChannelParallelConv3D, FilterParallelConv3D, SpatialConv3D,
                             SyncBatchNormalization)
from tfhybrid.compose import transform
from tfhybrid.transformer import describe, gather

from conftest import model_parallel_values, randn, reference_once, world_size
from layers_testing import (check_conv_stack, check_conv_to_layer, check_save_load,
                            compare_conv, conv_config_id as config_id, conv_of_config, rank_path,
                            seeded_conv)

N = world_size()
MPS = model_parallel_values()
IN_SHAPE = (2, 5, 6, 6, 4)
FILTERS = 8
# (kernel_size, strides, padding, dilation_rate, activation, use_bias)
CONFIGS = [
    (3, 1, "same", 1, None, True),
    ((3, 1, 3), (2, 1, 1), "valid", 1, "relu", True),
    (3, 1, "valid", (2, 1, 1), "tanh", False),
]
LAYOUTS = [(FilterParallelConv3D, "replicated_partial_grad", "replicated_partial_grad"),
           (FilterParallelConv3D, "replicated", "split"),
           (ChannelParallelConv3D, "replicated_partial_grad", "replicated"),
           (ChannelParallelConv3D, "split", "partial")]


@pytest.fixture(params=MPS, ids=lambda m: f"mp{m}")
def grid(request, grid_of):
    return grid_of(request.param)


def conv3d(filters, in_ch, *key, kernel_size=3, padding="same", **options):
    return seeded_conv(keras.layers.Conv3D, filters, in_ch, "3d", *key,
                       kernel_size=kernel_size, padding=padding, **options)


# -- layers ---------------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["eager", "function"])
@pytest.mark.parametrize("cls", [FilterParallelConv3D, ChannelParallelConv3D],
                         ids=["filter", "channel"])
@pytest.mark.parametrize("config", CONFIGS, ids=config_id)
def test_conv3d_matches_keras_conv3d(grid, config, cls, mode):
    ref = conv_of_config(keras.layers.Conv3D, FILTERS, IN_SHAPE[-1], config)
    compare_conv(cls, ref, IN_SHAPE, "replicated", "replicated", mode)


@pytest.mark.parametrize("cls,in_layout,out_layout", LAYOUTS,
                         ids=[f"{c.__name__[:6]}-{i}-{o}" for c, i, o in LAYOUTS])
def test_conv3d_layouts(grid, cls, in_layout, out_layout):
    ref = conv3d(FILTERS, IN_SHAPE[-1], "lay", strides=(1, 2, 1),
                 activation="relu" if out_layout != "partial" else None)
    compare_conv(cls, ref, IN_SHAPE, in_layout, out_layout, "function")


def pair_layers():
    return [conv3d(8, 4, "p1", activation="relu"),
            conv3d(6, 8, "p2", padding="valid", strides=2, activation="relu")]


def pair_parallel(layers):
    return keras.Sequential([
        keras.Input(IN_SHAPE[1:]),
        FilterParallelConv3D.from_layer(layers[0], output_layout="split"),
        keras.layers.MaxPooling3D((1, 2, 2)),
        ChannelParallelConv3D.from_layer(layers[1], input_layout="split")])


def test_filter_then_channel_pair(grid):
    """f(split) -> MaxPooling3D -> c(split): the Conv3D stack's values and
    gradients, one allreduce forward and one for dx in a traced step."""
    layers = pair_layers()
    ref = keras.Sequential([keras.Input(IN_SHAPE[1:]), layers[0],
                            keras.layers.MaxPooling3D((1, 2, 2)), layers[1]])
    check_conv_stack(ref, pair_parallel(layers), randn(IN_SHAPE, "px"),
                     randn(ref.compute_output_shape(IN_SHAPE), "pu"), grid.group("model"),
                     "function")


def test_to_layer_config_and_save(grid, tmp_path):
    ref = conv3d(FILTERS, IN_SHAPE[-1], "to", kernel_size=(3, 1, 2), strides=(1, 2, 1),
                 dilation_rate=1)
    check_conv_to_layer(ref, [(FilterParallelConv3D, {}),
                              (ChannelParallelConv3D, {"input_layout": "split"})])
    check_save_load(pair_parallel(pair_layers()), randn(IN_SHAPE, "save3"),
                    rank_path(tmp_path, "conv3d"))


def test_errors_name_the_value_and_the_fix(grid_of):
    grid_of(2)
    with pytest.raises(ValueError, match=r"'f3': filters=5 is not divisible by the 2 ranks of "
                                         r"the 'model' group"):
        FilterParallelConv3D(5, 3, name="f3")
    layer = ChannelParallelConv3D(4, 3, name="c3")
    with pytest.raises(ValueError, match=r"'c3': input channels=3 is not divisible by .* 2"):
        layer.build((None, 4, 4, 4, 3))
    with pytest.raises(ValueError, match=r"`kernel_size`.*tuple of 3.*\(3, 3\)"):
        FilterParallelConv3D(4, (3, 3))
    conv2d = keras.layers.Conv2D(4, 3)
    conv2d.build((None, 4, 4, 2))
    with pytest.raises(TypeError, match=r"expects a keras.layers.Conv3D; received Conv2D"):
        FilterParallelConv3D.from_layer(conv2d)


# -- a CosmoFlow-like regression CNN trained under f, c, df, s, ds -----------------

STEPS, BATCH, SIZE, CHANNELS, TARGETS, LR = 2, 8, 8, 4, 4, 0.05


def cosmoflow(seed=0):
    """Conv3D -> MaxPooling3D -> Conv3D -> BN -> ReLU -> MaxPooling3D -> Flatten ->
    Dense -> Dense (4 linear targets), on 8x8x8x4 volumes."""
    keras.utils.set_random_seed(seed)
    i = keras.Input((SIZE, SIZE, SIZE, CHANNELS))
    x = keras.layers.Conv3D(8, 3, padding="same", activation="relu", name="conv1")(i)
    x = keras.layers.MaxPooling3D(2, name="pool1")(x)
    x = keras.layers.Conv3D(8, 3, padding="same", name="conv2")(x)
    x = keras.layers.BatchNormalization(name="bn")(x)
    x = keras.layers.ReLU(name="relu")(x)
    x = keras.layers.MaxPooling3D(2, name="pool2")(x)
    x = keras.layers.Flatten(name="flat")(x)
    x = keras.layers.Dense(8, activation="relu", name="fc1")(x)
    return keras.Model(i, keras.layers.Dense(TARGETS, name="out")(x), name="cosmoflow")


def data():
    x = randn((STEPS * BATCH, SIZE, SIZE, SIZE, CHANNELS), "cosmo", "x")
    y = randn((STEPS * BATCH, TARGETS), "cosmo", "y")
    return x, y


def dataset(x, y):
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH, drop_remainder=True)


_REFERENCE = {}


def reference(x, y):
    """Weights after single-process fit of the unmodified model (once per session)."""
    if "w" not in _REFERENCE:
        def compute():
            model = cosmoflow()
            model.compile(optimizer=keras.optimizers.SGD(LR), loss="mse", jit_compile=False)
            model.fit(dataset(x, y), epochs=1, shuffle=False, verbose=0)
            return model.get_weights()
        _REFERENCE["w"] = reference_once(compute, x, y, LR)     # rank 0 computes it
    return _REFERENCE["w"]


F_LAYERS = {"conv1": FilterParallelConv3D, "conv2": ChannelParallelConv3D}
C_LAYERS = {"conv1": ChannelParallelConv3D, "conv2": ChannelParallelConv3D}
S_LAYERS = {"conv1": SpatialConv3D, "conv2": SpatialConv3D, "bn": SyncBatchNormalization}
# (strategy, model_parallel, options, {layer: class in the transformed model})
CASES = {2: [("f", 2, {}, F_LAYERS), ("c", 2, {}, C_LAYERS), ("s", 2, {}, S_LAYERS)],
         4: [("f", 4, {}, F_LAYERS), ("c", 4, {}, C_LAYERS), ("df", 2, {}, F_LAYERS),
             ("s", 4, {"spatial": (2, 2, 1)}, S_LAYERS), ("ds", 2, {}, S_LAYERS)]}.get(N, [])


@pytest.mark.parametrize("strategy,mp,options,layer_types", CASES,
                         ids=[f"{s}-mp{m}{'-' + str(o['spatial']) if o else ''}".replace(" ", "")
                              for s, m, o, _ in CASES])
def test_cosmoflow_fit_equals_single_process(grid_of, strategy, mp, options, layer_types):
    grid_of(mp)
    x, y = data()
    expected_weights = reference(x, y)
    original = cosmoflow()
    initial = original.get_weights()
    pmodel = transform(original, strategy, **options)
    for name, cls in layer_types.items():
        assert isinstance(pmodel.get_layer(name), cls), (name, type(pmodel.get_layer(name)))
    pmodel.compile(optimizer=tfhybrid.DistributedOptimizer(keras.optimizers.SGD(LR)),
                   loss="mse", jit_compile=False)
    blocks, index = tfhybrid.data.batch_split(pmodel)
    rows = slice(index * BATCH // blocks, (index + 1) * BATCH // blocks)
    np.testing.assert_allclose(pmodel.predict(x[rows], batch_size=BATCH, verbose=0),
                               original(x[rows]), rtol=1e-5, atol=1e-6)
    pmodel.fit(tfhybrid.data.shard(dataset(x, y), model=pmodel), epochs=1, shuffle=False,
               verbose=0)
    actual = gather(pmodel)
    assert [type(a) for a in actual.layers] == [type(b) for b in original.layers]
    moved = max(float(np.max(np.abs(e - i))) for e, i in zip(expected_weights, initial))
    assert moved > 1e-3, "the reference did not train: the comparison would be vacuous"
    for i, (a, e) in enumerate(zip(actual.get_weights(), expected_weights)):
        np.testing.assert_allclose(a, e, rtol=1e-4, atol=1e-6, err_msg=f"weight {i}")


def test_describe_counts_conv3d_filter_and_channel(grid_of):
    grid_of(N)
    pmodel = transform(cosmoflow(), "f")
    d = describe(pmodel, batch_size=BATCH, print_fn=lambda *_: None)
    rows = {r.name: r for r in d.rows}
    assert rows["conv1"].kind == "filter (split out)"
    assert rows["conv2"].kind == "channel (split in)"
    assert rows["conv1"].weight_shapes == ((3, 3, 3, CHANNELS, 8 // N), (8 // N,))
    assert rows["conv2"].weight_shapes == ((3, 3, 3, 8 // N, 8), (8,))
    # conv2's forward allreduce: its 4x4x4x8 output per row of the batch
    assert ("fwd", "allreduce", "model", BATCH * 4 * 4 * 4 * 8 * 4) in rows["conv2"].collectives
