"""Point-to-point and rooted row transfers: raw helpers and differentiable primitives.

Horovod has no send/recv. A transfer is one ``alltoall`` on a small process
set in which each member says how many of its rows go to each other member
(zero rows to everyone else; docs/rank_heterogeneous.md). The adjoint of an
alltoall is the reverse alltoall, so each differentiable primitive below is a
``tf.custom_gradient`` whose backward moves the gradient rows back, with no
factor: the gradient that arrives is the single-process gradient of the
moved rows.

=================  ======================================  ==================================
primitive          forward                                 backward
=================  ======================================  ==================================
send_recv(s, d)    rows of x on s -> d (pair's set)        d's gradient -> s
gather_to(r)       every member's rows -> r, concatenated  r's gradient split by the received
                   in group order (many-to-one)            row counts, each block back to its
                                                           sender (one-to-many)
scatter_from(r)    r's rows split by ``sizes`` -> members  every member's gradient -> r,
                   (one-to-many)                           concatenated (many-to-one)
=================  ======================================  ==================================

``scatter_from`` with the row counts of a ``gather_to`` is its adjoint.

**What each rank passes and gets.** A rank that receives rows and sends none
passes an *anchor* as ``x``: a tensor with the payload's trailing shape and
dtype computed in the step (e.g. :func:`anchor_like`, or the sender's
payload shape of zeros; its rows are not sent). A rank that sends rows and
receives none gets zero rows back. Then, for ``tape.gradient`` and
``tf.function`` to run every rank's half of the backward transfer:

* the sender adds :func:`token` of its (zero-row) output to its objective:
  a zero scalar through which ``tape.gradient`` reaches the primitive's
  backward, which brings the receiver's gradient into ``x`` (and so into the
  sender's weights);
* the receiver asks ``tape.gradient`` for the anchor's gradient too (zeros
  of the anchor's shape, computed from the backward transfer) and makes it
  reach the step's result, e.g. ``loss + token(d_anchor)``.

Inside ``tf.function`` a collective whose result feeds nothing returned is
pruned on that rank alone (the partner then waits forever), hence the
tokens. Two other traps of traced steps are handled here: Grappler merges
identical ops (two zero-row inputs read from the same anchor would be one
collective: each zero-row input carries a distinct constant, which an empty
tensor ignores), and a collective on constant inputs is run alone while the
function is optimised (every zero-row input reads the anchor or the
forward's result, never a constant).

Every rank of ``group`` may call a primitive (SPMD): a rank outside the
transfer (``send_recv`` between two other ranks) gets ``x[:0]`` and issues
no collective. The ranks of one transfer must issue their primitives on it in
the same order. ``send_recv`` runs on the process set of its pair of ranks,
which must be registered first, collectively on every rank
(``tfhybrid.comm.register_groups([(a, b), ...])``); ``gather_to`` and
``scatter_from`` run on the group's set.

Raw transfers (no registered gradient; the pipeline writes its backward out
with them): :func:`send_rows`, :func:`receive_rows`, :func:`anchored`.

Example:
    >>> tfhybrid.comm.register_groups([(0, 1)])                # on every rank
    >>> with tf.GradientTape() as tape:
    ...     if rank == 0:
    ...         y = send_recv(h, src=0, dst=1, group="world")    # zero rows
    ...         objective = loss0 + token(y)
    ...     else:
    ...         anchor = anchor_like(x, (8, 8, 4))
    ...         tape.watch(anchor)
    ...         y = send_recv(anchor, src=0, dst=1, group="world")   # rank 0's rows
    ...         objective = loss1(y)
"""
from __future__ import annotations

import itertools

import tensorflow as tf

from tfhybrid import errors
from tfhybrid.comm import backend
from tfhybrid.comm.primitives import resolve_group

# A distinct constant per zero-row collective input (see the module docstring).
_SALT = itertools.count(1)


# -- raw transfers (used by tfhybrid.transformer.pipeline) --------------------

def send_rows(x, pair, to, name):
    """Send every row of ``x`` to global rank ``to`` of ``pair`` (a sorted pair of
    global ranks, this rank the other one). Returns the zero rows received (to
    be anchored into the step's result so the transfer is kept).

    Send each tensor once per traced function: Grappler merges identical ops,
    and two sends of the same tensor (same splits, only the names differ)
    become one collective, so the partner waits forever in its second receive
    (eight sends of one tensor against a chain of eight receives hung between
    two test hosts). The pipeline sends each micro-batch's own output."""
    pair = tuple(pair)
    index = pair.index(to)
    splits = tf.one_hot(index, 2, on_value=tf.shape(x, out_type=tf.int32)[0], off_value=0,
                        dtype=tf.int32)
    return backend.alltoall(x, splits, pair, name)


