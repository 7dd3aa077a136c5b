"""The collective algebra: differentiable layout changes over a group of ranks.

A tensor held by a group of K ranks is R (replicated), S(a) (split along
axis a, rank i holds block i) or P (partial: the true tensor is the sum over
ranks). Each primitive below is a ``tf.custom_gradient`` around one Horovod
collective on the group's process set, with the backward of the table
below (concepts.md#the-collective-algebra; Horovod's registered gradients
assume data parallelism and are not used):

=================  =====================================  ==============================
primitive          forward                                backward
=================  =====================================  ==============================
split(a)           R -> S(a): own block                   allgather along a
gather(a)          S(a) -> R: allgather along a           own block (consumers are R)
shard(a)           S(a) -> R: allgather along a           reduce-scatter sum (grad is P)
reduce             P -> R: allreduce sum                  identity
copy               R -> R: identity                       allreduce sum (grad is P)
halo(a, lo, hi)    S(a) -> S(a) + neighbours' rows        halo grads sent back and added
batch_gather       S(batch) -> R: allgather batch         reduce-scatter sum along batch
batch_scatter      R -> S(batch): own rows                allgather along batch
broadcast(r)       root r's x -> R: broadcast from r      sum to r (grad is P; zeros on
                                                          the others), or root's own
                                                          gradient (``partial_grad=False``)
to_root(r)         R -> root r's copy: identity           broadcast from r (root's
                                                          gradient becomes R)
=================  =====================================  ==============================

Every primitive takes ``group`` ("model", "data", "world" or a
:class:`tfhybrid.process_grid.Group`) and an optional ``name`` from which the
Horovod collective names are derived deterministically. On a group of one
rank each primitive is the identity.
"""
from __future__ import annotations

import tensorflow as tf

from tfhybrid import errors, hooks
from tfhybrid.comm import backend
from tfhybrid.process_grid import Group


def resolve_group(group) -> Group:
    """A :class:`Group` from a group name or a Group."""
    if isinstance(group, Group):
        return group
    if isinstance(group, str):
        return hooks.call("current_grid").group(group)
    raise TypeError(f"Received an invalid `group`: {group!r}; expected 'model', 'data', "
                    "'world' or a tfhybrid.process_grid.Group.")


# -- axis helpers ------------------------------------------------------------

def _axis(x, axis):
    rank = x.shape.rank
    if not -rank <= axis < rank:
        raise ValueError(f"Received axis={axis} for a tensor of rank {rank} (shape {x.shape}).")
    return axis % rank


def _perm_to_front(rank, axis):
    return [axis] + [i for i in range(rank) if i != axis]


def _inverse(perm):
    inv = [0] * len(perm)
    for i, p in enumerate(perm):
        inv[p] = i
    return inv


def _along(fn, x, axis):
    """Apply an axis-0 collective ``fn`` along ``axis``."""
    if axis == 0:
        return fn(x)
    perm = _perm_to_front(x.shape.rank, axis)
    return tf.transpose(fn(tf.transpose(x, perm)), _inverse(perm))


def _check_divisible(x, axis, k, what, g):
    n = x.shape[axis]
    if n is not None and n % k:
        raise errors.not_divisible(f"axis {axis} size", n, k, f"ranks of the {g.name} group",
                                   where=f"tfhybrid.comm.{what}: a tensor of shape {x.shape}")


def _block(x, axis, index, k):
    """Block ``index`` of ``k`` equal blocks along ``axis`` (static or dynamic size)."""
    n = x.shape[axis]
    if n is not None:
        b = n // k
        begin = [0] * x.shape.rank
        begin[axis] = index * b
        size = [-1] * x.shape.rank
        size[axis] = b
        return tf.slice(x, begin, size)
    b = tf.shape(x)[axis] // k
    begin = tf.one_hot(axis, x.shape.rank, on_value=index * b, off_value=0, dtype=tf.int32)
    size = tf.one_hot(axis, x.shape.rank, on_value=b, off_value=-1, dtype=tf.int32)
    return _with_axis_size(tf.slice(x, begin, size), x, axis, None)


def _with_axis_size(y, x, axis, size):
    """Give ``y`` the static shape of ``x`` with ``axis`` of ``size`` (if known)."""
    shape = x.shape.as_list()
    shape[axis] = size
    y.set_shape(shape)
    return y


def _allgather(x, axis, g, name):
    n = x.shape[axis]
    y = _along(lambda t: backend.allgather(t, g.ranks, name), x, axis)
    return _with_axis_size(y, x, axis, None if n is None else n * g.size)


