"""Halo exchange between neighbouring ranks of a group (domain parallelism).

A tensor split along ``axis`` over a group (S(axis)) is extended with ``lo``
rows from the previous rank of the group and ``hi`` rows from the next one;
beyond the group's ends the halo is zeros (the global zero padding of a
convolution). Both directions travel in one Horovod ``alltoall`` whose
split sizes are zero except towards the two neighbours; the backward sends
the halo gradients back the same way and adds them to the boundary rows.
"""
from __future__ import annotations

import collections

import tensorflow as tf

from tfhybrid.comm import backend
from tfhybrid.process_grid import ravel, unravel
from tfhybrid.comm.primitives import (_axis, _inverse, _perm_to_front, _with_axis_size,
                                      resolve_group)


def _check_halo(x, axis, lo, hi, g):
    for what, v in (("lo", lo), ("hi", hi)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(f"Received an invalid value for `{what}`: {what}={v!r}; "
                             "expected a non-negative integer.")
    n = x.shape[axis]
    if n is not None and max(lo, hi) > n:
        raise ValueError(
            f"halo_exchange: the local block (shape {x.shape}) has {n} rows along axis "
            f"{axis} but a halo of lo={lo}, hi={hi} rows was requested over the "
            f"{g.name} group of {g.size} ranks; each block must have at least "
            f"max(lo, hi) rows: use fewer ranks along this axis or a larger input.")


def _rows(t, axis, begin, count):
    """``count`` rows of ``t`` from ``begin`` (may be a tensor) along ``axis``."""
    b = tf.one_hot(axis, t.shape.rank, on_value=begin, off_value=0, dtype=tf.int32)
    size = tf.one_hot(axis, t.shape.rank, on_value=count, off_value=-1, dtype=tf.int32)
    return tf.slice(t, b, size)


def _exchange(t, axis, to_prev, to_next, from_prev, from_next, g, name):
    """Send the first ``to_prev`` rows of ``t`` to rank i-1 and the last ``to_next`` to i+1.

    Only the boundary rows are moved to axis 0 for the ``alltoall`` (never the
    whole block). Returns (rows from i-1, rows from i+1) along ``axis``;
    zeros at the group's ends.
    """
    i, k = g.index, g.size
    has_prev, has_next = i > 0, i < k - 1
    perm = _perm_to_front(t.shape.rank, axis)
    front = lambda r: tf.transpose(r, perm) if axis else r  # noqa: E731
    back = lambda r: tf.transpose(r, _inverse(perm)) if axis else r  # noqa: E731
    splits, parts = [0] * k, []
    if has_prev:
        splits[i - 1] = to_prev
        parts.append(front(_rows(t, axis, 0, to_prev)))
    if has_next:
        splits[i + 1] = to_next
        parts.append(front(_rows(t, axis, tf.shape(t)[axis] - to_next, to_next)))
    recv = backend.alltoall(tf.concat(parts, 0), splits, g.ranks, name)

    def zeros(n):
        shape = tf.tensor_scatter_nd_update(tf.shape(t), [[axis]], [n])
        return tf.zeros(shape, t.dtype)

    got_prev = back(recv[:from_prev]) if has_prev else zeros(from_prev)
    start = from_prev if has_prev else 0
    got_next = back(recv[start:start + from_next]) if has_next else zeros(from_next)
    return got_prev, got_next


def halo_exchange(x, axis, lo, hi, group="model", name=None):
    """Prepend ``lo`` rows of the previous rank and append ``hi`` rows of the next.

    Args:
        x: This rank's block of a tensor split along ``axis`` over ``group``.
        axis: The split axis.
        lo: Rows taken from the end of the previous rank's block (zeros on
            the group's first rank).
        hi: Rows taken from the start of the next rank's block (zeros on the
            group's last rank).
        group: Group name or :class:`tfhybrid.process_grid.Group`.
        name: Base of the collective names.

    Returns:
        A tensor with ``lo + n + hi`` rows along ``axis``.

    Raises:
        ValueError: for negative halo widths or a block smaller than the halo.

    Example:
        >>> # 3x3 'same' convolution on a height-split NHWC block:
        >>> y = tfhybrid.comm.halo_exchange(x, axis=1, lo=1, hi=1, group="model")
    """
    x = tf.convert_to_tensor(x)
    g, axis = resolve_group(group), _axis(x, axis)
    _check_halo(x, axis, lo, hi, g)
    if lo == 0 and hi == 0:
        return tf.identity(x)
    if g.size == 1:  # only the global border: zero padding
        pads = [[0, 0]] * x.shape.rank
        pads[axis] = [lo, hi]
        return tf.pad(x, pads)
    nm = f"{name or 'halo'}.{g.name}"
    others = 1
    for i, v in enumerate(x.shape[1:], start=1):
        others *= int(v) if i != axis and v is not None else 1
    _SENT.append(("axis", (hi * (g.index > 0) + lo * (g.index < g.size - 1)) * others))

    def forward(t):
        prev, nxt = _exchange(t, axis, hi, lo, lo, hi, g, nm)
        return tf.concat([prev, t, nxt], axis)

    def backward(dy):
        n = tf.shape(dy)[axis] - lo - hi
        d_lo, d_mid, d_hi = _rows(dy, axis, 0, lo), _rows(dy, axis, lo, n), _rows(dy, axis, lo + n, hi)
        # Our lo halo came from rank i-1's last lo rows, our hi halo from rank
        # i+1's first hi rows: send those gradients back and add them there.
        g_prev, g_next = _exchange(tf.concat([d_lo, d_hi], axis), axis, lo, hi, hi, lo, g,
                                   nm + ".bwd")
        return d_mid + _pad(g_prev, axis, 0, n - hi) + _pad(g_next, axis, n - lo, 0)

    @tf.custom_gradient
    def _halo(t):
        def grad(dy):
            return _with_axis_size(backward(dy), t, axis, t.shape[axis])
        n = t.shape[axis]
        return _with_axis_size(forward(t), t, axis, None if n is None else n + lo + hi), grad

    return _halo(x)


def _pad(t, axis, before, after):
    """Zero-pad ``t`` along ``axis`` (amounts may be tensors)."""
    row = tf.stack([before, after])
    pads = tf.tensor_scatter_nd_update(tf.zeros([t.shape.rank, 2], tf.int32), [[axis]], [row])
    return tf.pad(t, pads)


def _add_at(t, piece, begins):
    """``t`` with ``piece`` added at offset ``begins`` (one per axis after the
    first; the piece spans axis 0 whole).

    A ``tensor_scatter_nd_add`` over the rows the piece covers (indexed up to
    the last axis it does not span), which updates ``t``'s buffer in place
    when nothing else holds it: unlike ``t + tf.pad(piece)`` it makes no
    temporaries of ``t``'s size. Each element gets one addition, as there.
    """
    return add_all_at(t, [(piece, begins)])


def _scatter_rows(t, piece, begins):
    """(indices, updates) of :func:`_add_at`, or None when the piece is ``t``'s shape."""
    rank = t.shape.rank
    spans = [d for d in range(1, rank)
             if not isinstance(begins[d - 1], int) or begins[d - 1] != 0
             or piece.shape[d] is None or piece.shape[d] != t.shape[d]]
    if not spans:
        return None
    last = spans[-1]
    ranges = [tf.range(tf.shape(piece)[0])] + [
        begins[d - 1] + tf.range(tf.shape(piece)[d]) for d in range(1, last + 1)]
    grids = tf.meshgrid(*ranges, indexing="ij")
    indices = tf.reshape(tf.stack(grids, -1), [-1, last + 1])
    updates = tf.reshape(piece, tf.concat([[-1], tf.shape(piece)[last + 1:]], 0))
    return indices, updates, last


def add_all_at(t, pieces):
    """``t`` with every ``(piece, begins)`` of ``pieces`` added at its offset
    (see :func:`_add_at`; pieces must not overlap). Pieces indexed to the same
    axis go in one ``tensor_scatter_nd_add``: one in-place update of ``t``'s
    buffer, where a chain of them keeps a copy of ``t`` per
    extra link (a middle rank's two halo pieces)."""
    groups = {}
    for piece, begins in pieces:
        rows = _scatter_rows(t, piece, begins)
        if rows is None:
            t = t + piece
            continue
        groups.setdefault(rows[2], []).append(rows[:2])
    for _, items in sorted(groups.items()):
        if len(items) == 1:
            indices, updates = items[0]
        else:
            indices = tf.concat([i for i, _ in items], 0)
            updates = tf.concat([u for _, u in items], 0)
        t = tf.tensor_scatter_nd_add(t, indices, updates)
    return t


# -- neighbour-only exchange over a whole block grid (corners included) --------------

HALO_METHODS = ("neighbour", "pairs", "axis")
_METHOD = {"value": None}
_SENT = []          # trace-time record: (method, elements sent per batch row), see sent_log


def halo_method() -> str:
    """The block-grid halo method in force: ``set_halo_method``'s value, else
    ``TFHYBRID_HALO``, else ``"neighbour"``.

    * ``"neighbour"``: one ``alltoall`` over the spatial group per direction
      (forward, backward); each rank's splits are empty except towards the
      ranks whose windows need its rows, corners of 2-D/3-D grids included;
    * ``"pairs"``: one 2-rank ``alltoall`` per neighbour pair, each on its own
      process set (registered on every rank);
    * ``"axis"``: the per-axis exchange (:func:`halo_exchange` along each
      split axis in turn, corners forwarded through the first neighbour).

    Example:
        >>> tfhybrid.comm.halo.set_halo_method("axis")   # before building the layers' graphs
    """
    import os
    value = _METHOD["value"] or os.environ.get("TFHYBRID_HALO") or "neighbour"
    if value not in HALO_METHODS:
        raise ValueError(f"Received an invalid halo method {value!r} (set_halo_method or "
                         f"TFHYBRID_HALO); expected one of {HALO_METHODS}.")
    from tfhybrid.comm import backend
    if value == "pairs" and backend.groups_over_world():
        raise ValueError("Received the halo method 'pairs' in an elastic run: its rank pairs "
                         "do not partition the world, and elastic runs issue group "
                         "collectives over the world (no Horovod process sets). Use "
                         "'neighbour' (the default) or 'axis'.")
    return value


def set_halo_method(method):
    """Choose the block-grid halo method for graphs traced from now on (None: default).

    Raises:
        ValueError: for a name not in :data:`HALO_METHODS`.

    Example:
        >>> tfhybrid.comm.halo.set_halo_method("pairs")
    """
    if method is not None and method not in HALO_METHODS:
        raise ValueError(f"Received an invalid value for `method`: {method!r}; expected one "
                         f"of {HALO_METHODS} or None.")
    _METHOD["value"] = method


def sent_log(clear=False):
    """``[(method, elements sent per batch row), ...]`` recorded when halo
    exchanges were traced or run (forward direction; the backward sends the
    same amount back). For benchmarks: bytes sent = elements x batch x itemsize."""
    out = list(_SENT)
    if clear:
        _SENT.clear()
    return out


def _offsets(ndim):
    out = [()]
    for _ in range(ndim):
        out = [o + (v,) for o in out for v in (-1, 0, 1)]
    return out


def block_neighbours(index, shape, widths, sending=False):
    """``[(offset, group index), ...]``: the ranks of a row-major block grid
    this rank receives halo rows from (``sending``: sends rows to), corners
    included, in a fixed order.

    ``widths`` are the (lo, hi) halo rows per grid axis. A neighbour at offset
    ``o`` is kept when it exists and the piece is not empty: received, our
    ``lo`` rows before (``o = -1``) / ``hi`` rows after (``o = +1``); sent, the
    ``lo`` last rows towards ``+1`` / the ``hi`` first rows towards ``-1``.
    """
    coords = unravel(index, shape)
    out = []
    for o in _offsets(len(shape)):
        if not any(o):
            continue
        c = tuple(a + b for a, b in zip(coords, o))
        if any(v < 0 or v >= s for v, s in zip(c, shape)):
            continue
        if sending:
            ok = all((v != 1 or lo > 0) and (v != -1 or hi > 0) for v, (lo, hi) in zip(o, widths))
        else:
            ok = all((v != -1 or lo > 0) and (v != 1 or hi > 0) for v, (lo, hi) in zip(o, widths))
        if ok:
            out.append((o, ravel(c, shape)))
    return out


def neighbour_pairs(groups, shape, widths):
    """Every neighbour pair (sorted global ranks) of every group, same order on
    every rank: the process sets of the ``"pairs"`` method."""
    pairs = []
    for ranks in groups:
        for i in range(len(ranks)):
            for _, j in block_neighbours(i, shape, widths):
                pair = tuple(sorted((ranks[i], ranks[j])))
                if pair not in pairs:
                    pairs.append(pair)
    return pairs


def _piece(t, o, widths, sizes, own):
    """Slice of ``t`` at offset ``o``: ``own`` pieces (what we send) take our
    last ``lo`` rows towards +1 and first ``hi`` rows towards -1; halo pieces of
    the extended tensor are ``lo`` / ``hi`` / ``n`` rows at their place."""
    begin, size = [0] * t.shape.rank, [-1] * t.shape.rank
    for d, (v, (lo, hi), n) in enumerate(zip(o, widths, sizes)):
        if own:
            begin[d + 1], size[d + 1] = {1: (n - lo, lo), -1: (0, hi), 0: (0, n)}[v]
        else:
            begin[d + 1], size[d + 1] = {-1: (0, lo), 0: (lo, n), 1: (lo + n, hi)}[v]
    return tf.slice(t, begin, size)


def piece_dims(o, widths, sizes, own):
    """Dims of the halo piece at offset ``o`` (per axis -1, 0 or 1) of a block of
    ``sizes`` with halo ``widths`` (lo, hi) per axis: the rows this block sends
    towards ``o`` (``own=True``) or receives from it (``own=False``)."""
    if own:
        return [{1: lo, -1: hi, 0: n}[v] for v, (lo, hi), n in zip(o, widths, sizes)]
    return [{-1: lo, 1: hi, 0: n}[v] for v, (lo, hi), n in zip(o, widths, sizes)]


def halo_items(send_to, receive_from, widths, sizes):
    """(forward, backward) items a block of ``sizes`` sends per batch row and channel
    in a block-grid halo exchange (:func:`block_neighbours`' lists): forward the
    pieces its neighbours read, backward the gradients of the pieces it received."""
    forward = sum(int(np_prod(piece_dims(o, widths, sizes, True))) for o, _ in send_to)
    backward = sum(int(np_prod(piece_dims(o, widths, sizes, False))) for o, _ in receive_from)
    return forward, backward


def _swap(sends, recvs, g, method, name, like):
    """Send ``t`` to each ``(offset, group index, t)`` of ``sends``; receive from
    each ``(offset, group index, dims)`` of ``recvs`` a piece shaped
    ``[batch] + dims + [channels]``. Returns ``({offset: piece}, anchors)``:
    the caller's output must depend on ``anchors`` (the raw alltoall outputs),
    or a graph prunes an alltoall whose result this rank does not use (it
    only sends) and the other ranks wait for it forever."""
    shapes = {o: tf.concat([tf.shape(like)[:1], dims, tf.shape(like)[-1:]], 0)
              for o, _, dims in recvs}
    me = g.ranks[g.index]
    flat = {j: tf.reshape(t, [-1]) for _, j, t in sends}
    source = {j: o for o, j, _ in recvs}
    anchors = []
    if method == "pairs":
        out = {}
        for j in sorted(set(flat) | set(source)):
            pair = tuple(sorted((me, g.ranks[j])))
            send = flat.get(j, tf.reshape(like, [-1])[:0])   # not a constant: see below
            n = tf.size(send, out_type=tf.int32)
            splits = tf.stack([0, n]) if me < g.ranks[j] else tf.stack([n, 0])
            got = backend.alltoall(send, splits, pair, f"{name}.{pair[0]}_{pair[1]}")
            anchors.append(got)
            if j in source:
                out[source[j]] = tf.reshape(got, shapes[source[j]])
        return out, anchors
    order = sorted(flat)
    zero = tf.constant(0, tf.int32)
    splits = tf.stack([tf.size(flat[j], out_type=tf.int32) if j in flat else zero
                       for j in range(g.size)])
    # an empty send is a slice of the input, never a constant: Grappler would
    # constant-fold an alltoall of constants (run it while optimising the graph)
    empty = tf.reshape(like, [-1])[:0]
    send = tf.concat([flat[j] for j in order], 0) if order else empty
    recv = backend.alltoall(send, splits, g.ranks, name)
    srcs = sorted(source)
    counts = [tf.reduce_prod(shapes[source[j]]) for j in srcs]
    parts = tf.split(recv, tf.stack(counts), num=len(srcs)) if len(srcs) > 1 else [recv]
    return ({source[j]: tf.reshape(part, shapes[source[j]]) for j, part in zip(srcs, parts)},
            [recv])


class BlockHaloPlan(collections.namedtuple(
        "BlockHaloPlan", "group shape widths sizes method name receive_from send_to")):
    """Who sends which halo rows to whom in a block grid (see :func:`block_halo_plan`)."""


def block_halo_plan(x, group, shape, widths, name=None, method=None, all_groups=None):
    """Check the arguments of a block-grid halo exchange and plan it (no collective
    but the ``"pairs"`` process-set registration); see :func:`block_halo_exchange`."""
    method = method or halo_method()
    if method == "axis":
        raise ValueError("block_halo_exchange: method='axis' is halo_exchange along each "
                         "axis in turn; call that (tfhybrid.layers.spatial.core does).")
    nd = len(shape)
    if int(np_prod(shape)) != group.size or len(widths) != nd or x.shape.rank != nd + 2:
        raise ValueError(f"block_halo_exchange: grid shape {tuple(shape)} and widths "
                         f"{list(widths)} do not match the group of {group.size} ranks and "
                         f"a block of shape {x.shape}.")
    sizes = [int(v) for v in x.shape[1:1 + nd]]
    for d, ((lo, hi), n) in enumerate(zip(widths, sizes)):
        if max(lo, hi) > n:
            raise ValueError(f"block_halo_exchange: the block (shape {x.shape}) has {n} rows "
                             f"along axis {d + 1} but a halo of lo={lo}, hi={hi} rows was "
                             "requested; use fewer ranks along this axis or a larger input.")
    widths = [tuple(int(v) for v in w) for w in widths]
    receive_from = block_neighbours(group.index, tuple(shape), widths)
    send_to = block_neighbours(group.index, tuple(shape), widths, sending=True)
    if method == "pairs":
        backend.register_groups(neighbour_pairs(all_groups or [group.ranks], tuple(shape),
                                                widths))
    _SENT.append((method, halo_items(send_to, receive_from, widths, sizes)[0] * int(
        x.shape[-1])))
    return BlockHaloPlan(group, tuple(shape), widths, sizes, method,
                         f"{name or 'halo'}.{group.name}.{method}", receive_from, send_to)


def block_halo_pieces(t, plan):
    """Forward exchange of :func:`block_halo_plan`'s plan, not differentiable:
    ``({offset: halo piece received}, anchors)`` (pieces shaped ``[batch] +``
    :func:`piece_dims` ``(own=False) + [channels]``; see :func:`_swap` for anchors)."""
    w, n = plan.widths, plan.sizes
    sends = [(o, j, _piece(t, o, w, n, True)) for o, j in plan.send_to]
    recvs = [(o, j, piece_dims(o, w, n, False)) for o, j in plan.receive_from]
    return _swap(sends, recvs, plan.group, plan.method, plan.name, t)


def block_halo_return(grads, plan, like):
    """Backward exchange: send each received piece's gradient (``grads``:
    ``{offset: tensor}`` for every offset of ``plan.receive_from``) back to
    where it came from. Returns ``({offset: gradient of the rows we sent
    there}, anchors)`` for every offset of ``plan.send_to``."""
    w, n = plan.widths, plan.sizes
    sends = [(o, j, grads[o]) for o, j in plan.receive_from]
    recvs = [(o, j, piece_dims(o, w, n, True)) for o, j in plan.send_to]
    return _swap(sends, recvs, plan.group, plan.method, plan.name + ".bwd", like)


def sent_rows_begin(o, plan):
    """Where the rows sent towards offset ``o`` start in the block (per spatial axis)."""
    return [{1: n - lo, -1: 0, 0: 0}[v] for v, (lo, hi), n in zip(o, plan.widths, plan.sizes)]


def block_halo_exchange(x, group, shape, widths, name=None, method=None, all_groups=None):
    """Extend a block of a row-major block grid with its neighbours' halo rows.

    Equivalent to :func:`halo_exchange` along each split axis in turn, but
    every rank sends each neighbour (corners of 2-D/3-D grids included) only
    the rows it needs, all at once.

    Args:
        x: This rank's block ``(batch, spatial..., channels)``.
        group: The whole spatial Group; its ranks are the block grid, row-major.
        shape: Blocks per spatial axis (product = ``group.size``).
        widths: ``(lo, hi)`` halo rows per spatial axis (0 where not split).
        name: Base of the collective names.
        method: ``"neighbour"`` or ``"pairs"`` (see :func:`halo_method`);
            default: :func:`halo_method`.
        all_groups: With ``"pairs"``: every group of the grid axis (the pair
            process sets are registered for all of them, on every rank).

    Returns:
        A tensor with ``lo + n + hi`` rows along each spatial axis (zeros
        beyond the grid's ends).

    Raises:
        ValueError: for a grid shape that does not match the group, or a
            block smaller than the halo.

    Example:
        >>> g = tfhybrid.grid().group("model")                 # 4 ranks, 2x2 blocks
        >>> y = block_halo_exchange(x, g, (2, 2), [(1, 1), (1, 1)])
    """
    x = tf.convert_to_tensor(x)
    plan = block_halo_plan(x, group, shape, widths, name, method, all_groups)
    widths, sizes, nd = plan.widths, plan.sizes, len(shape)
    keep = [[v for v in (-1, 0, 1) if (v != -1 or lo) and (v != 1 or hi)] for lo, hi in widths]

    def forward(t):
        got, anchors = block_halo_pieces(t, plan)

        def build(prefix, d):
            if d == nd:
                if not any(prefix):
                    return t
                if prefix in got:
                    return got[prefix]
                pdims = piece_dims(prefix, widths, sizes, False)
                return tf.zeros(tf.concat([tf.shape(t)[:1], pdims, tf.shape(t)[-1:]], 0),
                                t.dtype)
            parts = [build(prefix + (v,), d + 1) for v in keep[d]]
            return tf.concat(parts, d + 1) if len(parts) > 1 else parts[0]
        return _anchored(build((), 0), anchors)

    def backward(dy):
        # our halo pieces' gradients go back where they came from; we get back
        # the gradients of the rows we sent and add them in place
        grads = {o: _piece(dy, o, widths, sizes, False) for o, _ in plan.receive_from}
        back, anchors = block_halo_return(grads, plan, dy)
        grad = _piece(dy, (0,) * nd, widths, sizes, False)
        # added in place at their rows: no block-sized temporaries
        grad = add_all_at(grad, [(back[o], sent_rows_begin(o, plan) + [0])
                                 for o, _ in plan.send_to])
        return _anchored(grad, anchors)

    @tf.custom_gradient
    def _block(t):
        def grad(dy):
            return tf.ensure_shape(backward(dy), t.shape)
        out = forward(t)
        return tf.ensure_shape(out, [t.shape[0]] + [n + lo + hi for n, (lo, hi) in
                                                    zip(sizes, widths)] + [t.shape[-1]]), grad

    return _block(x)


def _anchored(out, anchors):
    """``out`` with an empty slice of every alltoall output concatenated along
    axis 1: a data dependency, so a graph runs each alltoall even on a rank that
    only sends (Horovod's ops are not stateful: Grappler prunes an unused one,
    and a control dependency alone does not keep it)."""
    for a in anchors:
        shape = tf.concat([tf.shape(out)[:1], [0], tf.shape(out)[2:]], 0)
        out = tf.concat([out, tf.reshape(a[:0], shape)], 1)
    return out


def np_prod(values):
    out = 1
    for v in values:
        out *= int(v)
    return out