def receive_rows(anchor, pair, shape, dtype, name):
    """The rows the other rank of ``pair`` sends under ``name`` (shape ``(rows,) + shape``).

    ``anchor``: a tensor of this step holding data (its first row feeds the
    transfer's empty input). Receives must have distinct anchors: Grappler
    merges identical ops (common subexpression elimination), and two receives
    with the same input would become one; chain them (anchor each receive on
    the previous one's result).
    """
    anchor = tf.nest.flatten(anchor)[0]
    # Adding a scalar to an empty tensor leaves it empty, whatever the value.
    empty = tf.zeros((0,) + tuple(shape), dtype) + tf.cast(tf.reduce_sum(anchor[:1]), dtype)
    out = backend.alltoall(empty, tf.zeros([2], tf.int32), tuple(pair), name)
    out.set_shape(tf.TensorShape([None]).concatenate(tuple(shape)))
    return out


def anchored(value, tensors):
    """``value`` plus zero terms reading each of ``tensors`` (keeps their ops in the step)."""
    for t in tensors:
        value = value + tf.cast(tf.reduce_sum(t[:0]), value.dtype)
    return value


# -- helpers of the differentiable primitives ------------------------------------

def token(y, dtype=tf.float32):
    """A zero scalar computed from ``y``'s first zero rows.

    Add it to a rank's objective (or to the value a traced step returns) so
    that the operations producing ``y`` run there and ``tape.gradient``
    passes through them: a sender's zero-row output of :func:`send_recv` or
    :func:`gather_to`, a receiver's anchor gradient.

    Args:
        y: A tensor of rank >= 1.
        dtype: The scalar's dtype (that of the objective).

    Returns:
        ``0`` of ``dtype``, depending on ``y``.

    Example:
        >>> objective = loss + token(sent)
    """
    y = tf.convert_to_tensor(y)
    _check_rank(y, "token")
    return tf.cast(tf.reduce_sum(tf.cast(y[:0], tf.float32)), dtype)


def anchor_like(t, shape, dtype=tf.float32):
    """Zero rows of trailing shape ``shape`` computed from ``t`` (not a constant).

    The input a receiving rank passes to :func:`send_recv` or
    :func:`scatter_from`: only its trailing shape and dtype count. Computed
    from a tensor of the step, because a constant input would let
    TensorFlow run the collective alone while tracing or optimising.

    Args:
        t: Any tensor of the step with rank >= 1 (e.g. the batch).
        shape: Trailing shape of the rows to receive (without the row axis).
        dtype: Their dtype.

    Returns:
        A ``(0,) + shape`` tensor of ``dtype``.

    Example:
        >>> anchor = anchor_like(x, (8, 8, 4))
    """
    t = tf.nest.flatten(t)[0]
    _check_rank(t, "anchor_like")
    return tf.zeros((0,) + tuple(shape), dtype) + tf.cast(token(t), dtype)


def _check_rank(x, what):
    if x.shape.rank is not None and x.shape.rank < 1:
        raise errors.invalid_value("x", f"a tensor of shape {x.shape}", "a tensor of rank >= 1 "
                                   "(rows along axis 0)", where=f"tfhybrid.comm.p2p.{what}")


def _check_index(value, name, g, where):
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < g.size:
        raise errors.invalid_value(name, value, f"the index of a rank of the {g.name} group, an "
                                   f"integer in [0, {g.size})", where=f"tfhybrid.comm.p2p.{where}")
    return value


def _rows(t):
    return tf.shape(t, out_type=tf.int32)[0]


def _to(index, k, rows):
    """Splits sending ``rows`` rows to group index ``index`` and none elsewhere."""
    return tf.one_hot(index, k, on_value=rows, off_value=0, dtype=tf.int32)


def _nothing(k):
    return tf.zeros([k], tf.int32)


def _empty(like, reads):
    """``like[:0]`` (no rows) reading ``reads``, distinct from every other call's.

    The distinct constant is added in float32 (exact integers below 2**24)
    before the cast, so nodes stay distinct whatever ``like``'s dtype."""
    salt = float(next(_SALT) % (1 << 24))
    return like[:0] + tf.cast(token(reads) + salt, like.dtype)


