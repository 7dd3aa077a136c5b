"""Encoder-decoder variants under s/ds that unet_models.py does not build.

Run under ``horovodrun -np 2`` and ``-np 4``.

Models (plain Keras, built here): a 2-D U-Net whose decoder up-samples with
nearest UpSampling2D and dilated 3x3 convolutions, joins the skip by
``Concatenate(axis=3)`` in reversed order ([skip, decoder]), ReLU/LeakyReLU
layers, BatchNormalization with axis=-1/3 and other momenta, Dropout(0),
seeded SpatialDropout2D/3D (same channel mask on every block of a sample),
GroupNormalization (SpatialGroupNormalization on blocks); a
LinkNet/attention 2-D net (residual ``Add`` decoders, an attention gate
``Multiply(skip, sigmoid(conv1x1(...)))``, a Softmax layer); a 3-D U-Net of
depth 3 with regularised transposed convolutions and a GroupNormalization; a 3-D net with three outputs
(per-voxel segmentation split, a binary head and a regression head on
GlobalAveragePooling3D, replicated) with weight and activity regularisers on
split and replicated layers.

Losses and metrics: a class-weighted custom loss, ``reduction="sum"`` and
``"mean_with_sample_weight"`` with per-voxel sample weights, loss_weights,
accuracy, MeanIoU, and count metrics (TruePositives/FalseNegatives) on a
replicated output beside the split one.

The reference is ``fit`` of the unmodified model in one process on the global
batches (rank 0 computes it, once per run: conftest.reference_once). Compared:
the gathered weights after STEPS fit steps (rtol 1e-4), ``evaluate`` (every
loss and metric, rtol 1e-4), and ``predict`` (every output whole: the split
output's blocks are put together as one process predicts them).
"""
import keras
import numpy as np
import pytest
import tensorflow as tf

import tfhybrid
from tfhybrid.layers.spatial.output import label_block
from tfhybrid.compose import transform
from tfhybrid.transformer import gather

from conftest import randn, reference_once, rng, world_size

N = world_size()
STEPS, BATCH, CLASSES = 2, 4, 3
L = keras.layers


def _conv(x, filters, name, ndim=2, dilation=1, bn=None, act="relu", **kwargs):
    conv = L.Conv3D if ndim == 3 else L.Conv2D
    x = conv(filters, 3, padding="same", dilation_rate=dilation, name=name, **kwargs)(x)
    if bn is not None:
        x = L.BatchNormalization(name=f"{name}_bn", **bn)(x)
    if act == "relu":
        return L.ReLU(name=f"{name}_relu")(x)
    return L.LeakyReLU(0.1, name=f"{name}_lrelu")(x)


def upsample_dilated(shape=(16, 16, 1)):
    """UpSampling2D + dilated convolutions, Concatenate(axis=3) as [skip, decoder]."""
    i = keras.Input(shape, name="image")
    e0 = _conv(i, 4, "e0", bn={"axis": -1, "momentum": 0.9})
    x = L.MaxPooling2D(2, name="pool")(e0)
    x = _conv(x, 8, "e1", dilation=2, act="leaky", bn={"axis": 3, "momentum": 0.5,
                                                        "epsilon": 1e-2})
    x = L.UpSampling2D(2, name="up")(x)
    x = _conv(x, 4, "up_conv", dilation=2)
    x = L.Concatenate(axis=3, name="skip")([e0, x])
    x = L.Dropout(0.0, name="drop")(x)
    x = _conv(x, 4, "d0", act="leaky")
    x = L.GroupNormalization(groups=2, name="d0_gn")(x)
    return keras.Model(i, L.Conv2D(CLASSES, 1, activation="softmax", name="head")(x))


