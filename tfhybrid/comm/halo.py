"""Halo exchange between neighbouring ranks of a group (domain parallelism).

A tensor split along ``axis`` over a group (S(axis)) is extended with ``lo``
rows from the previous rank of the group and ``hi`` rows from the next one;
beyond the group's ends the halo is zeros (the global zero padding of a
convolution). Both directions travel in one Horovod ``alltoall`` whose
split sizes are zero except towards the two neighbours; the backward sends
the halo gradients back the same way and adds them to the boundary rows.
"""
from __future__ import annotations

import tensorflow as tf

from tfhybrid.comm import backend
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