def _zeros_reading(x, t):
    """Zeros of ``x``'s shape that read ``t`` (so ``t``'s collective is kept)."""
    return tf.zeros_like(x) + tf.cast(token(t), x.dtype)


def _rows_of(y, like):
    """``y`` with ``like``'s trailing static shape and unknown rows."""
    y.set_shape(tf.TensorShape([None]).concatenate(like.shape[1:]))
    return y


def _shaped(y, like):
    y.set_shape(like.shape)
    return y


def _differentiable(x, forward, backward):
    """``forward(x) -> (y, saved)`` with gradient ``backward(dy, y, saved)``."""
    @tf.custom_gradient
    def _op(t):
        y, saved = forward(t)

        def grad(dy):
            return backward(dy, y, saved)
        return y, grad

    return _op(x)


# -- the differentiable primitives ----------------------------------------------------

def send_recv(x, src, dst, group="world", name=None):
    """Rows of ``x`` on group rank ``src`` -> group rank ``dst``; backward: ``dst``'s gradient -> ``src``.

    One alltoall on the process set of the two ranks (register it first with
    ``tfhybrid.comm.register_groups``). On ``src``, ``x`` is the payload and
    the result is its zero rows (add :func:`token` of it to the objective);
    on ``dst``, ``x`` is an anchor with the payload's trailing shape and
    dtype (:func:`anchor_like`) and the result is ``src``'s rows; its
    gradient is zeros that carry the backward transfer (take it from
    ``tape.gradient`` and feed it into the step's result). Other ranks of the
    group get ``x[:0]`` and issue nothing. ``src == dst`` is the identity.

    Backward: the gradient of the rows on ``dst`` becomes the gradient of
    ``x`` on ``src``, unchanged (no factor).

    Args:
        x: The payload on ``src``; an anchor on ``dst``; anything of the same
            trailing shape elsewhere. Rank >= 1, rows along axis 0.
        src: Index of the sending rank within ``group``.
        dst: Index of the receiving rank within ``group``.
        group: Group name ("model", "data", "world") or a
            :class:`tfhybrid.process_grid.Group`.
        name: Base of the collective names (the pair is appended).

    Returns:
        ``src``'s rows on ``dst``; zero rows elsewhere.

    Raises:
        ValueError: ``src`` or ``dst`` not an index of the group; no process
            set registered for the pair.

    Example:
        >>> y = send_recv(h if stage == 0 else anchor_like(x, h_shape), 0, 1, group="model")
    """
    x = tf.convert_to_tensor(x)
    _check_rank(x, "send_recv")
    g = resolve_group(group)
    a = g.ranks[_check_index(src, "src", g, "send_recv")]
    b = g.ranks[_check_index(dst, "dst", g, "send_recv")]
    me = g.ranks[g.index]
    if me not in (a, b):
        return x[:0]
    if a == b:
        return tf.identity(x)
    pair = (a, b) if a < b else (b, a)
    nm = f"{name or 'send_recv'}.{a}to{b}"

    if me == a:
        def forward(t):
            y = backend.alltoall(t, _to(pair.index(b), 2, _rows(t)), pair, nm)
            return _rows_of(y, t), None

        def backward(dy, y, _):
            back = backend.alltoall(_empty(y, dy), _nothing(2), pair, nm + ".bwd")
            return _shaped(back, x)
    else:
        def forward(t):
            y = backend.alltoall(_empty(t, t), _nothing(2), pair, nm)
            return _rows_of(y, t), None

        def backward(dy, y, _):
            sent = backend.alltoall(dy, _to(pair.index(a), 2, _rows(dy)), pair, nm + ".bwd")
            return _zeros_reading(x, sent)
    return _differentiable(x, forward, backward)


