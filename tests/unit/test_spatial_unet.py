"""U-Nets under the spatial strategies, in one process: the transposed
convolutions' block geometry against Keras, the planner keeping every layer
of a 2-D and a 3-D U-Net on blocks (no layer at full resolution, the output
split), ``describe`` labelling them, and ``transform(batch_norm=...)``.
Multi-rank exactness is tests/parallel/test_unet.py."""
import os
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf
from keras import ops

import tfhybrid
from tfhybrid.layers.spatial.output import label_block, split_labels
from tests.pretend_grid import pretend
from tfhybrid.spatial_geometry import TransposeGeometry, transpose_output
from tfhybrid.transformer import rules
from tfhybrid.transformer.options import make_options

from test_transform_planner import plan_of

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "parallel"))
from unet_models import unet


def _blockwise_transpose(layer, x, parts):
    """The output of a built Conv2DTranspose (kernel 1 along width) computed
    block by block along height over ``parts`` blocks, as
    SpatialConv2DTranspose does: the block's rows plus the halo (zeros
    beyond the border), a 'valid' transposed convolution, the block's rows of
    its result."""
    geom = TransposeGeometry(x.shape[1], parts, layer.kernel_size[0], layer.strides[0],
                             layer.padding)
    assert geom.problem() is None, geom.problem()
    n, out = geom.block, []
    for i in range(parts):
        lo, hi = geom.need(i)
        rows = np.arange(i * n - lo, (i + 1) * n + hi)
        inside = ((rows >= 0) & (rows < x.shape[1]))[None, :, None, None]
        ext = np.where(inside, np.take(x, np.clip(rows, 0, x.shape[1] - 1), axis=1), 0.0)
        y = np.asarray(ops.conv_transpose(ext.astype(np.float32), layer.kernel,
                                          list(layer.strides), padding="valid"))
        out.append(y[:, geom.offset(i):geom.offset(i) + geom.out_block])
    return np.concatenate(out, axis=1)


@pytest.mark.parametrize("kernel,stride,padding,parts", [
    (2, 2, "valid", 2), (3, 2, "same", 2), (3, 2, "same", 4), (4, 2, "same", 4),
    (3, 1, "same", 4), (3, 1, "valid", 2), (4, 2, "valid", 2), (5, 2, "same", 2),
    (1, 2, "valid", 4), (2, 3, "same", 2)])
def test_transpose_geometry_reproduces_keras(kernel, stride, padding, parts):
    size = next(n for n in range(4, 64) if TransposeGeometry(
        n, parts, kernel, stride, padding).problem() is None)
    x = np.random.default_rng(kernel * 10 + stride).standard_normal(
        (2, size, 5, 3)).astype(np.float32)
    layer = keras.layers.Conv2DTranspose(2, (kernel, 1), strides=(stride, 1), padding=padding,
                                         use_bias=False)
    want = np.asarray(layer(x))
    np.testing.assert_allclose(_blockwise_transpose(layer, x, parts), want, rtol=1e-5,
                               atol=1e-5)


def test_transpose_geometry_halos_and_errors():
    assert TransposeGeometry(8, 2, 2, 2, "valid").exchange() == (0, 0)   # U-Net's 2x2/2
    assert TransposeGeometry(8, 2, 3, 2, "same").exchange() == (1, 0)
    assert TransposeGeometry(8, 4, 3, 1, "same").exchange() == (1, 1)
    assert transpose_output(8, 3, 2, "valid") == (17, 0)
    assert "output size 17" in TransposeGeometry(8, 2, 3, 2, "valid").problem()


def kinds(plan):
    return {n.name: n.kind for n in plan.nodes}


@pytest.mark.parametrize("shape,up,size,spatial", [
    ((16, 16, 1), "transpose", 2, None), ((16, 16, 1), "upsample", 4, (2, 2)),
    ((8, 8, 8, 1), "transpose3", 2, "height"), ((16, 8, 8, 1), "transpose", 4, None),
    ((8, 8, 8, 1), "upsample", 4, (1, 2, 2))])
