"""Spatial pooling, SpatialScatter and SpatialGather against Keras on the full input.

Run under ``horovodrun -np 2`` and ``-np 4`` (helpers: test_spatial_conv).
Max pooling inputs are shifted negative so that a zero-padded halo would
beat real values under ``same`` padding.
"""
import keras
import numpy as np
import pytest

from tfhybrid.layers import (SpatialAveragePooling2D, SpatialAveragePooling3D,
                             SpatialGather, SpatialMaxPooling2D, SpatialMaxPooling3D,
                             SpatialScatter)

from conftest import randn
from test_spatial_conv import (FWD, GRAD, check_against, check_unsplittable, forward_backward,
                               grid_of_split, my_block, split_specs, valid_size)

POOLS = {
    (2, "max"): (keras.layers.MaxPooling2D, SpatialMaxPooling2D),
    (2, "average"): (keras.layers.AveragePooling2D, SpatialAveragePooling2D),
    (3, "max"): (keras.layers.MaxPooling3D, SpatialMaxPooling3D),
    (3, "average"): (keras.layers.AveragePooling3D, SpatialAveragePooling3D),
}

# (pool_size, strides, padding)
POOL2D_CASES = [(2, None, "valid"), (3, 2, "same"), (3, 1, "same"), (2, 1, "valid"),
                ((3, 2), (2, 1), "same"), (3, 2, "valid"), (2, 2, "same")]
POOL3D_CASES = [(2, None, "valid"), (3, 2, "same"), (3, 1, "same")]


def _tuple(v, n):
    return v if isinstance(v, tuple) else (v,) * n


def check_pool(ndim, kind, spec, case, modes, grid_of):
    mp, split = spec
    grid_of(mp)
    grid = grid_of_split(split, ndim, mp)
    pool_size, strides, padding = case
    sizes = _tuple(pool_size, ndim)
    steps = sizes if strides is None else _tuple(strides, ndim)
    base = (9, 7) if ndim == 2 else (6, 5, 4)
    dims = [valid_size(base[d], grid[d], sizes[d], steps[d], padding) for d in range(ndim)]
    keras_cls, spatial_cls = POOLS[ndim, kind]
    reference = keras_cls(pool_size, strides=strides, padding=padding)
    spatial = spatial_cls(pool_size, strides=strides, padding=padding, split=split)
    key = (ndim, kind, spec, case)
    if min(dims) < 0:
        return check_unsplittable(spatial, dims, grid, 3)
    x = randn((2, *dims, 3), "x", key) - (3.0 if kind == "max" else 0.0)
    check_against(reference, spatial, x, grid, modes, key)


@pytest.mark.parametrize("kind", ["max", "average"])
@pytest.mark.parametrize("case", POOL2D_CASES, ids=str)
@pytest.mark.parametrize("spec", split_specs(2), ids=str)
def test_spatial_pooling2d_matches_keras(grid_of, spec, case, kind):
    check_pool(2, kind, spec, case, ["eager", "overlap"], grid_of)


@pytest.mark.parametrize("kind", ["max", "average"])
@pytest.mark.parametrize("case", POOL3D_CASES, ids=str)
@pytest.mark.parametrize("spec", split_specs(3), ids=str)
def test_spatial_pooling3d_matches_keras(grid_of, spec, case, kind):
    check_pool(3, kind, spec, case, ["eager", "overlap"], grid_of)


@pytest.mark.parametrize("kind", ["max", "average"])
@pytest.mark.parametrize("spec", split_specs(2) + split_specs(2, few=True), ids=str)
def test_spatial_pooling_in_a_graph_matches_keras(grid_of, spec, kind):
    check_pool(2, kind, spec, (3, 2, "same"), ["function"], grid_of)


# -- scatter / gather ------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["eager", "function"])
@pytest.mark.parametrize("ndim", [2, 3])
@pytest.mark.parametrize("few", [False, True])
def test_scatter_then_gather_round_trip(grid_of, ndim, few, mode):
    for mp, split in split_specs(ndim, few):
        grid_of(mp)
        grid = grid_of_split(split, ndim, mp)
        dims = (8, 12) if ndim == 2 else (4, 6, 2)
        full = randn((2, *dims, 3), "full", ndim, split)
        u = randn(full.shape, "u", ndim, split)
        scatter, gather = SpatialScatter(split=split), SpatialGather(split=split)
        scatter.build(full.shape)
        gather.build(full.shape)
        # scatter: block of the input; its gradient is the full upstream on every rank
        y, dx, _ = forward_backward(scatter, full, my_block(u, grid, scatter), mode)
        np.testing.assert_allclose(y, my_block(full, grid, scatter), **FWD)
        np.testing.assert_allclose(dx, u, **GRAD)
        # gather: full tensor; the gradient of the block is its block of the upstream
        y, dx, _ = forward_backward(gather, my_block(full, grid, gather), u, mode)
        np.testing.assert_allclose(y, full, **FWD)
        np.testing.assert_allclose(dx, my_block(u, grid, gather), **GRAD)
        assert scatter.compute_output_shape(full.shape) == my_block(full, grid, scatter).shape
        assert gather.compute_output_shape(y.shape[:1] + dx.shape[1:]) == full.shape


def test_scatter_rejects_sizes_that_do_not_split(grid_of):
    for mp, split in split_specs(2)[:1]:
        grid_of(mp)
        with pytest.raises(ValueError) as err:
            SpatialScatter(split=split, name="scatter_in")(keras.Input((9, 8, 3)))
        msg = str(err.value)
        k = mp
        lower, upper = 9 - 9 % k, 9 - 9 % k + k
        for part in ("scatter_in", "(None, 9, 8, 3)", f"{k}x1", "height=9",
                     f"{lower} or {upper}" if lower else f"{upper}"):
            assert part in msg, (part, msg)
