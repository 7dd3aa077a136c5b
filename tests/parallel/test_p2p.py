"""Differentiable point-to-point and rooted primitives (tfhybrid.comm.p2p) against numpy.

Run under ``horovodrun -np 2`` and ``-np 4``. Every rank recreates every
rank's payload and upstream gradient from seeds, so each checks its own
forward rows and input gradient against the single-process values (rows
moved unchanged; the gradient of moved rows is the upstream gradient of
where they went, no factor), and the ranks check together the adjoint
identity sum_r <A x, u>_r = sum_r <x, A^T u>_r (two scalars all-reduced over
the world). Traced with unknown rows (Keras' case), with static shapes, and
eagerly (-np 2: conftest drops the eager twins at -np 4). The chain test is
a pipeline: weights on every rank, activations forward and errors backward
through ``send_recv`` on neighbouring pairs, each rank's weight gradient
equal to the single-process gradient.
"""
import itertools

import numpy as np
import pytest
import tensorflow as tf

from tfhybrid import comm
from tfhybrid.comm import backend
from tfhybrid.comm.p2p import anchor_like, gather_to, scatter_from, send_recv, token

from conftest import model_parallel_values, randn, world_size

MPS = model_parallel_values()
MODES = ["function", "static", "eager"]   # traced with unknown rows / static shapes / eager
TAIL = (3, 2)


def close(a, b):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


@pytest.fixture(params=MPS, ids=lambda m: f"mp{m}")
def grid(request, grid_of):
    grid = grid_of(request.param)
    # Every pair of the world (the same list on every rank; idempotent).
    comm.register_groups(itertools.combinations(range(world_size()), 2))
    return grid


@pytest.fixture
def world(grid_of):
    """One grid (the world group is the same in every grid), every pair registered."""
    grid = grid_of(MPS[0])
    comm.register_groups(itertools.combinations(range(world_size()), 2))
    return grid


def run(fn, x, u, mode):
    """(y, dx) of ``y = fn(x)``, ``dx = d<y, u>/dx``; the loss adds ``token(y)`` (the
    sender's zero rows) and the result ``token(dx)`` (a receiver's anchor gradient)."""
    def step(x, u):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = fn(x)
            loss = tf.reduce_sum(y * u) + token(y)
        dx = tape.gradient(loss, x)
        return y, dx + token(dx, dx.dtype)
    if mode != "eager":
        sig = None if mode == "static" else [tf.TensorSpec((None,) + TAIL, tf.float32)] * 2
        step = tf.function(step, input_signature=sig)
    y, dx = step(tf.constant(x), tf.constant(u))
    return y.numpy(), dx.numpy()


def check_adjoint(x, y, u, dx, name):
    """sum over ranks of <y, u> equals sum over ranks of <x, dx> (and is not trivially 0)."""
    local = tf.constant([np.sum(y * u), np.sum(x * dx)], tf.float64)
    total = backend.allreduce(local, tuple(range(world_size())), f"test.adjoint.{name}").numpy()
    assert abs(total[0]) > 1e-3, total
    np.testing.assert_allclose(total[0], total[1], rtol=1e-6)


def rows_of(k):
    """Uneven row counts per member (a member with none at k=4)."""
    return [3, 1] if k == 2 else [2, 0, 3, 1][:k]


def pairs_of(k):
    return {"first_last": (0, k - 1), "last_first": (k - 1, 0), "inner": (1, 2),
            "self": (1, 1)}


@pytest.mark.parametrize("which,mode", [(w, "function") for w in pairs_of(4)] + [
    ("first_last", "static"), ("last_first", "eager")])   # every pair traced, two twins
