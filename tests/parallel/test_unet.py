"""U-Nets under the spatial strategies: the whole encoder-decoder on blocks.

Run under ``horovodrun -np 2`` and ``-np 4``.

Layers: SpatialConv2DTranspose / SpatialConv3DTranspose against the Keras
layers on the full, identically seeded input (this rank's block of the
output and of the input gradient, kernel/bias gradients summed over the
spatial group), for strides 1 and 2, padding same/valid, halos of 0-2 rows.

Models (``unet_models``): ``tfhybrid.transform`` of a 2-D and a 3-D U-Net
(depth 2, skips by Concatenate, BatchNormalization or LayerNormalization,
transposed-convolution or nearest up-sampling, a per-voxel 1x1 convolution or
Dense + softmax head) under
``s`` (depth, height, a 2x2 grid) and ``ds``. Every layer runs on blocks
(none at full resolution); the output and the labels stay split
(``tfhybrid.data.shard`` cuts the labels). The reference is ``fit`` of the
unmodified model on the global batches in one process (rank 0 computes it,
once per run: conftest.reference_once). Compared: this rank's block of the
predictions before training (rtol 1e-5), the gathered weights after STEPS
fit steps (rtol 1e-4), and ``evaluate`` (loss and accuracy of the whole
volumes, rtol 1e-4).
"""
import keras
import numpy as np
import pytest
import tensorflow as tf

import tfhybrid
from tfhybrid.layers import SpatialConv2D, SpatialConv2DTranspose, SpatialConv3DTranspose
from tfhybrid.layers.spatial.output import label_block
from tfhybrid.spatial_geometry import TransposeGeometry
from tfhybrid.compose import transform
from tfhybrid.transformer import gather

from conftest import randn, reference_once, rng, world_size
from test_spatial_conv import check_against, grid_of_split, split_specs
from unet_models import unet

N = world_size()
STEPS, BATCH, CLASSES, LR = 2, 4, 3, 0.05
TRACED_ONLY = N >= 4

# -- the transposed convolutions against Keras -----------------------------------------

# (kernel, stride, padding): U-Net's 2/2 valid (no halo), 3/2 same, 4/2 same, 3/1 same;
# at -np 2 also 'valid' with halos (their output sizes N + 2, 2N + 2 cannot split over 4)
TRANSPOSE_CASES = [(2, 2, "valid"), (3, 2, "same"), (4, 2, "same"), (3, 1, "same")] + (
    [(3, 1, "valid"), (4, 2, "valid")] if N == 2 else [])


def _size(base, parts, kernel, stride, padding):
    for n in range(base, base + 64):
        if TransposeGeometry(n, parts, kernel, stride, padding).problem() is None:
            return n
    raise AssertionError("no valid size")


@pytest.mark.parametrize("kernel,stride,padding", TRANSPOSE_CASES, ids=str)
@pytest.mark.parametrize("spec", split_specs(2), ids=str)
def test_spatial_conv2d_transpose_matches_keras(grid_of, spec, kernel, stride, padding):
    mp, split = spec
    grid_of(mp)
    grid = grid_of_split(split, 2, mp)
    dims = [_size(6, grid[d], kernel, stride, padding) for d in range(2)]
    x = randn((2, *dims, 3), "t2d", spec, kernel, stride, padding)
    keras.utils.set_random_seed(1)
    ref = keras.layers.Conv2DTranspose(4, kernel, strides=stride, padding=padding)
    ref.build(x.shape)
    spatial = SpatialConv2DTranspose.from_layer(ref, split=split)
    check_against(ref, spatial, x, grid, ["function"] if TRACED_ONLY else ["eager"],
                  ("t2d", spec, kernel, stride, padding))