def gather_to(x, root=0, group="model", name=None):
    """Every member's rows -> group rank ``root``, concatenated in group order (many-to-one).

    One alltoall on the group's process set: each member sends all its rows
    to ``root`` (members may hold different numbers of rows). Non-root
    members get zero rows (add :func:`token` of them to the objective).
    Backward: ``root``'s gradient is split by the row counts it received in
    the forward and each block goes back to its sender (one-to-many), which
    gets the gradient of its own rows unchanged (no factor). The adjoint is
    :func:`scatter_from` with those counts.

    Args:
        x: This member's rows (rank >= 1; trailing shape and dtype equal on
            every member).
        root: Index of the receiving rank within ``group``.
        group: Group name or :class:`tfhybrid.process_grid.Group`.
        name: Base of the collective names.

    Returns:
        On ``root``, the group's rows in group order; zero rows elsewhere.

    Example:
        >>> rows = gather_to(h, root=2, group=fc_group)   # Stanza: CONV rows to the FC worker
    """
    x = tf.convert_to_tensor(x)
    _check_rank(x, "gather_to")
    g = resolve_group(group)
    root = _check_index(root, "root", g, "gather_to")
    if g.size == 1:
        return tf.identity(x)
    k, nm = g.size, f"{name or 'gather_to'}{root}.{g.name}"

    def forward(t):
        y, counts = backend.alltoall(t, _to(root, k, _rows(t)), g.ranks, nm, received=True)
        return _rows_of(y, t), counts

    def backward(dy, y, counts):
        if g.index == root:     # each sender's block of the gradient back to it
            back = backend.alltoall(dy, counts, g.ranks, nm + ".bwd")
        else:
            back = backend.alltoall(_empty(y, dy), _nothing(k), g.ranks, nm + ".bwd")
        return _shaped(back, x)
    return _differentiable(x, forward, backward)


def scatter_from(x, root=0, sizes=None, group="model", name=None):
    """Group rank ``root``'s rows split by ``sizes`` -> the members (one-to-many).

    One alltoall on the group's process set: ``root`` sends rows
    ``[sum(sizes[:i]), sum(sizes[:i+1]))`` of ``x`` to member ``i`` (itself
    included). Other members pass an anchor with the rows' trailing shape
    and dtype (:func:`anchor_like`); its gradient is zeros that carry the
    backward transfer (take it from ``tape.gradient`` and feed it into the
    step's result). Backward: every member's gradient goes back to ``root``,
    concatenated in group order (many-to-one): the adjoint of
    :func:`gather_to`.

    Args:
        x: The rows on ``root``; an anchor elsewhere. Rank >= 1.
        root: Index of the sending rank within ``group``.
        sizes: Rows per member in group order (``group.size`` non-negative
            ints or an int32 tensor; read on ``root`` only, where they must
            add up to the rows of ``x``).
        group: Group name or :class:`tfhybrid.process_grid.Group`.
        name: Base of the collective names.

    Returns:
        This member's block.

    Raises:
        ValueError: ``sizes`` of the wrong length, negative, or (static) not
            adding up to the rows of ``x`` on ``root``.

    Example:
        >>> mine = scatter_from(errors if fc else anchor_like(x, shape), root=2,
        ...                     sizes=[4, 4, 0], group=fc_group)
    """
    x = tf.convert_to_tensor(x)
    _check_rank(x, "scatter_from")
    g = resolve_group(group)
    root = _check_index(root, "root", g, "scatter_from")
    k = g.size
    if g.index == root:
        sizes = _check_sizes(sizes, k, x)
    if k == 1:
        return tf.identity(x)
    nm = f"{name or 'scatter_from'}{root}.{g.name}"

    def forward(t):
        if g.index == root:
            y = backend.alltoall(t, sizes, g.ranks, nm)
        else:
            y = backend.alltoall(_empty(t, t), _nothing(k), g.ranks, nm)
        return _rows_of(y, t), None

    def backward(dy, y, _):
        back = backend.alltoall(dy, _to(root, k, _rows(dy)), g.ranks, nm + ".bwd")
        return _shaped(back, x) if g.index == root else _zeros_reading(x, back)
    return _differentiable(x, forward, backward)


def _check_sizes(sizes, k, x):
    where = "tfhybrid.comm.p2p.scatter_from"
    if tf.is_tensor(sizes):
        if sizes.shape.rank != 1 or sizes.shape[0] not in (None, k):
            raise errors.invalid_value("sizes", f"a tensor of shape {sizes.shape}",
                                       f"{k} row counts, one per member", where=where)
        return tf.cast(sizes, tf.int32)
    if sizes is None or len(sizes) != k or any(
            isinstance(s, bool) or not isinstance(s, int) or s < 0 for s in sizes):
        raise errors.invalid_value("sizes", sizes, f"{k} non-negative integers, the rows for "
                                   "each member in group order", where=where)
    if x.shape[0] is not None and sum(sizes) != x.shape[0]:
        raise errors.invalid_value("sizes", sizes, f"row counts adding up to the {x.shape[0]} "
                                   "rows of x on the root", where=where)
    return tf.constant(list(sizes), tf.int32)