def test_every_unet_layer_runs_on_blocks(shape, up, size, spatial):
    model = unet(shape, filters=2, depth=2, up=up)
    options = {} if spatial is None else {"spatial": spatial}
    plan = plan_of(model, "s", size, size, **options)
    assert all(n.output.kind == "space" for n in plan.nodes), \
        [n.name for n in plan.nodes if n.output.kind != "space"]
    conversions = [(n.name, c) for n in plan.nodes for c in n.conversions if c]
    assert conversions == [("enc0_conv1", "space_scatter")]
    assert plan.outputs == (None,) and plan.split_outputs == (True,)
    k = kinds(plan)
    weighted = [n.name for n in plan.nodes if n.cls in rules.SPATIAL_WEIGHTED]
    assert weighted and all(k[name] == "spatial" for name in weighted)
    assert {k[n.name] for n in plan.nodes if n.cls == "BatchNormalization"} == {"syncbn"}


def test_ds_unet_keeps_the_output_split_over_each_model_group():
    plan = plan_of(unet((8, 8, 8, 1), filters=2), "ds", 4, 2)
    assert plan.split_outputs == (True,) and plan.context.spatial == (2, 1, 1)
    assert plan.node("enc0_bn1").params["bn_groups"] == ("data", "model")


def test_layers_that_need_neighbours_end_the_region():
    i = keras.Input((8, 8, 2))
    x = keras.layers.Conv2D(4, 3, padding="same", name="conv1")(i)
    y = keras.layers.Conv2D(4, 3, padding="same", name="conv2")(x)
    z = keras.layers.Concatenate(axis=1, name="cat_rows")([x, y])   # along height: gathered
    model = keras.Model(i, keras.layers.Conv2D(2, 1, name="head")(z))
    plan = plan_of(model, "s", 2, 2)
    assert plan.node("cat_rows").conversions == ("space_gather", "space_gather")
    assert plan.split_outputs == (False,) and plan.outputs == (None,)
    i = keras.Input((8, 8, 2))
    x = keras.layers.Conv2D(4, 3, padding="same", name="conv1")(i)
    x = keras.layers.UpSampling2D(interpolation="bicubic", name="up")(x)
    plan = plan_of(keras.Model(i, keras.layers.Conv2D(2, 1, name="head")(x)), "s", 2, 2)
    assert plan.node("up").conversions == ("space_gather",)
    assert kinds(plan)["head"] == "replicate"


def test_bilinear_upsampling_runs_on_blocks():
    i = keras.Input((8, 8, 2))
    x = keras.layers.Conv2D(4, 3, padding="same", name="conv1")(i)
    x = keras.layers.UpSampling2D(interpolation="bilinear", name="up")(x)
    plan = plan_of(keras.Model(i, keras.layers.Conv2D(2, 1, name="head")(x)), "s", 2, 2)
    assert plan.node("up").kind == "spatial" and plan.node("up").conversions == (None,)
    assert kinds(plan)["head"] == "spatial" and plan.split_outputs == (True,)


def test_output_padding_keeps_a_transposed_conv_replicated():
    i = keras.Input((8, 8, 2))
    x = keras.layers.Conv2D(4, 3, padding="same", name="conv1")(i)
    x = keras.layers.Conv2DTranspose(2, 3, strides=2, padding="same", output_padding=1,
                                     name="up")(x)
    plan = plan_of(keras.Model(i, x), "s", 2, 2)
    assert kinds(plan) == {"conv1": "spatial", "up": "replicate"}
    assert plan.node("up").conversions == ("space_gather",)


def test_describe_shows_the_decoder_as_spatial():
    tfhybrid.init()
    try:
        pmodel = tfhybrid.transform(unet((16, 16, 1), filters=2, depth=2), "s")
        rows = tfhybrid.describe(pmodel, batch_size=2, print_fn=None).rows
    finally:
        tfhybrid.shutdown()
    labels = {r.name: r.kind for r in rows}
    assert labels["up0"] == labels["dec0_conv2"] == labels["head"] == "spatial"
    assert labels["skip0"] == labels["softmax"] == labels["dec0_relu1"] == "spatial (local)"
    assert all(label.startswith("spatial") for label in labels.values()), labels
    assert pmodel._tfhybrid_split_outputs == (True,)