@pytest.mark.parametrize("group", ["model", "world"])
def test_send_recv(grid, group, which, mode):
    g = grid.group(group)
    k, i = g.size, g.index
    src, dst = pairs_of(k)[which]
    if max(src, dst) >= k or (which == "inner" and k < 4) or (which != "first_last" and k < 2):
        pytest.skip(f"pair {which} needs a larger group than {k}")
    rows = 5
    payload = randn((rows,) + TAIL, "payload", g.ranks)
    ups = randn((rows,) + TAIL, "up", g.ranks)
    if i == src:
        x, u = payload, (ups if src == dst else np.zeros((0,) + TAIL, np.float32))
    elif i == dst:
        x, u = np.zeros((0,) + TAIL, np.float32), ups          # the anchor
    else:
        x, u = randn((2,) + TAIL, "other", g.ranks[i]), np.zeros((0,) + TAIL, np.float32)
    y, dx = run(lambda t: send_recv(t, src, dst, group=group), x, u, mode)
    if i == dst:
        close(y, payload)
        close(dx, ups if src == dst else np.zeros_like(x))
    else:
        assert y.shape == (0,) + TAIL
        close(dx, ups if i == src else np.zeros_like(x))
    check_adjoint(x, y, u, dx, f"sr.{group}.{which}.{mode}")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("group", ["model", "world"])
def test_gather_to(grid, group, mode):
    """Uneven rows (none on one member at k=4) to the last member; gradient blocks back."""
    g = grid.group(group)
    k, i, root = g.size, g.index, g.size - 1
    rows = rows_of(k) if k > 1 else [3]
    xs = [randn((n,) + TAIL, "g", g.ranks, j) for j, n in enumerate(rows)]
    u_root = randn((sum(rows),) + TAIL, "gu", g.ranks)
    u = u_root if i == root else np.zeros((0,) + TAIL, np.float32)
    y, dx = run(lambda t: gather_to(t, root, group=group), xs[i], u, mode)
    if i == root:
        close(y, np.concatenate(xs))
    else:
        assert y.shape == (0,) + TAIL
    close(dx, np.split(u_root, np.cumsum(rows)[:-1])[i])
    check_adjoint(xs[i], y, u, dx, f"gt.{group}.{mode}")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("group", ["model", "world"])
def test_scatter_from(grid, group, mode):
    """Root 0 sends uneven blocks (none to one member at k=4); gradients gathered back."""
    g = grid.group(group)
    k, i = g.size, g.index
    rows = rows_of(k) if k > 1 else [3]
    full = randn((sum(rows),) + TAIL, "s", g.ranks)
    ups = [randn((n,) + TAIL, "su", g.ranks, j) for j, n in enumerate(rows)]
    x = full if i == 0 else np.zeros((0,) + TAIL, np.float32)
    y, dx = run(lambda t: scatter_from(t, 0, rows, group=group), x, ups[i], mode)
    close(y, np.split(full, np.cumsum(rows)[:-1])[i])
    close(dx, np.concatenate(ups) if i == 0 else np.zeros_like(x))
    check_adjoint(x, y, ups[i], dx, f"sf.{group}.{mode}")


@pytest.mark.parametrize("mode", ["function", "eager"])
def test_scatter_from_is_the_adjoint_of_gather_to(world, mode):
    """<gather_to(x), v> on the root == sum over members of <x, scatter_from(v)>, with
    the gather's received row counts as sizes."""
    g = world.group("world")
    k, i, root = g.size, g.index, 1
    rows = rows_of(k)
    x = randn((rows[i],) + TAIL, "ax", g.ranks[i])
    v = randn((sum(rows),) + TAIL, "av", g.ranks) if i == root else np.zeros((0,) + TAIL,
                                                                             np.float32)

    def both(x, v):
        y = gather_to(x, root, group="world")
        z = scatter_from(v, root, rows, group="world")
        return tf.reduce_sum(y * v), tf.reduce_sum(x * z)
    if mode == "function":
        both = tf.function(both)
    yv, xz = both(tf.constant(x), tf.constant(v))
    check_adjoint(np.float32([1.0]), np.float32([yv]), np.float32([1.0]), np.float32([xz]),
                  f"adj.{mode}")


