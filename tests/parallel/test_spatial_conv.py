"""SpatialConv2D against keras Conv2D on the full input.

Run under ``horovodrun -np 2`` and ``-np 4``. Every rank builds the Keras
layer, computes the reference on the full, identically seeded input, and
compares its own block of the output and of the input gradient, and the
kernel/bias gradients after summing the partial gradients over the spatial
group (as the DistributedOptimizer does for ``partial`` layouts). Sizes are
the smallest valid ones at or above a base size, so odd and non-square
sizes occur wherever they split.

The helpers here are shared by the other ``test_spatial_*`` files.
"""
import keras
import numpy as np
import pytest
import tensorflow as tf

import tfhybrid
from tfhybrid.comm import backend
from tfhybrid.layers import SpatialConv2D
from tfhybrid.spatial_geometry import AxisGeometry
from tfhybrid.layout import layout_of

from conftest import randn, world_size

FWD = dict(rtol=1e-5, atol=1e-5)
GRAD = dict(rtol=1e-4, atol=1e-4)


# -- helpers (also used by test_spatial_pool / test_spatial_cnn) ------------------

def split_specs(ndim, few=False):
    """(model_parallel, split) pairs this world size runs.

    -np 2: both single-axis splits over 2 ranks. -np 4: the first axis over
    4 ranks and a 2x2 grid (``few``: the first axis over 2 ranks, i.e. two
    model groups side by side, instead).
    """
    names = {2: ["height", "width"], 3: ["depth", "height"]}[ndim]
    grid = {2: (2, 2), 3: (1, 2, 2)}[ndim]
    if world_size() == 2:
        return [(2, names[0]), (2, names[1])]
    if world_size() == 4:
        return [(2, names[0])] if few else [(4, names[0]), (4, grid)]
    return []


def grid_of_split(split, ndim, k):
    names = {2: ("height", "width"), 3: ("depth", "height", "width")}[ndim]
    if isinstance(split, str):
        return tuple(k if n == split else 1 for n in names)
    return tuple(split)


def valid_size(base, parts, window, stride, padding):
    """Smallest size >= base that this window op can split over ``parts``.

    When none exists (e.g. a 3-wide 'valid' window over 4 ranks: the output
    N - 2 and N cannot both divide by 4), a size that splits the input but
    not the output, negated, so callers can check the ValueError instead.
    """
    geom = AxisGeometry(base, parts, window, stride, padding)
    if geom.problem() is None:
        return base
    above = geom.nearest_valid()[1]
    return above if above is not None else -(base + (-base) % parts)