@pytest.mark.parametrize("kernel,stride,padding", [(2, 2, "valid"), (3, 2, "same")], ids=str)
@pytest.mark.parametrize("spec", split_specs(3, few=True), ids=str)
def test_spatial_conv3d_transpose_matches_keras(grid_of, spec, kernel, stride, padding):
    mp, split = spec
    grid_of(mp)
    grid = grid_of_split(split, 3, mp)
    dims = [_size(4, grid[d], kernel, stride, padding) for d in range(3)]
    x = randn((1, *dims, 2), "t3d", spec, kernel, stride, padding)
    keras.utils.set_random_seed(2)
    ref = keras.layers.Conv3DTranspose(3, kernel, strides=stride, padding=padding,
                                       activation="tanh")
    ref.build(x.shape)
    spatial = SpatialConv3DTranspose.from_layer(ref, split=split)
    check_against(ref, spatial, x, grid, ["function"], ("t3d", spec, kernel, stride, padding))


# -- U-Nets: fit and evaluate equal single-process training ----------------------------

_REFERENCES = {}


def _dataset(x, y, w=None):
    parts = (x, y) if w is None else (x, y, w)
    return tf.data.Dataset.from_tensor_slices(parts).batch(BATCH, drop_remainder=True)


def _compile(model, optimizer, eager=False):
    model.compile(optimizer=optimizer, loss="sparse_categorical_crossentropy",
                  metrics=["accuracy"], jit_compile=False, run_eagerly=eager)
    return model


def _data(shape, weights):
    x = randn((STEPS * BATCH, *shape), "unet", shape, "x")
    y = rng("unet", shape, "y").integers(0, CLASSES, size=(STEPS * BATCH, *shape[:-1]))
    w = None
    if weights == "voxel":
        w = rng("unet", shape, "w").uniform(0.2, 2.0, size=y.shape).astype(np.float32)
    elif weights == "sample":
        w = rng("unet", shape, "w").uniform(0.2, 2.0, size=(len(y),) + (1,) * (len(shape) - 1))
        w = w.astype(np.float32)    # per sample, broadcast over the voxels
    return x, y.astype(np.int32), w


def _build(shape, up, bn):
    """bn: True (BatchNormalization), False, or "layer" (LayerNormalization and a
    per-voxel Dense head instead of the 1x1 convolution)."""
    # LayerNormalization over 2 channels maps every voxel to +-1 (a gradient of ~0 that
    # float32 rounding dominates): give it 4 channels
    return unet(shape, classes=CLASSES, filters=4 if bn == "layer" else 2, depth=2, up=up,
                batch_norm=bn is True,
                layer_norm=bn == "layer", head="dense" if bn == "layer" else "conv", seed=3)


def _reference(key, shape, up, bn, data):
    """(initial weights, trained weights, evaluate results) in one process (by
    rank 0, once per run: conftest.reference_once)."""
    if key not in _REFERENCES:
        def compute():
            model = _build(shape, up, bn)
            initial = model.get_weights()
            _compile(model, keras.optimizers.SGD(LR), eager=True)   # 2 steps: cheaper than tracing
            model.fit(_dataset(*data), epochs=1, shuffle=False, verbose=0)
            results = model.evaluate(_dataset(*data), verbose=0)
            return initial, model.get_weights(), results
        _REFERENCES[key] = reference_once(compute, key, STEPS, BATCH, LR)
    return _REFERENCES[key]


# (name, input shape, up-sampling, batch norm, sample weights, strategy, mp, spatial, run).
# run: "traced" (model.fit's tf.function, as users run it) or "eager" (run_eagerly=True).
# Most cases fit eagerly: tracing and optimising a U-Net's train step with its halo and
# SyncBN collectives costs several times an eager fit of 2 steps; the traced case at
# -np 4 (without BatchNormalization, whose traced
# SyncBN is covered by test_transform_3d) covers the graph path.
UNET_CASES = {
    2: [("2d-s-height", (16, 16, 1), "transpose", False, None, "s", 2, None, "eager"),
        ("2d-s-width-halo-ln", (16, 16, 1), "transpose3", "layer", "voxel", "s", 2, "width",
         "eager"),
        ("3d-s-depth", (8, 8, 8, 1), "transpose", True, "sample", "s", 2, None, "eager"),
        ("3d-s-height-up", (8, 8, 8, 1), "upsample", False, None, "s", 2, "height", "eager")],
    4: [("2d-s-grid", (16, 16, 1), "transpose", True, "voxel", "s", 4, (2, 2), "eager"),
        ("3d-s-depth", (16, 8, 8, 1), "transpose3", False, None, "s", 4, None, "traced"),
        ("3d-ds-grid", (8, 8, 8, 1), "transpose", True, "sample", "ds", 2, (1, 2, 1),
         "eager")],
}.get(N, [])


