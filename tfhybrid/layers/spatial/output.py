"""Per-voxel outputs kept in spatial blocks (U-Net segmentation under s/ds).

When the last layers of a model run on spatial blocks (a 1x1 convolution and
a softmax per voxel), :func:`tfhybrid.transform` leaves the output split:
rank ``r`` of a model group outputs its block of every sample, nothing is
gathered to full resolution. Three things follow, all handled here or by
the functions that read :data:`SPLIT_OUTPUTS_ATTR`:

* **labels** are split the same way: :func:`tfhybrid.data.shard` with
  ``model=`` keeps this rank's block of ``y`` (and of a per-voxel
  ``sample_weight``) along the split axes (:func:`label_block`);
* **the loss**: Keras averages the per-voxel losses of this rank's block
  (``sum_over_batch_size`` divides by the block's voxel count, also with a
  ``sample_weight``). The blocks are equal, so the loss of the whole volume
  is the mean of the blocks' losses: :func:`install_split_outputs` makes
  ``compute_loss`` return that mean over the model group (one scalar
  allreduce per step) whose backward gives each block's loss the weight
  ``1/K``; the partial gradients the DistributedOptimizer sums over the
  group are then those of the whole-volume loss;
* **metrics**: their states hold counts and sums of this rank's voxels, so
  ``evaluate`` sums them over every rank (:func:`tfhybrid.guards.metric_ranks`).

Models with split and replicated outputs (a segmentation and a
classification head) train exactly too: the gradient of each replicated
output is scaled by ``K`` before the group mean's ``1/K``, so it enters
once, as without split outputs; their labels stay whole.
"""
from __future__ import annotations

import types

import numpy as np
import tensorflow as tf

from tfhybrid import runtime

SPLIT_OUTPUTS_ATTR = "_tfhybrid_split_outputs"
SPATIAL_GRID_ATTR = "_tfhybrid_output_grid"


def install_split_outputs(model, split_outputs, spatial):
    """Mark ``model``'s outputs split over the spatial grid and average its loss
    over the model group.

    Args:
        model: The transformed Keras model (instance-level wrapper).
        split_outputs: One bool per model output: True when it stays in blocks.
        spatial: The block grid ((ph, pw) or (pd, ph, pw)) over the model group.
    """
    object.__setattr__(model, SPLIT_OUTPUTS_ATTR, tuple(bool(s) for s in split_outputs))
    object.__setattr__(model, SPATIAL_GRID_ATTR, tuple(spatial))
    cls = type(model)

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        flags = getattr(self, SPLIT_OUTPUTS_ATTR)
        if not all(flags) and y_pred is not None:
            y_pred = _replicated_outputs_whole(y_pred, flags)
        loss = cls.compute_loss(self, x, y, y_pred, sample_weight, training=training)
        return group_mean(loss, "split_output.loss")

    object.__setattr__(model, "compute_loss", types.MethodType(compute_loss, model))
    return model


def group_mean(value, name):
    """Mean of a scalar over this rank's model group; its gradient is ``dy / K``.

    Every rank then holds the loss of the whole volume, and each block's loss
    enters the (summed) gradient once with weight ``1/K``.
    """
    group = runtime.current_grid().group("model")
    if group.size == 1:
        return value
    from tfhybrid.comm import backend

    k = float(group.size)

    @tf.custom_gradient
    def _mean(t):
        def grad(dy):
            return dy / k
        return backend.allreduce(t, group.ranks, name, average=True), grad

    return _mean(tf.convert_to_tensor(value))


def _replicated_outputs_whole(y_pred, flags):
    """``y_pred`` with the gradient of every replicated (not split) output scaled
    by ``K``: the group mean's backward divides every loss term by ``K``, right
    for the blocks' losses, while a replicated output's loss is the same on
    every rank and must enter once."""
    k = runtime.current_grid().group("model").size
    flat = tf.nest.flatten(y_pred)
    if k == 1 or len(flat) != len(flags):
        return y_pred

    @tf.custom_gradient
    def _whole(t):
        return tf.identity(t), lambda dy: dy * k

    flat = [t if split else _whole(t) for t, split in zip(flat, flags)]
    return tf.nest.pack_sequence_as(y_pred, flat)


def split_outputs_of(model):
    """(split flags per output, block grid) of a transformed model, or None when
    no output stays in spatial blocks."""
    flags = getattr(model, SPLIT_OUTPUTS_ATTR, None)
    if not flags or not any(flags):
        return None
    return flags, getattr(model, SPATIAL_GRID_ATTR)


def block_coords(spatial):
    """This rank's block coordinates in the model group's row-major block grid."""
    from tfhybrid.process_grid import _unravel

    return _unravel(runtime.current_grid().model_rank, tuple(spatial))


def label_block(t, spatial, what="labels"):
    """This rank's block of a per-voxel tensor ``(batch, spatial..., [channels])``.

    Tensors of fewer than ``1 + len(spatial)`` axes (per-sample labels or
    weights) are returned unchanged, as are axes of size 1 (weights shaped
    ``(batch, 1, 1)`` broadcast over the voxels). Works on numpy arrays and on (traced)
    tensors.

    Raises:
        ValueError: when a split axis does not divide over its blocks.
    """
    ndim = len(spatial)
    shape = tuple(t.shape)
    if len(shape) < ndim + 1:
        return t
    coords = block_coords(spatial)
    for d, (parts, c) in enumerate(zip(spatial, coords)):
        size = shape[d + 1]
        if parts == 1 or size == 1:     # not split, or broadcast (e.g. (batch, 1, 1) weights)
            continue
        if size is None:
            raise ValueError(f"tfhybrid.data.shard: the {what} have an unknown size along "
                             f"spatial axis {d + 1}; per-voxel {what} of a model with split "
                             "outputs need static spatial sizes.")
        if size % parts:
            raise ValueError(f"tfhybrid.data.shard: the {what} of shape {shape} cannot be "
                             f"split into {parts} blocks along axis {d + 1} like the model's "
                             f"split output (grid {tuple(spatial)}); their spatial sizes must "
                             "equal the output's.")
        n = size // parts
        if isinstance(t, np.ndarray):
            t = np.take(t, np.arange(c * n, (c + 1) * n), axis=d + 1)
        else:
            begin = [0] * len(shape)
            sizes = [-1] * len(shape)
            begin[d + 1], sizes[d + 1] = c * n, n
            t = tf.slice(t, begin, sizes)
    return t


def split_labels(element, spatial, flags=None):
    """A ``(x, y[, sample_weight])`` element with ``y`` and a per-voxel
    ``sample_weight`` cut to this rank's spatial block (``x`` stays whole:
    the model's SpatialScatter splits it).

    ``flags``: per model output, True when it is split. With several outputs
    and ``y`` a list/tuple of one entry per output, only the entries of split
    outputs are cut (a classification head's labels stay whole).
    """
    if not isinstance(element, (tuple, list)) or len(element) < 2:
        return element
    out = list(element)
    for i, what in ((1, "labels"), (2, "sample weights")):
        if i < len(out) and out[i] is not None:
            out[i] = _cut(out[i], spatial, flags, what)
    return type(element)(out) if isinstance(element, tuple) else out


def _cut(value, spatial, flags, what):
    def cut(t):
        return label_block(t, spatial, what)

    if flags is not None and len(flags) > 1 and isinstance(value, (tuple, list)) and \
            len(value) == len(flags):
        parts = [tf.nest.map_structure(cut, v) if split else v for v, split in zip(value, flags)]
        return type(value)(parts)
    return tf.nest.map_structure(cut, value)