def linknet_attention(shape=(16, 16, 1), drop=False):
    """Residual Add decoders (LinkNet) and an attention gate on the first skip;
    ``drop``: a seeded SpatialDropout2D on the bottleneck (under s every block of a
    sample draws the same channel mask as one process with that seed)."""
    i = keras.Input(shape, name="image")
    e0 = _conv(i, 4, "e0")
    e1 = _conv(L.MaxPooling2D(2, name="pool0")(e0), 8, "e1")
    m = _conv(L.MaxPooling2D(2, name="pool1")(e1), 8, "mid")
    if drop:
        m = L.SpatialDropout2D(0.5, seed=5, name="mid_drop")(m)
    x = L.Conv2DTranspose(8, 3, strides=2, padding="same", name="up1")(m)
    x = L.Activation("relu", name="d1_relu")(L.Add(name="res1")([e1, x]))
    up = L.Conv2DTranspose(4, 2, strides=2, name="up0")(x)
    g = L.Conv2D(4, 1, name="gate_g")(up)
    s = L.Conv2D(4, 1, name="gate_s")(e0)
    a = L.Conv2D(1, 1, activation="sigmoid", name="psi")(
        L.Activation("relu", name="gate_relu")(L.Add(name="gate_add")([g, s])))
    x = L.Add(name="res0")([up, L.Multiply(name="gate")([e0, a])])
    return keras.Model(i, L.Softmax(name="softmax")(L.Conv2D(CLASSES, 1, name="head")(x)))


def unet3d_depth3(shape=(8, 16, 16, 1)):
    """Depth 3 (three poolings), Conv3DTranspose up-sampling with an L2 regulariser."""
    reg = keras.regularizers.L2(0.05)
    i = keras.Input(shape, name="volume")
    x, skips = i, []
    for level in range(3):
        x = _conv(x, 2 * 2 ** level, f"e{level}", ndim=3, bn={"momentum": 0.8})
        skips.append(x)
        x = L.MaxPooling3D(2, name=f"pool{level}")(x)
    x = _conv(x, 8, "mid", ndim=3)
    x = L.GroupNormalization(groups=4, epsilon=1e-3, name="mid_gn")(x)
    x = L.SpatialDropout3D(0.3, seed=11, name="mid_drop")(x)
    for level in reversed(range(3)):
        x = L.Conv3DTranspose(2 * 2 ** level, 2, strides=2, name=f"up{level}",
                              kernel_regularizer=reg)(x)
        x = L.Concatenate(axis=-1, name=f"skip{level}")([x, skips[level]])
        x = _conv(x, 2 * 2 ** level, f"d{level}", ndim=3)
    return keras.Model(i, L.Conv3D(CLASSES, 1, activation="softmax", name="head")(x))


def three_heads(shape=(8, 8, 8, 1)):
    """Segmentation (split) + binary and regression heads on GAP3D (replicated),
    with weight regularisers on both kinds of layer and activity regularisers."""
    r = keras.regularizers.L2(0.05)
    i = keras.Input(shape, name="volume")
    e0 = L.Conv3D(4, 3, padding="same", activation="relu", name="e0", kernel_regularizer=r,
                  activity_regularizer=keras.regularizers.L1(0.01))(i)
    e1 = L.Conv3D(4, 3, padding="same", name="e1")(L.MaxPooling3D(2, name="pool")(e0))
    e1 = L.ActivityRegularization(l2=0.02, name="act")(e1)
    g = L.GlobalAveragePooling3D(name="gap")(e1)
    g = L.Dense(4, activation="relu", name="fc", kernel_regularizer=r, bias_regularizer=r)(g)
    cls = L.Dense(1, activation="sigmoid", name="cls")(g)
    value = L.Dense(2, name="value", kernel_regularizer=keras.regularizers.L1(0.02),
                    activity_regularizer=keras.regularizers.L2(0.1))(g)
    x = L.Concatenate(name="skip")([L.Conv3DTranspose(4, 2, strides=2, name="up")(e1), e0])
    seg = L.Conv3D(CLASSES, 1, activation="softmax", name="seg", kernel_regularizer=r)(x)
    return keras.Model(i, [seg, cls, value], name="three_heads")


def class_weighted(y_true, y_pred):
    weights = tf.gather(tf.constant([1.0, 2.0, 0.5]), tf.cast(y_true, tf.int32))
    return keras.losses.sparse_categorical_crossentropy(y_true, y_pred) * weights