@pytest.mark.parametrize("name,shape,up,bn,weights,strategy,mp,spatial,run", UNET_CASES,
                         ids=[c[0] for c in UNET_CASES])
def test_unet_fit_and_evaluate_equal_single_process(grid_of, name, shape, up, bn, weights,
                                                    strategy, mp, spatial, run):
    grid_of(mp)
    data = _data(shape, weights)
    initial, expected, results = _reference((shape, up, bn, weights), shape, up, bn, data)
    original = _build(shape, up, bn)
    options = {} if spatial is None else {"spatial": spatial}
    pmodel = transform(original, strategy, **options)
    full_res = [layer.name for layer in pmodel.layers if _full_resolution(layer, shape)]
    assert not full_res, f"layers at full resolution: {full_res}"
    assert pmodel._tfhybrid_split_outputs == (True,)
    _compile(pmodel, tfhybrid.DistributedOptimizer(keras.optimizers.SGD(LR)),
             eager=run == "eager")
    spatial_grid = pmodel._tfhybrid_output_grid
    x = data[0][:BATCH]
    np.testing.assert_allclose(np.asarray(pmodel(x, training=False)),   # this rank's block
                               label_block(np.asarray(original(x)), spatial_grid),
                               rtol=1e-5, atol=1e-6)
    pmodel.fit(tfhybrid.data.shard(_dataset(*data), model=pmodel), epochs=1, shuffle=False,
               verbose=0)
    got = pmodel.evaluate(tfhybrid.data.shard(_dataset(*data), model=pmodel), verbose=0)
    actual = gather(pmodel).get_weights()
    moved = max(float(np.max(np.abs(e - i))) for e, i in zip(expected, initial))
    assert moved > 1e-3, "the reference did not train: the comparison would be vacuous"
    for i, (a, e) in enumerate(zip(actual, expected)):
        np.testing.assert_allclose(a, e, rtol=1e-4, atol=1e-6, err_msg=f"weight {i}")
    np.testing.assert_allclose(got, results, rtol=1e-4, err_msg="evaluate [loss, accuracy]")
    diff = max(float(np.max(np.abs(a - e))) for a, e in zip(actual, expected))
    print(f"\n{name}: max |gathered - reference| = {diff:.2e} (largest update {moved:.2e}); "
          f"evaluate {got} vs {results}")


def _full_resolution(layer, shape):
    """True for a layer of the transformed model whose output has the full
    spatial size of the input (only the input's SpatialScatter may take it)."""
    if isinstance(layer, keras.layers.InputLayer):
        return False
    out = tuple(layer.output.shape[1:len(shape)])
    return out == tuple(shape[:-1])


def test_spatial_conv_layers_are_used(grid_of):
    """The transformed 2-D U-Net holds spatial transposed convolutions."""
    grid_of(N)
    pmodel = transform(_build((16, 16, 1), "transpose", False), "s")
    assert isinstance(pmodel.get_layer("up0"), SpatialConv2DTranspose)
    assert isinstance(pmodel.get_layer("head"), SpatialConv2D)


LOCAL_BN_CASES = [("s", 2)] if N == 2 else []