def _reduce_scatter(x, axis, g, name):
    n = x.shape[axis]
    y = _along(lambda t: backend.reducescatter(t, g.ranks, name), x, axis)
    return _with_axis_size(y, x, axis, None if n is None else n // g.size)


def _name(name, prim, g):
    return f"{name or prim}.{g.name}"


def _conjugate_pair(x, g, name, forward, backward):
    """``forward(x, name)`` with gradient ``backward(dy, name + ".bwd")``; the
    identity on a group of one rank (no collective at all)."""
    if g.size == 1:
        return tf.identity(x)

    @tf.custom_gradient
    def _op(t):
        def grad(dy):
            return backward(dy, name + ".bwd")
        return forward(t, name), grad

    return _op(x)


# -- the primitives -------------------------------------------------------------

def split(x, axis=0, group="model", name=None):
    """R -> S(axis): keep this rank's block; backward all-gathers the gradient.

    Forward: no communication, block ``group.index`` of ``x``. Backward: the
    gradient of the block is all-gathered along ``axis`` (every rank needs the
    whole gradient of the replicated ``x``). Cost: one all-gather in backward.

    Args:
        x: Replicated tensor.
        axis: Axis to split.
        group: Group name or Group.
        name: Base of the collective names.

    Returns:
        Block ``group.index`` of ``group.size`` equal blocks along ``axis``.

    Raises:
        ValueError: if the axis does not split evenly.

    Example:
        >>> y = tfhybrid.comm.split(x, axis=-1, group="model")   # (B, 8) -> (B, 4) on 2 ranks
    """
    x = tf.convert_to_tensor(x)
    g, axis = resolve_group(group), _axis(x, axis)
    if g.size > 1:
        _check_divisible(x, axis, g.size, "split", g)
    return _conjugate_pair(x, g, _name(name, "split", g),
                           lambda t, nm: _block(t, axis, g.index, g.size),
                           lambda dy, nm: _allgather(dy, axis, g, nm))


def gather(x, axis=0, group="model", name=None):
    """S(axis) -> R: all-gather; backward keeps this rank's block of the gradient.

    Forward: all-gather of the blocks along ``axis``. Backward: this rank's
    block of the gradient, no communication. Use when the consumers of the
    gathered tensor compute replicated values, so its gradient is the same on
    every rank (R); when they are partitioned use :func:`shard`.

    Args:
        x: This rank's block S(axis); every rank holds the same shape.
        axis: Axis to gather along.
        group: Group name or Group.
        name: Base of the collective names.

    Returns:
        The whole tensor (``group.size`` times longer along ``axis``), the same
        on every rank of the group.

    Example:
        >>> full = tfhybrid.comm.gather(block, axis=1, group="model")  # (B, 4) -> (B, 8)
    """
    x = tf.convert_to_tensor(x)
    g, axis = resolve_group(group), _axis(x, axis)
    return _conjugate_pair(x, g, _name(name, "gather", g),
                           lambda t, nm: _allgather(t, axis, g, nm),
                           lambda dy, nm: _block(dy, axis, g.index, g.size))


def shard(x, axis=0, group="model", name=None):
    """S(axis) -> R: all-gather; backward reduce-scatters (sums) the gradient.

    Forward: all-gather along ``axis``, as :func:`gather`. Backward: the
    rank's gradients of the gathered tensor are partial (P), so they are
    summed and scattered: each rank gets the sum of its own block. Use when
    the consumers are partitioned (e.g. a channel-parallel layer after it).

    Args:
        x: This rank's block S(axis).
        axis: Axis to gather along.
        group: Group name or Group.
        name: Base of the collective names.

    Returns:
        The whole tensor along ``axis``, the same on every rank.

    Example:
        >>> full = tfhybrid.comm.shard(block, axis=0, group="model")
    """
    x = tf.convert_to_tensor(x)
    g, axis = resolve_group(group), _axis(x, axis)
    return _conjugate_pair(x, g, _name(name, "shard", g),
                           lambda t, nm: _allgather(t, axis, g, nm),
                           lambda dy, nm: _reduce_scatter(dy, axis, g, nm))


def reduce(x, group="model", name=None):
    """P -> R: all-reduce (sum); backward is the identity.

    Forward: the ranks hold partial sums of one tensor (e.g. the outputs of a
    channel-parallel layer); the all-reduce gives every rank the total.
    Backward: the gradient of a replicated output is the same on every rank
    and is the gradient of each partial term, so it passes unchanged.

    Args:
        x: This rank's partial term P.
        group: Group name or Group.
        name: Base of the collective names.

    Returns:
        The sum over the group, the same on every rank.

    Example:
        >>> y = tfhybrid.comm.reduce(x @ w_block, group="model")   # channel-parallel matmul
    """
    x = tf.convert_to_tensor(x)
    g = resolve_group(group)
    return _conjugate_pair(x, g, _name(name, "reduce", g),
                           lambda t, nm: backend.allreduce(t, g.ranks, nm),
                           lambda dy, nm: tf.identity(dy))


def copy(x, group="model", name=None):
    """R -> R: identity; backward all-reduces (sums) the partial gradient.

    Forward: nothing moves. Backward: the replicated input feeds partitioned
    consumers, so each rank's gradient is partial (P) and the all-reduce sums
    it. The adjoint of :func:`reduce` (Megatron's "f" operator).

    Args:
        x: Replicated tensor.
        group: Group name or Group.
        name: Base of the collective names.

    Returns:
        ``x`` unchanged.

    Example:
        >>> h = tfhybrid.comm.copy(x, group="model") @ w_columns   # filter-parallel matmul
    """
    x = tf.convert_to_tensor(x)
    g = resolve_group(group)
    return _conjugate_pair(x, g, _name(name, "copy", g),
                           lambda t, nm: tf.identity(t),
                           lambda dy, nm: backend.allreduce(dy, g.ranks, nm))


def batch_gather(x, group="model", name=None):
    """S(batch) -> R: all-gather the group's local batches (SplitBrain Lm).

    Forward: the group's K local batches of B rows become one batch of K*B
    rows on every rank (SplitBrain's modulo layer, "BK" scheme). Backward:
    reduce-scatter (sum) along the batch axis, since the model-parallel
    layers after it make each rank's gradient partial. :func:`shard` on axis 0.

    Args:
        x: This rank's local batch; every rank of the group holds as many rows.
        group: Group name or Group.
        name: Base of the collective names.

    Returns:
        The K*B rows of the group, in group order.

    Example:
        >>> rows = tfhybrid.comm.batch_gather(features, group="model")   # (B, F) -> (K*B, F)
    """
    return shard(x, axis=0, group=group, name=name or "batch_gather")


def batch_scatter(x, group="model", name=None):
    """R -> S(batch): keep this rank's rows; backward all-gathers along batch.

    The inverse of :func:`batch_gather` at the end of a model-parallel region:
    each rank keeps its own B of the K*B rows. Backward: all-gather of the
    row gradients. :func:`split` on axis 0.

    Args:
        x: The group's K*B rows, replicated.
        group: Group name or Group.
        name: Base of the collective names.

    Returns:
        Rows ``[index*B, (index+1)*B)``.

    Example:
        >>> own = tfhybrid.comm.batch_scatter(logits, group="model")   # (K*B, C) -> (B, C)
    """
    return split(x, axis=0, group=group, name=name or "batch_scatter")


def broadcast(x, root=0, group="model", name=None, partial_grad=True):
    """Group rank ``root``'s ``x`` -> R: broadcast; backward sums the gradient to ``root``.

    Forward: every rank of the group gets ``root``'s tensor (the others'
    ``x`` only give the shape). Backward: with ``partial_grad=True`` (the
    consumers are partitioned, so each rank's gradient is a partial term P)
    the gradients are summed on ``root`` (a rooted reduce) and the other
    ranks' ``x`` get zeros; with ``partial_grad=False`` (consumers
    replicated: the gradient is R) ``root`` keeps its own gradient, no
    communication. SplitBrain's "B" scheme: the model group's ranks take
    turns broadcasting their rows.

    Args:
        x: This rank's tensor; the same shape on every rank of the group.
        root: Index of the sending rank within the group (0..size-1).
        group: Group name or Group.
        name: Base of the collective names.
        partial_grad: The layout of the output's gradient: P (True) or R.

    Returns:
        ``root``'s ``x`` on every rank of the group.

    Example:
        >>> rows = tfhybrid.comm.broadcast(features, root=1, group="model")
    """
    x = tf.convert_to_tensor(x)
    g = resolve_group(group)
    root = _check_root(root, g)
    src = g.ranks[root]
    nm = _name(name, f"broadcast{root}", g)

    def backward(dy, name):
        if partial_grad:
            return backend.reduce_to(dy, src, g.ranks, name)
        return dy if g.index == root else backend.zeros_reading(dy)

    return _conjugate_pair(x, g, nm,
                           lambda t, n: _same_shape(backend.broadcast(t, src, g.ranks, n), t),
                           lambda dy, n: _same_shape(backward(dy, n), x))


def to_root(x, root=0, group="model", name=None):
    """R -> the copy group rank ``root`` uses: identity; backward broadcasts from ``root``.

    The adjoint of a rooted reduce: a replicated tensor of which only
    ``root`` consumes the value (e.g. the outputs computed for ``root``'s
    rows in SplitBrain's "B" scheme). Its gradient is ``root``'s, broadcast
    so that every rank back-propagates the same (R) gradient. The other
    ranks' downstream gradient is ignored (it is zero where they do not
    use the value).

    Args:
        x: Replicated tensor.
        root: Index of the consuming rank within the group.
        group: Group name or Group.
        name: Base of the collective names.

    Returns:
        ``x`` unchanged.

    Example:
        >>> y = tfhybrid.comm.to_root(logits, root=1, group="model")
    """
    x = tf.convert_to_tensor(x)
    g = resolve_group(group)
    root = _check_root(root, g)
    src = g.ranks[root]
    return _conjugate_pair(x, g, _name(name, f"to_root{root}", g),
                           lambda t, n: tf.identity(t),
                           lambda dy, n: _same_shape(backend.broadcast(dy, src, g.ranks, n), x))


def _check_root(root, g):
    if isinstance(root, bool) or not isinstance(root, int) or not 0 <= root < g.size:
        raise ValueError(f"Received an invalid value for `root`: root={root!r}; expected the "
                         f"index of a rank of the {g.name} group, an integer in "
                         f"[0, {g.size}).")
    return root


def _same_shape(y, x):
    y.set_shape(x.shape)
    return y