@pytest.mark.parametrize("mode", ["function", "eager"])
def test_two_transfers_on_one_pair_with_one_anchor(world, mode):
    """Two send_recv on one pair, the receiver passing the same anchor to both and the
    sender's two backward inputs alike: distinct collectives (Grappler merged identical
    ones: a hang), each payload and each gradient where it belongs."""
    g = world.group("world")
    k, i = g.size, g.index
    src, dst = k - 1, 0
    a, b = (randn((4,) + TAIL, name, g.ranks) for name in ("pa", "pb"))
    ua, ub = (randn((4,) + TAIL, name, g.ranks) for name in ("ua", "ub"))

    def step(x):
        with tf.GradientTape() as tape:
            if i == src:
                xa, xb = x + 1.0, x * 2.0         # two payloads from one input
            else:
                xa = xb = anchor_like(x, TAIL)
            tape.watch([xa, xb])
            ya = send_recv(xa, src, dst, group="world")
            yb = send_recv(xb, src, dst, group="world")
            if i == dst:
                loss = tf.reduce_sum(ya * ua) + tf.reduce_sum(yb * ub)
            else:
                loss = token(ya) + token(yb)
        da, db = tape.gradient(loss, [xa, xb])
        return ya, yb, da, db, loss + token(da) + token(db)
    if mode == "function":
        step = tf.function(step)
    ya, yb, da, db, _ = (t.numpy() for t in step(tf.constant((a - 1.0) if i == src else a)))
    if i == dst:
        close(ya, a)
        close(yb, 2.0 * (a - 1.0))
    elif i == src:
        close(da, ua)
        close(db, ub)


@pytest.mark.parametrize("mode", ["function", "eager"])
def test_chain_of_send_recv_is_a_pipeline(world, mode):
    """Stage r = rank r of the world: h <- tanh(h @ W_r), sent to r+1 by send_recv; the
    last stage's loss. Each rank's dW_r and the loss equal the single-process chain's."""
    k, r = world_size(), world.group("world").index
    ws = [randn((3, 3), "w", s) for s in range(k)]
    x0 = randn((5, 3), "x0")
    u = randn((5, 3), "u")
    with tf.GradientTape() as tape:           # single process: the whole chain
        wt = [tf.constant(w) for w in ws]
        tape.watch(wt)
        h = tf.constant(x0)
        for w in wt:
            h = tf.tanh(h @ w)
        ref_loss = tf.reduce_sum(h * u)
    ref = [g.numpy() for g in tape.gradient(ref_loss, wt)]

    def stage(x, w):
        with tf.GradientTape() as tape:
            tape.watch(w)
            h = x if r == 0 else anchor_like(x, (3,))
            anchor = h
            tape.watch(anchor)
            objective = tf.zeros([])
            for s in range(k - 1):            # every rank issues every transfer (SPMD)
                if s == r:
                    h = tf.tanh(h @ w)
                sent = send_recv(h, s, s + 1, group="world")
                if s == r:
                    objective += token(sent)
                elif s + 1 == r:
                    h = sent
            if r == k - 1:
                objective += tf.reduce_sum(tf.tanh(h @ w) * u)
        dw, danchor = tape.gradient(objective, [w, anchor])
        return dw, objective + token(danchor)
    if mode == "function":
        stage = tf.function(stage)
    dw, loss = stage(tf.constant(x0), tf.constant(ws[r]))
    close(dw.numpy(), ref[r])
    if r == k - 1:
        close(loss.numpy(), ref_loss.numpy())


def test_bad_arguments_raise(world):
    g = world.group("world")
    with pytest.raises(ValueError, match=r"send_recv: Received an invalid value for `dst`: "
                                         rf"dst={g.size}; expected the index of a rank"):
        send_recv(tf.zeros([2, 3]), 0, g.size, group="world")
    with pytest.raises(ValueError, match=r"root=-1"):
        gather_to(tf.zeros([2, 3]), -1, group="world")
    if g.index == 0:   # sizes are read on the root only
        with pytest.raises(ValueError, match=r"sizes=\[1, 1(, 0)*\].*adding up to the 3 rows"):
            scatter_from(tf.zeros([3, 2]), 0, [1, 1] + [0] * (g.size - 2), group="world")
    with pytest.raises(ValueError, match=r"rank >= 1"):
        token(tf.zeros([]))