@pytest.mark.parametrize("strategy,mp", LOCAL_BN_CASES)
def test_local_batch_norm_keeps_replicas_equal_but_differs_from_single_process(
        grid_of, strategy, mp):
    """batch_norm="local": plain BatchNormalization on each rank's block (Horovod's
    per-rank statistics). gamma/beta stay identical on the ranks (their gradients
    are summed over the blocks), but training is not single-process training."""
    grid_of(mp)
    shape, up = (16, 16, 1), "transpose"
    data = _data(shape, None)
    _, expected, _ = _reference((shape, up, True, None), shape, up, True, data)
    pmodel = transform(_build(shape, up, True), strategy, batch_norm="local")
    bn = pmodel.get_layer("enc0_bn1")
    assert type(bn) is keras.layers.BatchNormalization
    _compile(pmodel, tfhybrid.DistributedOptimizer(keras.optimizers.SGD(LR)), eager=True)
    pmodel.fit(tfhybrid.data.shard(_dataset(*data), model=pmodel), epochs=1, shuffle=False,
               verbose=0)
    from tfhybrid.comm import backend
    gamma = bn.gamma.numpy()
    ranks = tfhybrid.grid().group("model").ranks
    total = backend.allreduce(tf.constant(gamma), ranks, "test.local_bn.gamma").numpy()
    np.testing.assert_allclose(total, len(ranks) * gamma, rtol=1e-6)
    actual = gather(pmodel).get_weights()
    assert max(float(np.max(np.abs(a - e))) for a, e in zip(actual, expected)) > 1e-4


def test_transposed_conv_that_does_not_split_names_the_sizes(grid_of):
    grid_of(N)
    up = SpatialConv2DTranspose(2, 3, strides=2, padding="valid", split="height", name="up")
    with pytest.raises(ValueError, match=r"'up': the input of global shape \(1, 8, 8, 1\) "
                                         r"cannot be split over the \d+x1 grid along height: "
                                         r"the output size 17 .*does not split evenly"):
        up(np.zeros((1, 8 // N, 8, 1), np.float32))


def _multitask():
    """The 2-D U-Net with a second, replicated output: a classification head on
    the bottleneck (GlobalAveragePooling gathers the blocks)."""
    seg = _build((16, 16, 1), "transpose", False)
    gap = keras.layers.GlobalAveragePooling2D(name="gap")(seg.get_layer("mid_relu2").output)
    cls = keras.layers.Dense(2, activation="softmax", name="cls")(gap)
    return keras.Model(seg.inputs, [seg.outputs[0], cls], name="multitask")


MULTITASK_CASES = [("s", 2)] if N == 2 else []


@pytest.mark.parametrize("strategy,mp", MULTITASK_CASES)
def test_split_and_replicated_outputs_train_like_single_process(grid_of, strategy, mp):
    """A per-voxel output (split, labels cut) beside a replicated one (labels whole):
    the replicated loss enters the gradient once, the blocks' losses with 1/K."""
    grid_of(mp)
    x, yseg, _ = _data((16, 16, 1), None)
    ycls = (yseg.reshape(len(yseg), -1).mean(1) > 1).astype(np.int32)
    data = tf.data.Dataset.from_tensor_slices((x, (yseg, ycls))).batch(BATCH, drop_remainder=True)
    loss = ["sparse_categorical_crossentropy"] * 2

    def compute():
        ref = _multitask()
        initial = ref.get_weights()
        ref.compile(optimizer=keras.optimizers.SGD(LR), loss=loss, run_eagerly=True)
        ref.fit(data, epochs=1, shuffle=False, verbose=0)
        return initial, ref.get_weights(), ref.evaluate(data, verbose=0)
    initial, expected, want = reference_once(compute, STEPS, BATCH, LR)
    pmodel = transform(_multitask(), strategy)
    assert pmodel._tfhybrid_split_outputs == (True, False)
    pmodel.compile(optimizer=tfhybrid.DistributedOptimizer(keras.optimizers.SGD(LR)), loss=loss,
                   run_eagerly=True)
    pmodel.fit(tfhybrid.data.shard(data, model=pmodel), epochs=1, shuffle=False, verbose=0)
    got = pmodel.evaluate(tfhybrid.data.shard(data, model=pmodel), verbose=0)
    actual = gather(pmodel).get_weights()
    assert max(float(np.max(np.abs(e - i))) for e, i in zip(expected, initial)) > 1e-3
    for i, (a, e) in enumerate(zip(actual, expected)):
        np.testing.assert_allclose(a, e, rtol=1e-4, atol=1e-6, err_msg=f"weight {i}")
    np.testing.assert_allclose(got, want, rtol=1e-4, err_msg="evaluate [loss, seg, cls]")