def test_batch_norm_option():
    model = unet((8, 8, 1), filters=2, depth=1)
    sync = plan_of(model, "ds", 4, 2)
    local = plan_of(model, "ds", 4, 2, batch_norm="local")
    assert kinds(sync)["enc0_bn1"] == "syncbn"
    assert kinds(local)["enc0_bn1"] == "replicate"
    assert local.node("enc0_bn1").params == {"batch_norm": "local", "weights": "partial"}
    assert kinds(plan_of(model, "d", 4, 1, batch_norm="local"))["enc0_bn1"] == "replicate"
    assert make_options("s").batch_norm == "sync"
    with pytest.raises(ValueError, match=r"batch_norm='mean'; expected one of \('sync', "
                                         r"'local'\)"):
        make_options("d", batch_norm="mean")
    with pytest.raises(ValueError, match=r"batch_norm='local' does not apply to strategy 'ls'"):
        make_options("ls", batch_norm="local")


class _SplitModel(keras.layers.Layer):
    """Stands in for a transformed model with one split output on grid ``spatial``."""

    def __init__(self, spatial):
        super().__init__()
        self._tfhybrid_split_outputs, self._tfhybrid_output_grid = (True,), spatial
        self.layers = []


def test_labels_are_cut_like_the_split_output():
    y = np.arange(4 * 8 * 6).reshape(4, 8, 6)
    w = np.ones((4, 8, 6, 1), np.float32) * np.arange(8)[None, :, None, None]
    x = np.zeros((4, 8, 6, 1), np.float32)
    with pretend(4, 3, 4):                 # (2, 2) grid: block (1, 1)
        got = label_block(y, (2, 2))
        np.testing.assert_array_equal(got, y[:, 4:, 3:])
        xs, ys, ws = split_labels((x, y, w), (2, 2))
        assert xs.shape == x.shape and ws.shape == (4, 4, 3, 1) and float(ws[0, 0, 0, 0]) == 4
        assert label_block(np.ones((4, 1, 1)), (2, 2)).shape == (4, 1, 1)   # broadcast weights
        assert label_block(np.ones((4,)), (2, 2)).shape == (4,)              # per sample
    with pretend(4, 2, 2):                 # ds: 2 data groups x depth 2 -> data 1, block 0
        model = _SplitModel((2, 1))
        xs, ys = tfhybrid.data.shard((x, y), model=model, batch_size=4)
        np.testing.assert_array_equal(ys, y[2:4, :4])
        assert xs.shape == (2, 8, 6, 1)
        ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(4)
        (bx, by), = list(tfhybrid.data.shard(ds, model=model))
        np.testing.assert_array_equal(by.numpy(), y[2:4, :4])
    with pretend(2, 1, 2), pytest.raises(ValueError, match=r"labels of shape \(4, 7, 6\) "
                                                           r"cannot be split into 2 blocks"):
        label_block(np.zeros((4, 7, 6)), (2, 1))


def test_mixed_split_and_replicated_outputs():
    i = keras.Input((8, 8, 1))
    x = keras.layers.Conv2D(2, 3, padding="same", name="conv")(i)
    seg = keras.layers.Activation("softmax", name="seg")(x)
    cls = keras.layers.Dense(2, name="cls")(keras.layers.Flatten(name="flat")(x))
    tfhybrid.init()
    try:
        pmodel = tfhybrid.transform(keras.Model(i, [seg, cls]), "s")
        assert pmodel._tfhybrid_split_outputs == (True, False)
        pmodel.compile(loss=["sparse_categorical_crossentropy"] * 2)
        xs = np.ones((2, 8, 8, 1), np.float32)
        loss = pmodel.compute_loss(xs, [np.zeros((2, 8, 8)), np.zeros(2)], pmodel(xs))
        assert np.isfinite(float(loss))
    finally:
        tfhybrid.shutdown()
    yseg, ycls = np.arange(2 * 8 * 8).reshape(2, 8, 8), np.arange(2)
    with pretend(2, 1, 2):          # only the split output's labels are cut
        _, (a, b) = split_labels((xs, (yseg, ycls)), (2, 1), flags=(True, False))
        np.testing.assert_array_equal(a, yseg[:, 4:])
        np.testing.assert_array_equal(b, ycls)
        _, (a, b) = split_labels((xs, (yseg, yseg)), (2, 1), flags=(True, False))
        assert a.shape == (2, 4, 8) and b.shape == (2, 8, 8)
        _, y = split_labels((xs, {"cls": ycls, "seg": yseg}), (2, 1), flags=(True, False),
                            names=["seg", "cls"])       # labels by output name
        np.testing.assert_array_equal(y["seg"], yseg[:, 4:])
        np.testing.assert_array_equal(y["cls"], ycls)


