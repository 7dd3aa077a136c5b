"""Every collective primitive, forward and gradient, against numpy on the full tensor.

Run under ``horovodrun -np 2`` and ``-np 4``; model_parallel 1, 2 and 4.
Each rank seeds its upstream gradient by its global rank, so the numpy
reference (computed on every rank from all ranks' seeds) sees the whole
group. ``tf.function`` for every case; eagerly for one case per primitive
and group (see ``traced_all_eager_first``).
"""
import numpy as np
import pytest
import tensorflow as tf

from tfhybrid import comm

from conftest import model_parallel_values, randn

MPS = model_parallel_values()
GROUPS = ["model", "data", "world"]
MODES = ["eager", "function"]


def traced_all_eager_first(cases):
    """(case..., mode) tuples: every case traced, the first case also eagerly.

    The eager and traced paths share the collective and its gradient; the
    eager twin checks the eager dispatch once per primitive and group rather
    than once per axis (the eager axis variants were a minute of the -np 2
    suite).
    """
    cases = [c if isinstance(c, tuple) else (c,) for c in cases]
    return [c + ("function",) for c in cases] + [cases[0] + ("eager",)]
SHAPE = (8, 12, 4)


def run(fn, x, upstream, mode):
    """Return (fn(x), d<fn(x), upstream>/dx) eagerly or inside tf.function."""
    def step(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = fn(x)
            loss = tf.reduce_sum(y * upstream)
        return y, tape.gradient(loss, x)
    if mode == "function":
        step = tf.function(step)
    y, g = step(tf.constant(x))
    return y.numpy(), g.numpy()


def blocks(a, axis, k):
    return np.split(a, k, axis=axis)


def close(a, b):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


@pytest.fixture(params=MPS, ids=lambda m: f"mp{m}")
def grid(request, grid_of):
    return grid_of(request.param)


@pytest.mark.parametrize("group", GROUPS)
@pytest.mark.parametrize("axis,mode", traced_all_eager_first([0, 1, -1]))
def test_split(grid, group, axis, mode):
    g = grid.group(group)
    x = randn(SHAPE, "x", g.ranks)                     # R: same on the group
    out_shape = list(SHAPE)
    out_shape[axis] //= g.size
    ups = [randn(out_shape, "u", r) for r in g.ranks]  # each rank its own
    y, dx = run(lambda t: comm.split(t, axis, group), x, ups[g.index], mode)
    close(y, blocks(x, axis, g.size)[g.index])
    close(dx, np.concatenate(ups, axis=axis))


@pytest.mark.parametrize("group", GROUPS)
@pytest.mark.parametrize("axis,mode", traced_all_eager_first([0, 1, 2]))
def test_gather(grid, group, axis, mode):
    g = grid.group(group)
    full = randn(SHAPE, "full", g.ranks)
    u = randn(SHAPE, "u", g.ranks)                     # R gradient
    y, dx = run(lambda t: comm.gather(t, axis, group), blocks(full, axis, g.size)[g.index], u, mode)
    close(y, full)
    close(dx, blocks(u, axis, g.size)[g.index])


@pytest.mark.parametrize("group", GROUPS)
@pytest.mark.parametrize("axis,mode", traced_all_eager_first([0, 1, -1]))
def test_shard(grid, group, axis, mode):
    g = grid.group(group)
    full = randn(SHAPE, "full", g.ranks)
    ups = [randn(SHAPE, "u", r) for r in g.ranks]      # P gradient
    y, dx = run(lambda t: comm.shard(t, axis, group), blocks(full, axis, g.size)[g.index],
                ups[g.index], mode)
    close(y, full)
    close(dx, blocks(sum(ups), axis, g.size)[g.index])


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("group", GROUPS)
def test_reduce(grid, group, mode):
    g = grid.group(group)
    parts = [randn(SHAPE, "p", r) for r in g.ranks]
    u = randn(SHAPE, "u", g.ranks)
    y, dx = run(lambda t: comm.reduce(t, group), parts[g.index], u, mode)
    close(y, sum(parts))
    close(dx, u)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("group", GROUPS)
def test_copy(grid, group, mode):
    g = grid.group(group)
    x = randn(SHAPE, "x", g.ranks)
    ups = [randn(SHAPE, "u", r) for r in g.ranks]
    y, dx = run(lambda t: comm.copy(t, group), x, ups[g.index], mode)
    close(y, x)
    close(dx, sum(ups))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("group", GROUPS)
def test_batch_gather_and_scatter(grid, group, mode):
    g = grid.group(group)
    local = [randn((3, 5), "b", r) for r in g.ranks]
    ups = [randn((3 * g.size, 5), "u", r) for r in g.ranks]
    y, dx = run(lambda t: comm.batch_gather(t, group), local[g.index], ups[g.index], mode)
    close(y, np.concatenate(local))
    close(dx, blocks(sum(ups), 0, g.size)[g.index])

    x = randn((4 * g.size, 5), "x", g.ranks)
    ups = [randn((4, 5), "v", r) for r in g.ranks]
    y, dx = run(lambda t: comm.batch_scatter(t, group), x, ups[g.index], mode)
    close(y, blocks(x, 0, g.size)[g.index])
    close(dx, np.concatenate(ups))


def halo_reference(full, axis, k, lo, hi, ups):
    """Forward blocks and input gradients of the halo exchange, from the full tensor."""
    full = np.moveaxis(full, axis, 0)
    b = full.shape[0] // k
    pad = np.concatenate([np.zeros((lo,) + full.shape[1:], full.dtype), full,
                          np.zeros((hi,) + full.shape[1:], full.dtype)])
    outs = [np.moveaxis(pad[i * b:i * b + b + lo + hi], 0, axis) for i in range(k)]
    acc = np.zeros_like(pad)
    for i, u in enumerate(ups):
        acc[i * b:i * b + b + lo + hi] += np.moveaxis(u, axis, 0)
    grads = [np.moveaxis(acc[lo + i * b:lo + i * b + b], 0, axis) for i in range(k)]
    return outs, grads


@pytest.mark.parametrize("group", GROUPS)
@pytest.mark.parametrize("axis,lo,hi,mode", traced_all_eager_first(
    [(1, 1, 1), (0, 2, 1), (2, 0, 2), (1, 3, 0), (-1, 1, 2)]))
def test_halo_exchange(grid, group, axis, lo, hi, mode):
    g = grid.group(group)
    shape = (4 * g.size, 3 * g.size, 4 * g.size)
    full = randn(shape, "full", g.ranks)
    block = blocks(full, axis, g.size)[g.index]
    out_shape = list(block.shape)
    out_shape[axis] += lo + hi
    ups = [randn(out_shape, "u", r) for r in g.ranks]
    outs, grads = halo_reference(full, axis % 3, g.size, lo, hi, ups)
    y, dx = run(lambda t: comm.halo_exchange(t, axis, lo, hi, group), block, ups[g.index], mode)
    close(y, outs[g.index])
    close(dx, grads[g.index])


def test_uneven_split_raises(grid_of):
    grid = grid_of(1)
    if grid.size == 1:
        pytest.skip("needs a group of at least 2")
    with pytest.raises(ValueError, match=r"shape \(5, 3\).*size=5 is not divisible by"):
        comm.split(tf.zeros([5, 3]), axis=0, group="world")


def test_halo_larger_than_block_raises(grid_of):
    grid = grid_of(1)
    if grid.size == 1:
        pytest.skip("needs a group of at least 2")
    with pytest.raises(ValueError, match="at least max"):
        comm.halo_exchange(tf.zeros([2, 3]), axis=0, lo=3, hi=0, group="world")


def test_two_collectives_in_one_function_get_distinct_names(grid_of):
    """Two identical gathers in flight inside one tf.function must not collide."""
    g = grid_of(1).group("world")

    @tf.function
    def f(a, b):
        return comm.gather(a, 0, "world"), comm.gather(b, 0, "world")

    ya, yb = f(tf.constant(randn((2, 3), "a", g.index)), tf.constant(randn((2, 3), "b", g.index)))
    close(ya.numpy(), np.concatenate([randn((2, 3), "a", i) for i in range(g.size)]))
    close(yb.numpy(), np.concatenate([randn((2, 3), "b", i) for i in range(g.size)]))


def test_static_shapes_survive_unknown_batch(grid_of):
    """Keras traces with an unknown batch: the other dimensions must stay static."""
    g = grid_of(1).group("world")
    k = g.size
    seen = {}

    @tf.function(input_signature=[tf.TensorSpec([None, 4 * k, 6], tf.float32)])
    def f(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            a = comm.split(x, axis=1, group="world")
            b = comm.gather(a, axis=1, group="world")
            c = comm.halo_exchange(a, axis=1, lo=1, hi=1, group="world")
            d = comm.batch_scatter(x, group="world")
            seen.update(a=a.shape.as_list(), b=b.shape.as_list(), c=c.shape.as_list(),
                        d=d.shape.as_list())
            loss = tf.reduce_sum(b) + tf.reduce_sum(c) + tf.reduce_sum(d)
        grad = tape.gradient(loss, x)
        seen["grad"] = grad.shape.as_list()
        return grad

    f(tf.zeros([2 * k, 4 * k, 6]))
    assert seen == {"a": [None, 4, 6], "b": [None, 4 * k, 6], "c": [None, 6, 6],
                    "d": [None, 4 * k, 6], "grad": [None, 4 * k, 6]}


def test_layer_called_twice_in_one_graph_gets_distinct_names(grid_of):
    """Same base name under different name scopes must not collide in Horovod."""
    g = grid_of(1).group("world")

    @tf.function
    def f(x):
        outs = []
        for scope in ("a", "b"):
            with tf.name_scope(scope):
                outs.append(comm.gather(x, 0, "world", name="same"))
        return outs

    ya, yb = f(tf.constant(randn((2, 3), "s", g.index)))
    ref = np.concatenate([randn((2, 3), "s", i) for i in range(g.size)])
    close(ya.numpy(), ref)
    close(yb.numpy(), ref)


@pytest.mark.parametrize("rows", [8, 7, 1])
@pytest.mark.parametrize("group", ["model", "world"])
def test_backend_reducescatter_blocks(grid_of, group, rows):
    """backend.reducescatter (alltoall + local sum): group rank i gets block i of the
    group's sum, the first ``rows % k`` ranks one row more (Horovod's blocks); eagerly
    and traced with an unknown first axis."""
    from tfhybrid.comm import backend

    g = grid_of(2).group(group)   # -np 4: model group {0, 1} or {2, 3}, not the world
    k, i = g.size, g.index
    total = sum(randn((rows, 3, 2), "backend-rs", r) for r in g.ranks)
    counts = [rows // k + (j < rows % k) for j in range(k)]
    want = total[sum(counts[:i]):sum(counts[:i + 1])]
    x = tf.constant(randn((rows, 3, 2), "backend-rs", g.ranks[i]))
    close(backend.reducescatter(x, g.ranks, f"test.rs.{group}.{rows}").numpy(), want)
    traced = tf.function(lambda t: backend.reducescatter(t, g.ranks, f"test.rsf.{group}.{rows}"),
                         input_signature=[tf.TensorSpec([None, 3, 2], tf.float32)])
    assert traced.get_concrete_function().structured_outputs.shape.as_list() == [None, 3, 2]
    close(traced(x).numpy(), want)


def test_rank_and_size_are_horovods(grid):
    """tfhybrid.rank()/size() are this process's Horovod rank and the world size."""
    import tfhybrid
    from tfhybrid.comm import backend

    assert (tfhybrid.rank(), tfhybrid.size()) == (backend.rank(), backend.size())
    assert tfhybrid.size() == grid.size and tfhybrid.rank() == grid.rank