def _compile_args(kind):
    """(loss, loss_weights, metrics, weighted, learning rate) of a compile variant."""
    if kind == "class-weighted":
        return (class_weighted, None,
                ["accuracy", keras.metrics.MeanIoU(CLASSES, sparse_y_pred=False)], None, 0.05)
    if kind == "sum":            # a sum over ~1000 voxels: a smaller step
        return (keras.losses.SparseCategoricalCrossentropy(reduction="sum"), None, ["accuracy"],
                None, 2e-4)
    if kind == "mean-weighted":
        return (keras.losses.SparseCategoricalCrossentropy(reduction="mean_with_sample_weight"),
                None, ["accuracy"], "voxel", 0.05)
    if kind == "three":
        return ([keras.losses.SparseCategoricalCrossentropy(reduction="sum"),
                 "binary_crossentropy", keras.losses.MeanSquaredError()], [0.01, 1.0, 0.5],
                [["accuracy"], ["accuracy", keras.metrics.TruePositives(),
                                keras.metrics.FalseNegatives()], ["mae"]], "voxel", 0.05)
    return "sparse_categorical_crossentropy", None, ["accuracy"], None, 0.05


def _data(model, weighted):
    n = STEPS * BATCH
    key = (model.name,)
    x = randn((n, *model.inputs[0].shape[1:]), "variants", *key)
    ys = []
    for j, out in enumerate(model.outputs):
        g = rng("variants", *key, j)
        if len(out.shape) > 2:
            ys.append(g.integers(0, CLASSES, size=(n, *out.shape[1:-1])).astype(np.int32))
        elif out.shape[-1] == 1:
            ys.append((g.normal(size=(n, 1)) > 0).astype(np.float32))
        else:
            ys.append(g.normal(size=(n, out.shape[-1])).astype(np.float32))
    w = None
    if weighted == "voxel":
        w = rng("variants", *key, "w").uniform(0.2, 2.0, size=ys[0].shape).astype(np.float32)
        if len(ys) > 1:
            w = (w,) + tuple(np.ones(n, np.float32) for _ in ys[1:])
    return x, (ys[0] if len(ys) == 1 else tuple(ys)), w


def _dataset(x, y, w):
    parts = (x, y) if w is None else (x, y, w)
    return tf.data.Dataset.from_tensor_slices(parts).batch(BATCH, drop_remainder=True)


def _compile(model, optimizer, kind, eager):
    loss, loss_weights, metrics, _, _ = _compile_args(kind)
    model.compile(optimizer=optimizer, loss=loss, loss_weights=loss_weights, metrics=metrics,
                  jit_compile=False, run_eagerly=eager)


BUILDERS = {"upsample_dilated": upsample_dilated, "linknet_attention": linknet_attention,
            "linknet_attention_drop": lambda: linknet_attention(drop=True),
            "unet3d_depth3": unet3d_depth3, "three_heads": three_heads}

# (name, builder, compile variant, strategy, mp, spatial, run)
CASES = {
    2: [("upsample-dilated-classweighted-miou", "upsample_dilated", "class-weighted", "s", 2,
         None, "eager"),
        ("linknet-attention-sum", "linknet_attention", "sum", "s", 2, "width", "eager"),
        ("linknet-attention-meanweighted", "linknet_attention", "mean-weighted", "s", 2, None,
         "eager"),
        ("linknet-spatialdropout", "linknet_attention_drop", "plain", "s", 2, "height",
         "eager"),
        ("three-heads-depth", "three_heads", "three", "s", 2, None, "eager")],
    4: [("unet3d-depth3-grid", "unet3d_depth3", "plain", "s", 4, (1, 2, 2), "traced"),
        ("three-heads-ds", "three_heads", "three", "ds", 2, (1, 2, 1), "eager"),
        ("linknet-attention-meanweighted-ds", "linknet_attention", "mean-weighted", "ds", 2,
         None, "eager"),
        ("upsample-dilated-ds", "upsample_dilated", "class-weighted", "ds", 2, "width",
         "eager"),
        ("linknet-attention-grid", "linknet_attention", "mean-weighted", "s", 4, (2, 2),
         "eager")],
}.get(N, [])


@pytest.mark.parametrize("name,builder,kind,strategy,mp,spatial,run", CASES,
                         ids=[c[0] for c in CASES])
