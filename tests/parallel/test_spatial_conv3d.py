"""SpatialConv3D against keras Conv3D on the full volume (helpers: test_spatial_conv)."""
import keras
import pytest

from tfhybrid.layers import SpatialConv3D

from conftest import randn
from test_spatial_conv import (check_against, check_unsplittable, grid_of_split, split_specs,
                               valid_size)

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
