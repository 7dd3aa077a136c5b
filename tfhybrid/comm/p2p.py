"""Point-to-point row transfers between two ranks (pipeline stages).

Horovod has no send/recv. A transfer is one ``alltoall`` on the process set
of the two ranks, in which the sender sends all its rows to the receiver and
the receiver sends zero rows (docs/rank_heterogeneous.md). Both ranks must
issue the transfer under the same ``name``; the pair's process set must be
registered (collectively) with :func:`tfhybrid.comm.register_groups` first.

These are raw transfers, without a registered gradient: the pipeline
(:mod:`tfhybrid.transformer.pipeline`) writes its backward out, sending each
error back with the reverse transfer (the adjoint of moving rows is moving
their gradient back; no factor).

Anchoring: the receiver's zero-row input is derived from a tensor of the
step (``anchor``), never a constant. TensorFlow's shape inference evaluates
constant subgraphs while tracing, which would run the collective alone on
one rank (a hang).

Example:
    >>> pair = (0, 1)                              # registered process set
    >>> if rank == 0:
    ...     done = send_rows(h, pair, to=1, name="fwd.0")      # zero rows back
    ... else:
    ...     h = receive_rows(x, pair, (8, 8, 4), tf.float32, name="fwd.0")
"""
from __future__ import annotations

import tensorflow as tf

from tfhybrid.comm import backend


def send_rows(x, pair, to, name):
    """Send every row of ``x`` to global rank ``to`` of ``pair`` (a sorted pair of
    global ranks, this rank the other one). Returns the zero rows received (to
    be anchored into the step's result so the transfer is kept)."""
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