def test_variant_trains_evaluates_and_predicts_like_single_process(
        grid_of, name, builder, kind, strategy, mp, spatial, run):
    grid_of(mp)
    build = BUILDERS[builder]
    _, _, _, weighted, lr = _compile_args(kind)

    def compute():      # the data too: it is drawn by the reference model's name and shapes
        keras.utils.set_random_seed(3)
        ref = build()
        data = _data(ref, weighted)
        initial = ref.get_weights()
        _compile(ref, keras.optimizers.SGD(lr), kind, eager=True)
        ref.fit(_dataset(*data), epochs=1, shuffle=False, verbose=0)
        want_eval = ref.evaluate(_dataset(*data), verbose=0)
        want_pred = ref.predict(data[0][:BATCH], verbose=0)
        return data, initial, ref.get_weights(), want_eval, want_pred
    data, initial, expected, want_eval, want_pred = reference_once(compute, builder, kind,
                                                                   STEPS, BATCH)
    keras.utils.set_random_seed(3)
    pmodel = transform(build(), strategy, **({} if spatial is None else {"spatial": spatial}))
    flags = pmodel._tfhybrid_split_outputs
    assert flags[0] and not any(flags[1:]), flags
    for layer in pmodel.layers:     # GroupNormalization runs on blocks
        assert type(layer) is not keras.layers.GroupNormalization, layer.name
    _compile(pmodel, tfhybrid.DistributedOptimizer(keras.optimizers.SGD(lr)), kind,
             eager=run == "eager")
    pmodel.fit(tfhybrid.data.shard(_dataset(*data), model=pmodel), epochs=1, shuffle=False,
               verbose=0)
    got_eval = pmodel.evaluate(tfhybrid.data.shard(_dataset(*data), model=pmodel), verbose=0)
    got_pred = pmodel.predict(data[0][:BATCH], verbose=0)
    actual = gather(pmodel).get_weights()
    moved = max(float(np.max(np.abs(e - i))) for e, i in zip(expected, initial))
    assert moved > 1e-3, "the reference did not train: the comparison would be vacuous"
    for i, (a, e) in enumerate(zip(actual, expected)):
        np.testing.assert_allclose(a, e, rtol=1e-4, atol=1e-6, err_msg=f"weight {i}")
    np.testing.assert_allclose(got_eval, want_eval, rtol=1e-4, atol=1e-7,
                               err_msg=f"evaluate {pmodel.metrics_names}")
    grid = pmodel._tfhybrid_output_grid
    got_pred, want_pred = tf.nest.flatten(got_pred), tf.nest.flatten(want_pred)
    for j, (g, w) in enumerate(zip(got_pred, want_pred)):
        assert g.shape == w.shape, (j, g.shape, w.shape, grid)
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-6, err_msg=f"predict output {j}")
    diff = max(float(np.max(np.abs(a - e) / (np.abs(e) + 1e-3))) for a, e in zip(actual,
                                                                                expected))
    print(f"\n{name}: max relative |gathered - reference| = {diff:.1e} (largest update "
          f"{moved:.1e}); evaluate {np.round(got_eval, 6).tolist()}")


VOLUME_CASES = {2: [("s", 2, None)], 4: [("ds", 2, (1, 2, 1))]}.get(N, [])


