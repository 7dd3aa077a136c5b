"""SpatialConv3D against keras Conv3D on the full volume (helpers: test_spatial_conv)."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfhybrid.layers import SpatialConv3D

from conftest import randn
from tests.fd_log import stderr_of
from test_spatial_conv import (check_against, check_unsplittable, grid_of_split, group_sum,
                               my_block, split_specs, valid_size)

# -- 3-D ----------------------------------------------------------------------------

CONV3D_CASES = [
    (1, 1, 1, "same"), (3, 1, 1, "same"), (3, 1, 1, "valid"), (3, 2, 1, "same"),
    (2, 2, 1, "valid"), (3, 1, 2, "same"), ((3, 1, 2), (2, 1, 1), 1, "same"),
    (5, 1, 1, "same"),
]


def _triple(v):
    return v if isinstance(v, tuple) else (v, v, v)


def check_conv3d(spec, case, modes, grid_of):
    mp, split = spec
    grid_of(mp)
    grid = grid_of_split(split, 3, mp)
    kernel, stride, dilation, padding = case
    dims = []
    for d, (kk, s, dd) in enumerate(zip(_triple(kernel), _triple(stride), _triple(dilation))):
        dims.append(valid_size((6, 5, 4)[d], grid[d], dd * (kk - 1) + 1, s, padding))
    key = ("3d", spec, case)
    conv = keras.layers.Conv3D(2, kernel, strides=stride, dilation_rate=dilation,
                               padding=padding, bias_initializer="glorot_uniform")
    conv.build((None, *map(abs, dims), 2))
    conv.set_weights([randn(v.shape, "w", i, key) for i, v in enumerate(conv.weights)])
    spatial = SpatialConv3D.from_layer(conv, split=split)
    if min(dims) < 0:
        return check_unsplittable(spatial, dims, grid, 2)
    check_against(conv, spatial, randn((1, *dims, 2), "x", key), grid, modes, key)


@pytest.mark.parametrize("case", CONV3D_CASES, ids=str)
@pytest.mark.parametrize("spec", split_specs(3), ids=str)
def test_spatial_conv3d_matches_keras(grid_of, spec, case):
    check_conv3d(spec, case, ["eager", "overlap"], grid_of)


@pytest.mark.parametrize("case", [(3, 1, 1, "same"), ((3, 1, 2), (2, 1, 1), 1, "same")],
                         ids=str)
@pytest.mark.parametrize("spec", split_specs(3), ids=str)
def test_spatial_conv3d_in_a_graph_matches_keras(grid_of, spec, case):
    check_conv3d(spec, case, ["function"], grid_of)


@pytest.mark.parametrize("case", [(3, 1, 1, "same"), (3, 2, 1, "same")], ids=str)
@pytest.mark.parametrize("spec", split_specs(3, few=True), ids=str)
def test_spatial_conv3d_beside_other_model_groups(grid_of, spec, case):
    check_conv3d(spec, case, ["eager"], grid_of)


@pytest.mark.parametrize("method", ["axis", "pairs"])
@pytest.mark.parametrize("spec", split_specs(3, few=True), ids=str)
def test_spatial_conv3d_other_halo_methods_match_keras(grid_of, spec, method):
    """The per-axis and pairwise halo methods: the block convolution
    (core.block_conv) must hand the per-axis method to core.windowed, not
    convolve the block without its halo."""
    from tfhybrid.comm import halo

    halo.set_halo_method(method)
    try:
        check_conv3d(spec, (3, 1, 1, "same"), ["eager", "function"], grid_of)
    finally:
        halo.set_halo_method(None)


@pytest.mark.parametrize("padding,overlap", [("same", False), ("same", True),
                                             ("valid", False)])
@pytest.mark.parametrize("spec", split_specs(3), ids=str)
def test_a_traced_step_keeps_tensorflows_remapper(grid_of, spec, padding, overlap):
    """TensorFlow's remapper (2.18 to 2.21) fuses a Pad feeding a Conv3D (oneDNN's padded
    convolution), then fails on any other consumer of the Pad and logs
    "remapper failed: ... fanout ... exist for missing node ... Pad", dropping
    every remapper fusion of the step. So a Pad that feeds a Conv3D feeds
    nothing else: the thin halo
    input's zeros are a Pad read by the forward convolution only (the
    backward pads the kept rows again, for the gradients alone), which the
    remapper fuses without failing; other zeros are concatenated."""
    mp, split = spec
    grid_of(mp)
    conv = keras.layers.Conv3D(4, 3, padding=padding, activation="relu")
    conv.build((None, 8, 8, 8, 3))
    spatial = SpatialConv3D.from_layer(conv, split=split, overlap=overlap)
    grid = grid_of_split(split, 3, mp)
    if padding == "valid" and 4 in grid:
        pytest.skip("8 rows: a valid output of 6 rows does not split in 4")
    x = tf.constant(np.ones((2, *(8 // g for g in grid), 3), np.float32))

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            tape.watch(x)
            loss = tf.reduce_sum(spatial(x) ** 2)
        return tape.gradient(loss, [x] + spatial.trainable_weights)
    log = stderr_of(lambda: [t.numpy() for t in step()])
    assert "remapper failed" not in log, log
    graph = step.get_concrete_function().graph

    def live_conv(op):       # a convolution whose output is read (others are pruned)
        return op.type == "Conv3D" and any(out.consumers() for out in op.outputs)
    shared = [op.name for op in graph.get_operations() if op.type in ("Pad", "PadV2")
              and any(live_conv(c) for out in op.outputs for c in out.consumers())
              and sum(len(out.consumers()) for out in op.outputs) > 1]
    assert not shared, shared


@pytest.mark.parametrize("spec", split_specs(3), ids=str)
def test_bfloat16_kernel_gradient_of_thin_blocks_is_right(grid_of, spec):
    """mixed_bfloat16 on CPU: TensorFlow 2.18's oneDNN Conv3D filter gradient of
    a block thinner than the window (2 rows under 3x3x3) comes out wrong or
    non-finite at random (a U-Net under s would train to NaN within a few
    steps). The blocks' kernel gradients summed over the spatial group equal
    float32's on the whole volume (bfloat16 rounding), every time."""
    mp, split = spec
    grid_of(mp)
    grid = grid_of_split(split, 3, mp)
    shape = (4, *[2 * g if g > 1 else 8 for g in grid], 4)   # blocks of 2 rows
    ref = keras.layers.Conv3D(8, 3, padding="same")
    ref.build((None, *shape[1:]))
    ref.set_weights([randn(v.shape, "bf16", i) for i, v in enumerate(ref.weights)])
    conv = keras.layers.Conv3D(8, 3, padding="same", dtype="mixed_bfloat16")
    conv.build((None, *shape[1:]))
    conv.set_weights(ref.get_weights())
    spatial = SpatialConv3D.from_layer(conv, split=split)
    x, u = randn(shape, "bf16-x"), randn((*shape[:-1], 8), "bf16-u")
    with tf.GradientTape() as tape:
        y = ref(x)
    want = tape.gradient(y, ref.kernel, output_gradients=u).numpy()
    xb, ub = my_block(x, grid, spatial), my_block(u, grid, spatial)
    for attempt in range(4):
        with tf.GradientTape() as tape:
            yb = spatial(xb)
        got = tape.gradient(yb, spatial.kernel, output_gradients=tf.cast(ub, yb.dtype))
        got = group_sum(tf.cast(got, tf.float32).numpy(), spatial, f"test.bf16.{attempt}")
        assert np.all(np.isfinite(got)), attempt
        np.testing.assert_allclose(got, want, atol=0.03 * np.max(np.abs(want)),
                                   err_msg=str(attempt))
