"""The block convolution's decomposition in one process (no collectives):
``conv(block, "same")`` plus the thin ``valid`` convolutions of the halo pieces
(``core._corrections``) equals the rows of the plain Keras convolution of the
whole input that each block of a grid owns, for every rank, kernel, stride and
dilation that ``block_conv_possible`` accepts; and it refuses the geometries
whose block padding differs from the rows a rank needs. The exchange itself
and the gradients are checked under horovodrun (tests/parallel/test_spatial_conv*.py).
"""
import os

import numpy as np
import pytest
import tensorflow as tf

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from keras import ops

from tfhybrid import spatial_geometry as sp
from tfhybrid.comm import halo
from tfhybrid.layers.spatial import core


def _plans(sizes, grid, index, window, stride, padding):
    coords = np.unravel_index(index, grid)
    return [sp.AxisPlan(sp.AxisGeometry(n, k, w, s, padding), int(c))
            for n, k, c, w, s in zip(sizes, grid, coords, window, stride)]


def _pieces(x, plans, grid, index, widths):
    """What the exchange delivers: per received offset, the neighbour's rows."""
    coords = np.unravel_index(index, grid)
    out = {}
    for o, _ in halo.block_neighbours(index, grid, widths):
        sl = [slice(None)]
        for v, c, p, (lo, hi) in zip(o, coords, plans, widths):
            n = p.geometry.block
            sl.append({-1: slice(c * n - lo, c * n), 0: slice(c * n, (c + 1) * n),
                       1: slice((c + 1) * n, (c + 1) * n + hi)}[v])
        out[o] = tf.constant(x[tuple(sl)])
    return out


CASES = [((3, 3), (1, 1), (1, 1)), ((2, 2), (1, 1), (1, 1)), ((3, 3), (2, 2), (1, 1)),
         ((5, 3), (1, 1), (1, 1)), ((3, 3), (1, 1), (2, 2)), ((4, 1), (2, 1), (1, 1)),
         ((1, 1), (1, 1), (1, 1))]


@pytest.mark.parametrize("grid", [(2, 1), (4, 1), (1, 2), (2, 2)], ids=str)
@pytest.mark.parametrize("case", CASES, ids=str)
def test_block_same_plus_halo_pieces_equals_whole_conv(grid, case):
    window, stride, dilation = case
    sizes = (16, 12)
    eff = tuple(d * (k - 1) + 1 for k, d in zip(window, dilation))
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2,) + sizes + (3,)).astype(np.float32)
    kernel = tf.constant(rng.standard_normal(window + (3, 4)).astype(np.float32))

    def conv(t, k, padding):
        return ops.conv(t, k, strides=list(stride), padding=padding, dilation_rate=dilation)

    whole = conv(tf.constant(x), kernel, "same").numpy()
    for index in range(int(np.prod(grid))):
        plans = _plans(sizes, grid, index, eff, stride, "same")
        assert core.block_conv_possible(plans)
        widths = [p.geometry.exchange() for p in plans]
        plan = halo.BlockHaloPlan(None, grid, widths, [p.geometry.block for p in plans],
                                  "neighbour", "t", halo.block_neighbours(index, grid, widths),
                                  [])
        coords = np.unravel_index(index, grid)
        block = x[(slice(None),) + tuple(slice(c * p.geometry.block, (c + 1) * p.geometry.block)
                                         for c, p in zip(coords, plans))]
        pieces = _pieces(x, plans, grid, index, widths)
        regions = core._corrections(plans, plan)
        y = halo.add_all_at(conv(tf.constant(block), kernel, "same"), [
            (conv(core._thin_input(pieces[o], regions[o]), kernel, "valid"),
             [a[2][0] for a in regions[o]] + [0]) for o in pieces if regions[o] is not None])
        want = whole[(slice(None),) + tuple(
            slice(c * p.geometry.out_block, (c + 1) * p.geometry.out_block)
            for c, p in zip(coords, plans))]
        np.testing.assert_allclose(y.numpy(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("size,parts,window,stride,padding,ok", [
    (16, 2, 3, 1, "same", True), (16, 4, 5, 1, "same", True), (16, 2, 3, 2, "same", True),
    (16, 2, 3, 1, "valid", False), (16, 2, 1, 1, "valid", True), (18, 2, 3, 2, "same", False)])
def test_block_conv_possible(size, parts, window, stride, padding, ok):
    plans = [sp.AxisPlan(sp.AxisGeometry(size, parts, window, stride, padding), i)
             for i in range(parts)]
    assert core.block_conv_possible(plans[:1]) is ok