def check_unsplittable(spatial, dims, grid, channels):
    """A block whose global size admits no even output split raises ValueError."""
    block = [abs(n) // k for n, k in zip(dims, grid)]
    with pytest.raises(ValueError, match="does not split evenly over") as err:
        spatial(np.zeros((1, *block, channels), np.float32))
    assert "Nearest valid global" in str(err.value) and "none found" in str(err.value)


def my_block(a, grid, layer):
    """This rank's block of a full (batch, spatial..., channels) array."""
    for d, g in enumerate(layer._spatial_groups()):
        a = np.split(a, grid[d], axis=d + 1)[g.index]
    return a


def group_sum(t, layer, name):
    """Sum a partial gradient over the layer's spatial group."""
    ranks = tfhybrid.grid().group(layer.group).ranks
    if len(ranks) == 1:
        return np.asarray(t)
    return backend.allreduce(tf.convert_to_tensor(t), ranks, name).numpy()


def forward_backward(layer, x, u, mode):
    """(y, dL/dx, [dL/dw...]) for L = sum(layer(x) * u).

    ``mode``: "eager" (single op on the halo-extended block), "overlap"
    (eager, interior/boundary decomposition forced) or "function" (graph,
    overlapped as in model.fit).
    """
    if hasattr(layer, "split"):   # a spatial layer: force the path under test
        layer.overlap, layer._eager_overlap = mode != "eager", mode == "overlap"

    def step(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = layer(x)
            loss = tf.reduce_sum(y * u)
        grads = tape.gradient(loss, [x] + list(layer.trainable_variables))
        return y, grads[0], grads[1:]
    if mode == "function":
        step = tf.function(step)
    y, dx, dw = step(tf.constant(x))
    return y.numpy(), dx.numpy(), [g.numpy() for g in dw]


def check_against(reference, spatial, x, grid, modes, key):
    """Compare ``spatial`` on this rank's block with ``reference`` on ``x``.

    ``modes``: the execution modes of :func:`forward_backward` to check.
    """
    u = randn(reference.compute_output_shape(x.shape), "u", key)
    y_ref, dx_ref, dw_ref = forward_backward(reference, x, u, "eager")
    for mode in modes:
        y, dx, dw = forward_backward(spatial, my_block(x, grid, spatial),
                                     my_block(u, grid, spatial), mode)
        np.testing.assert_allclose(y, my_block(y_ref, grid, spatial), **FWD, err_msg=mode)
        np.testing.assert_allclose(dx, my_block(dx_ref, grid, spatial), **GRAD, err_msg=mode)
        for i, (g, g_ref) in enumerate(zip(dw, dw_ref)):
            np.testing.assert_allclose(group_sum(g, spatial, f"test.dw{i}"), g_ref, **GRAD,
                                       err_msg=mode)


# -- 2-D ----------------------------------------------------------------------------

# (kernel, stride, dilation, padding)
CONV2D_CASES = [
    (1, 1, 1, "valid"), (1, 2, 1, "same"), (2, 1, 1, "same"), (2, 2, 1, "valid"),
    (3, 1, 1, "same"), (3, 1, 1, "valid"), (3, 2, 1, "same"), (3, 2, 1, "valid"),
    (3, 1, 2, "same"), (4, 2, 1, "same"), (5, 1, 1, "same"), (5, 2, 1, "same"),
    (5, 1, 2, "valid"), (6, 1, 1, "same"), (7, 1, 1, "same"), (7, 2, 1, "valid"),
    ((3, 5), (2, 1), 1, "same"), ((5, 2), 1, (1, 2), "valid"),
]


def _pair(v):
    return v if isinstance(v, tuple) else (v, v)


def conv_input_shape(case, grid, base):
    kernel, stride, dilation, padding = case
    dims = []
    for d, (kk, s, dd) in enumerate(zip(_pair(kernel), _pair(stride), _pair(dilation))):
        window = dd * (kk - 1) + 1
        dims.append(valid_size(base[d], grid[d], window, s, padding))
    return dims


def check_conv2d(spec, case, modes, grid_of):
    mp, split = spec
    grid_of(mp)
    grid = grid_of_split(split, 2, mp)
    kernel, stride, dilation, padding = case
    h, w = conv_input_shape(case, grid, (9, 7))
    key = (spec, case)
    conv = keras.layers.Conv2D(3, kernel, strides=stride, dilation_rate=dilation,
                               padding=padding, bias_initializer="glorot_uniform")
    conv.build((None, abs(h), abs(w), 2))
    conv.set_weights([randn(v.shape, "w", i, key) for i, v in enumerate(conv.weights)])
    spatial = SpatialConv2D.from_layer(conv, split=split)
    if min(h, w) < 0:
        return check_unsplittable(spatial, (h, w), grid, 2)
    check_against(conv, spatial, randn((2, h, w, 2), "x", key), grid, modes, key)


@pytest.mark.parametrize("case", CONV2D_CASES, ids=str)
@pytest.mark.parametrize("spec", split_specs(2), ids=str)
def test_spatial_conv2d_matches_keras(grid_of, spec, case):
    check_conv2d(spec, case, ["eager", "overlap"], grid_of)


GRAPH_CASES = [(3, 1, 1, "same"), (3, 2, 1, "valid"), (5, 1, 2, "valid"),
               ((3, 5), (2, 1), 1, "same")]


@pytest.mark.parametrize("case", GRAPH_CASES, ids=str)
@pytest.mark.parametrize("spec", split_specs(2), ids=str)
def test_spatial_conv2d_in_a_graph_matches_keras(grid_of, spec, case):
    check_conv2d(spec, case, ["function"], grid_of)


@pytest.mark.parametrize("case", CONV2D_CASES[4:10], ids=str)
@pytest.mark.parametrize("spec", split_specs(2, few=True), ids=str)
def test_spatial_conv2d_beside_other_model_groups(grid_of, spec, case):
    check_conv2d(spec, case, ["eager", "overlap"], grid_of)


# -- layouts, activation, round trip --------------------------------------------------

def test_weights_are_partial_over_the_group_and_activation_applies(grid_of):
    grid_of(2)
    conv = keras.layers.Conv2D(4, 3, padding="same", activation="relu")
    conv.build((None, 8, 6, 3))
    conv.set_weights([randn(v.shape, "w", i, "act") for i, v in enumerate(conv.weights)])
    spatial = SpatialConv2D.from_layer(conv, split="height")
    assert [layout_of(v).kind for v in spatial.trainable_variables] == ["partial", "partial"]
    assert {layout_of(v).group for v in spatial.trainable_variables} == {"model"}
    check_against(conv, spatial, randn((2, 8, 6, 3), "x", "act"), (2, 1), ["eager", "function"],
                  "act")
    plain = spatial.to_layer()
    assert type(plain) is keras.layers.Conv2D
    for a, b in zip(plain.get_weights(), conv.get_weights()):
        np.testing.assert_array_equal(a, b)


def test_symbolic_call_gives_the_block_shape(grid_of):
    grid_of(2)
    x = keras.Input((8, 10, 3))
    y = SpatialConv2D(5, 3, strides=2, padding="same", split="height")(x)
    assert tuple(y.shape) == (None, 4, 5, 5)
