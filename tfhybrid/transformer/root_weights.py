"""Global rank 0's weights on every rank while a model is transformed.

``tfhybrid.transform`` slices each rank's block of a partitioned layer from
the original model's weights on that rank. Users restore pretrained weights
(or build unseeded models) on rank 0 only, and the broadcast at the start of
training moves a sharded block only within its data group, so blocks sliced
from another rank's weights would never be replaced. :func:`root_weights`
therefore broadcasts the original model's weights from global rank 0 to
every rank before slicing (a collective, packed into few broadcasts per
dtype) and restores the original values afterwards, so the original model is
left as it was.
"""
from __future__ import annotations

import contextlib

import numpy as np
import tensorflow as tf

from tfhybrid import runtime
from tfhybrid.comm import backend

CHUNK_BYTES = 64 * 2**20


def _chunks(values):
    """Indices of ``values`` grouped by dtype, each group at most CHUNK_BYTES
    (a larger array gets a chunk of its own); same order on every rank."""
    by_dtype = {}
    for i, value in enumerate(values):
        by_dtype.setdefault(value.dtype.str, []).append(i)
    for dtype in sorted(by_dtype):
        chunk, size = [], 0
        for i in by_dtype[dtype]:
            if chunk and size + values[i].nbytes > CHUNK_BYTES:
                yield dtype, chunk
                chunk, size = [], 0
            chunk.append(i)
            size += values[i].nbytes
        if chunk:
            yield dtype, chunk


def broadcast_arrays(values, name):
    """Global rank 0's value of each numpy array (collective over the world)."""
    world = tuple(range(runtime.current_grid().size))
    out = list(values)
    for number, (dtype, chunk) in enumerate(_chunks(values)):
        flat = np.concatenate([values[i].reshape(-1) for i in chunk])
        flat = backend.broadcast(tf.constant(flat), 0, world, f"{name}.{dtype}.{number}").numpy()
        offset = 0
        for i in chunk:
            out[i] = flat[offset:offset + values[i].size].reshape(values[i].shape)
            offset += values[i].size
    return out


@contextlib.contextmanager
def root_weights(model):
    """Within the context, ``model`` holds global rank 0's weights on every rank.

    Collective: every rank must enter it with the same model architecture.
    Variables whose value differs from rank 0's are assigned rank 0's value
    and restored on exit. A no-op in a one-process world.

    Example:
        >>> with root_weights(model):
        ...     pmodel = rewrite(model, plan, grid)
    """
    if runtime.current_grid().size == 1:
        yield model
        return
    # Weights only: no metric state (a model compiled on rank 0 only must not
    # change the list) and no random-seed state (stays per rank).
    variables = list(model.weights)
    local = [np.asarray(v.numpy()) for v in variables]
    root = broadcast_arrays(local, "transform.root_weights")
    changed = []
    for var, mine, theirs in zip(variables, local, root):
        if not np.array_equal(mine, theirs):
            changed.append((var, mine))
            var.assign(theirs)
    try:
        yield model
    finally:
        for var, mine in changed:
            var.assign(mine)