@pytest.mark.parametrize("strategy,mp,spatial", VOLUME_CASES)
def test_volumes_feed_a_model_of_several_outputs(grid_of, tmp_path, strategy, mp, spatial):
    """tfhybrid.data.volumes with a tuple of label sources (per-voxel labels of the
    split output read as blocks, the heads' labels whole) and a tuple of weights
    (per voxel for the split output, read as blocks; per sample for the heads),
    x from a directory of per-sample files: training equals single-process fit."""
    grid_of(mp)

    def compute():      # the data too: it is drawn by the reference model's name and shapes
        keras.utils.set_random_seed(3)
        ref = three_heads()
        x, y, _ = _data(ref, None)
        g = rng("variants", "volume-weights")
        w = (g.uniform(0.2, 2.0, size=y[0].shape).astype(np.float32),
             g.uniform(0.2, 2.0, size=len(x)).astype(np.float32))
        w = (w[0], w[1], w[1])
        _compile(ref, keras.optimizers.SGD(0.05), "three", eager=True)
        ref.fit(_dataset(x, y, w), epochs=1, shuffle=False, verbose=0)
        return x, y, w, ref.get_weights()
    x, y, w, expected = reference_once(compute, STEPS, BATCH)
    (tmp_path / "x").mkdir()
    for i, sample in enumerate(x):
        np.save(tmp_path / "x" / f"{i:03d}.npy", sample)
    paths = []
    for j, labels in enumerate(y):
        np.save(tmp_path / f"y{j}.npy", labels)
        paths.append(str(tmp_path / f"y{j}.npy"))
    np.save(tmp_path / "wv.npy", w[0])
    np.save(tmp_path / "ws.npy", w[1])
    weights = (str(tmp_path / "wv.npy"), str(tmp_path / "ws.npy"), str(tmp_path / "ws.npy"))
    keras.utils.set_random_seed(3)
    pmodel = transform(three_heads(), strategy, **({} if spatial is None else
                                                   {"spatial": spatial}))
    _compile(pmodel, tfhybrid.DistributedOptimizer(keras.optimizers.SGD(0.05)), "three",
             eager=True)
    data = tfhybrid.data.volumes(str(tmp_path / "x"), tuple(paths), batch_size=BATCH,
                                 model=pmodel, sample_weight=weights)
    xb, (seg, cls, value), (wv, ws, _) = next(iter(data))
    grid = pmodel._tfhybrid_output_grid
    assert seg.shape[1:] == label_block(y[0][:1], grid).shape[1:] == wv.shape[1:]
    assert cls.shape[1:] == (1,) and len(ws.shape) == 1
    pmodel.fit(data, epochs=1, shuffle=False, verbose=0)
    for i, (a, e) in enumerate(zip(gather(pmodel).get_weights(), expected)):
        np.testing.assert_allclose(a, e, rtol=1e-4, atol=1e-6, err_msg=f"weight {i}")


ACTIVITY_CASES = {2: [("s", 2, None)], 4: [("ds", 2, None)]}.get(N, [])


@pytest.mark.parametrize("strategy,mp,spatial", ACTIVITY_CASES)
def test_activity_regulariser_on_blocks_of_a_gathered_model(grid_of, strategy, mp, spatial):
    """An activity regulariser on a convolution of the spatial region of a model
    whose output is gathered (a classifier): the loss of evaluate holds every
    block's share (before: only this rank's block), training equals one process."""
    grid_of(mp)

    def build():
        keras.utils.set_random_seed(4)
        i = keras.Input((8, 8, 1))
        x = L.Conv2D(4, 3, padding="same", activation="relu", name="conv",
                     activity_regularizer=keras.regularizers.L2(0.05))(i)
        x = L.Flatten(name="flat")(L.MaxPooling2D(2, name="pool")(x))
        return keras.Model(i, L.Dense(CLASSES, activation="softmax", name="out")(x))

    x = randn((STEPS * BATCH, 8, 8, 1), "activity", "x")
    y = rng("activity", "y").integers(0, CLASSES, size=STEPS * BATCH).astype(np.int32)

    def compute():
        ref = build()
        ref.compile(keras.optimizers.SGD(0.1), loss="sparse_categorical_crossentropy",
                    run_eagerly=True)
        ref.fit(_dataset(x, y, None), epochs=1, shuffle=False, verbose=0)
        return ref.get_weights(), ref.evaluate(_dataset(x, y, None), verbose=0)
    expected, want = reference_once(compute, x, y, BATCH)
    pmodel = transform(build(), strategy)
    pmodel.compile(tfhybrid.DistributedOptimizer(keras.optimizers.SGD(0.1)),
                   loss="sparse_categorical_crossentropy", run_eagerly=True)
    pmodel.fit(tfhybrid.data.shard(_dataset(x, y, None), model=pmodel), epochs=1,
               shuffle=False, verbose=0)
    got = pmodel.evaluate(tfhybrid.data.shard(_dataset(x, y, None), model=pmodel), verbose=0)
    for i, (a, e) in enumerate(zip(gather(pmodel).get_weights(), expected)):
        np.testing.assert_allclose(a, e, rtol=1e-4, atol=1e-6, err_msg=f"weight {i}")
    np.testing.assert_allclose(got, want, rtol=1e-4, err_msg="evaluate loss")