def test_describe_counts_the_transposed_convolutions_halo():
    from tfhybrid.transformer.describe import _halo_bytes
    from tfhybrid.transformer.graph import as_functional, describe_graph

    i = keras.Input((8, 6, 2))
    x = keras.layers.Conv2DTranspose(3, 3, strides=2, padding="same", name="up3")(i)
    y = keras.layers.Conv2DTranspose(3, 2, strides=2, name="up2")(i)
    graph = describe_graph(as_functional(keras.Model(i, [x, y])))
    ctx = rules.Context("s", 2, 1, (2, 1))
    # kernel 3 / stride 2 'same': one row of the previous block; 2x2 / 2 'valid': none
    assert _halo_bytes(graph.node("up3"), 4, ctx) == 4 * 1 * 6 * 2 * 4
    assert _halo_bytes(graph.node("up2"), 4, ctx) == 0


def test_residual_add_skips_and_same_padding_transposed_convs_stay_on_blocks():
    i = keras.Input((8, 8, 8, 1))
    a = keras.layers.Conv3D(2, 3, padding="same", name="a")(i)
    b = keras.layers.MaxPooling3D(2, name="pool")(a)
    b = keras.layers.Conv3DTranspose(2, 3, strides=2, padding="same", name="up")(b)
    x = keras.layers.Add(name="skip")([a, b])
    x = keras.layers.Dropout(0.1, name="drop")(x)
    x = keras.layers.Conv3D(3, 1, activation="softmax", name="head")(x)
    plan = plan_of(keras.Model(i, x), "ds", 4, 2, spatial=(1, 1, 2))
    assert all(n.output.kind == "space" for n in plan.nodes)
    assert kinds(plan)["up"] == "spatial" and plan.split_outputs == (True,)


def test_dense_head_and_layer_norm_run_per_voxel_on_blocks():
    model = unet((16, 16, 1), filters=2, depth=2, batch_norm=False, layer_norm=True,
                 head="dense")
    plan = plan_of(model, "s", 4, 4, spatial=(2, 2))
    assert all(n.output.kind == "space" for n in plan.nodes)
    assert plan.node("head").params == {"weights": "partial"}
    assert plan.node("enc0_ln1").params == {"weights": "partial"}
    assert plan.split_outputs == (True,)
    i = keras.Input((8, 8, 2))                  # LayerNormalization over rows: gathered
    x = keras.layers.Conv2D(2, 3, padding="same", name="conv")(i)
    x = keras.layers.LayerNormalization(axis=1, name="ln_rows")(x)
    plan = plan_of(keras.Model(i, x), "s", 2, 2)
    assert plan.node("ln_rows").conversions == ("space_gather",)


def test_a_classification_head_beside_the_decoder_does_not_end_the_region():
    seg = unet((16, 16, 1), filters=2, depth=2)
    gap = keras.layers.GlobalAveragePooling2D(name="gap")(seg.get_layer("mid_relu2").output)
    cls = keras.layers.Dense(2, name="cls")(gap)
    plan = plan_of(keras.Model(seg.inputs, [seg.outputs[0], cls]), "s", 2, 2)
    # the pooling sums the blocks (one all-reduce), no gather of the feature map
    assert plan.node("gap").conversions == (None,) and kinds(plan)["gap"] == "spatial"
    assert plan.node("gap").output.kind == "replicated"
    assert kinds(plan)["dec0_conv2"] == kinds(plan)["up0"] == "spatial"
    assert plan.split_outputs == (True, False)
