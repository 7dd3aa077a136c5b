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
from tfhybrid.batch_losses import BlockRowsLoss

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
        _wrap_compiled_losses(self, flags)
        loss = cls.compute_loss(self, x, y, y_pred, sample_weight, training=training)
        if loss is not None:
            loss = loss + tf.cast(_replicated_regularization(self), loss.dtype)
        return group_mean(loss, "split_output.loss")

    object.__setattr__(model, "compute_loss", types.MethodType(compute_loss, model))
    return model


def install_block_losses(model):
    """For a model whose output is gathered but whose spatial region holds layers
    with their own losses (activity regularisers, ActivityRegularization): make
    the reported loss include every block's share.

    Each rank's loss holds the activity loss of its own block only; the
    gradients are right (each block's share reaches its partial weights,
    summed by the optimizer), but the loss value (logs, ``evaluate``) lacked
    the other blocks. ``compute_loss`` adds, without gradient, the other
    blocks' shares (one scalar allreduce over the model group per step).
    Models without such layers are left unchanged.
    """
    k = runtime.current_grid().group("model").size
    if k == 1 or not any(_has_own_losses(layer) for layer in model._flatten_layers(
            include_self=False) if getattr(layer, "_tfhybrid_on_blocks", False)):
        return model
    cls = type(model)

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        loss = cls.compute_loss(self, x, y, y_pred, sample_weight, training=training)
        terms = [tf.reduce_sum(tf.cast(v, tf.float32))
                 for layer in self._flatten_layers(include_self=False)
                 if getattr(layer, "_tfhybrid_on_blocks", False)
                 for v in layer._get_own_losses()]
        if loss is None or not terms:
            return loss
        own = tf.stop_gradient(tf.add_n(terms))
        from tfhybrid.comm import backend

        group = runtime.current_grid().group("model")
        total = backend.allreduce(own, group.ranks, "block_losses.sum")
        return loss + tf.cast(total - own, loss.dtype)

    object.__setattr__(model, "compute_loss", types.MethodType(compute_loss, model))
    return model


def _has_own_losses(layer):
    return getattr(layer, "activity_regularizer", None) is not None or \
        type(layer).__name__ == "ActivityRegularization"


def _wrap_compiled_losses(model, flags):
    """Make the compiled loss of every split output the whole volume's share.

    ``compute_loss``'s group mean is right for ``sum_over_batch_size``/``mean``
    (equal blocks). A split output's ``reduction="sum"`` loss is multiplied by
    ``K x D`` (``D`` data groups: the optimizer averages their gradients), so the
    group mean of ``K`` block sums is the volume's sum and the data groups' mean
    the global batch's sum; ``"mean_with_sample_weight"`` becomes ``K x D x``
    (block's weighted sum) / (sum of the weights over every rank's rows and blocks).
    Wrapped once per compile (Keras builds the compiled loss on its first call).
    """
    compiled = getattr(model, "_compile_loss", None)
    if compiled is None or getattr(compiled, "_tfhybrid_split_wrapped", False):
        return
    object.__setattr__(compiled, "_tfhybrid_split_wrapped", True)
    build = compiled.build

    def build_and_wrap(y_true, y_pred):
        build(y_true, y_pred)
        _wrap_flat_losses(model, compiled, flags)

    compiled.build = build_and_wrap
    if compiled.built:
        _wrap_flat_losses(model, compiled, flags)


def output_index(model, path):
    """The position among ``model``'s outputs of the output at loss-structure ``path``
    (None when no output has that name)."""
    if not path:
        return 0
    head = path[0]
    if isinstance(head, int):
        return head
    names = list(getattr(model, "output_names", []) or [])
    return names.index(head) if head in names else None


def _wrap_flat_losses(model, compiled, flags):
    import keras

    spatial = getattr(model, SPATIAL_GRID_ATTR)
    grid = runtime.current_grid()
    k = grid.group("model").size
    for i, entry in enumerate(list(compiled._flat_losses)):
        out = output_index(model, entry.path)
        if out is None or out >= len(flags) or not flags[out]:
            continue
        fn = entry.loss
        reduction = getattr(fn, "reduction", "sum_over_batch_size")
        if isinstance(fn, keras.losses.Loss) and \
                type(fn).__call__ is not keras.losses.Loss.__call__:
            raise ValueError(
                f"tfhybrid: the loss {fn.name!r} of the split output "
                f"{_output_name(model, out)!r} overrides Loss.__call__; tfhybrid cannot "
                "reduce its per-voxel values over the spatial blocks. Override `call` "
                "(per-voxel values) instead and keep a standard reduction.")
        if reduction in (None, "none"):
            raise ValueError(
                f"tfhybrid: the loss {getattr(fn, 'name', fn)!r} of the split output "
                f"{_output_name(model, out)!r} has reduction={reduction!r}: a split output's "
                "loss must reduce to a scalar. Use 'sum_over_batch_size' (default), 'mean', "
                "'sum' or 'mean_with_sample_weight'.")
        if grid.size == 1:
            continue
        if reduction not in ("sum_over_batch_size", "mean", "sum", "mean_with_sample_weight"):
            raise ValueError(
                f"tfhybrid: the loss {getattr(fn, 'name', fn)!r} of the split output "
                f"{_output_name(model, out)!r} has reduction={reduction!r}, which tfhybrid "
                "cannot reduce over spatial blocks. Use 'sum_over_batch_size', 'mean', 'sum' "
                "or 'mean_with_sample_weight'.")
        copies = getattr(model, "_tfhybrid_row_copies", None)    # data groups' copies
        block = None
        if reduction in ("sum", "mean_with_sample_weight"):
            block = _BlockLoss(fn, reduction, k * grid.data_size, spatial)
            block.copies = copies
        compiled._flat_losses[i] = entry._replace(
            loss=_SplitOutputLoss(fn, block, spatial, f"split_output.whole.{i}", copies))


def _output_name(model, index):
    names = list(getattr(model, "output_names", []) or [])
    return names[index] if index < len(names) else index


class _BlockLoss(BlockRowsLoss):
    """A split output's ``sum``/``mean_with_sample_weight`` loss as the share of
    this rank's rows and block in the global batch's loss, times ``scale`` = ``K x D``
    (the group mean in ``compute_loss`` divides by ``K``, the optimizer's average
    over the ``D`` data groups by ``D``)."""

    collective = "split_output.weight_sum"

    def __init__(self, fn, reduction, scale, spatial):
        super().__init__(fn, reduction, scale, ())
        self.spatial = tuple(spatial)

    def weight_ranks(self, weights):
        # per-voxel weights cut into blocks: every rank holds its own share; whole
        # (per-sample) weights: the same on the ranks of a model group
        grid = runtime.current_grid()
        if _cut_into_blocks(weights.shape, self.spatial):
            return tuple(range(grid.size))
        return tuple(grid.data_group_ranks(grid.model_rank))


class _SplitOutputLoss:
    """A split output's compiled loss: per-voxel values (Keras' crossentropies,
    MSE: the values keep the spatial axes) are reduced on the blocks as
    described in the module docstring (``block``: the ``sum``/``mean_with_sample_weight``
    share, else ``fn`` itself); a loss whose values drop the voxels (a Dice or
    Tversky loss, a per-sample mean computed by the function) is not the mean of
    its block values: it runs on the whole volume, its labels, predictions and
    per-voxel weights put together over the model group (:func:`whole_volume`),
    and also on the whole batch when its values are one scalar (gathered over the
    data groups, :meth:`tfhybrid.batch_losses.BlockRowsLoss.whole_batch`). Its
    gradient then enters ``K`` times (the value once), which the group mean in
    ``compute_loss`` divides again."""

    def __init__(self, fn, block, spatial, name, copies):
        self.fn, self.block, self.spatial, self.collective = fn, block, tuple(spatial), name
        self.copies = copies
        self.name = getattr(fn, "name", "loss")
        self.reduction = getattr(fn, "reduction", "sum_over_batch_size")

    def __call__(self, y_true, y_pred, sample_weight=None):
        from tfhybrid.batch_losses import BlockRowsLoss, gradient_times, loss_values_shape

        shape = loss_values_shape(self.fn, y_true, y_pred)
        if shape is None or shape.rank is None or shape.rank > len(self.spatial):
            return (self.block or self.fn)(y_true, y_pred, sample_weight)
        grid = runtime.current_grid()
        y_true, y_pred, sample_weight = whole_volumes((y_true, y_pred, sample_weight),
                                                      self.spatial, self.collective)
        rows = BlockRowsLoss(self.fn, self.reduction, grid.data_size, grid.data_group_ranks(grid.model_rank))
        rows.copies = self.copies
        rows.collective = f"{self.collective}.weight_sum"
        return gradient_times(rows(y_true, y_pred, sample_weight), grid.group("model").size)


def whole_volumes(tensors, spatial, name):
    """Each of ``tensors`` (labels, predictions, weights; None stays None) that
    was cut into this rank's block (:func:`_cut_into_blocks`) put together into
    the whole volume over the model group (:func:`whole_volume`); the others as
    they are."""
    group = runtime.current_grid().group("model")
    return tuple(t if t is None or not _cut_into_blocks(tf.convert_to_tensor(t).shape, spatial)
                 else whole_volume(t, spatial, group, f"{name}.{j}")
                 for j, t in enumerate(tensors))


def whole_volume(t, spatial, group, name):
    """Per-voxel tensor ``t`` (this rank's block, ``(batch, spatial..., rest)``) put
    together over the model ``group``'s row-major block grid ``spatial`` (one
    allgather); the gradient of a float ``t`` is this rank's block of the
    whole's gradient (no collective)."""
    from tfhybrid.comm import backend

    t = tf.convert_to_tensor(t)
    n, grid = len(spatial), tuple(int(s) for s in spatial)
    rank = t.shape.rank
    static = t.shape.as_list()
    perm = [n] + [a for i in range(n) for a in (i, n + 1 + i)] + list(range(2 * n + 1, n + rank))
    whole_static = [static[0]] + [None if static[1 + i] is None else static[1 + i] * grid[i]
                                  for i in range(n)] + static[1 + n:]

    def assemble(x):
        parts = backend.allgather(x[None], group.ranks, name)
        shape = tf.shape(x)
        parts = tf.reshape(parts, tf.concat([tf.constant(grid), shape], 0))
        out = tf.transpose(parts, perm)
        sizes = [shape[0]] + [shape[1 + i] * grid[i] for i in range(n)] + \
            [shape[j] for j in range(1 + n, rank)]
        out = tf.reshape(out, tf.stack(sizes))
        out.set_shape(whole_static)
        return out

    if not t.dtype.is_floating:
        return assemble(t)
    coords = block_coords(grid)

    @tf.custom_gradient
    def _whole(x):
        def grad(dy):
            shape = tf.shape(x)
            begin = [0] + [coords[i] * shape[1 + i] for i in range(n)] + [0] * (rank - 1 - n)
            return tf.slice(dy, tf.stack(begin), shape)
        return assemble(x), grad

    return _whole(t)


def _cut_into_blocks(shape, spatial):
    """True when a per-voxel tensor of ``shape`` was cut to this rank's block
    (:func:`label_block`): some split axis has a size other than 1."""
    if len(shape) < len(spatial) + 1:
        return False
    return any(parts > 1 and shape[d + 1] != 1 for d, parts in enumerate(spatial))


def _replicated_regularization(model):
    """Zero, whose gradient adds ``K - 1`` times the regularisation gradient of
    every replicated (not partial) weight.

    ``compute_loss``'s group mean gives every term the gradient weight ``1/K``:
    right for the weights whose gradients the optimizer sums over the model
    group (the spatial layers' partial weights: the blocks' shares add up), while
    a replicated weight's gradient is averaged, so its regulariser entered
    ``1/K`` times. Scaled here so that it enters once.
    """
    from tfhybrid.layout import layout_of

    k = runtime.current_grid().group("model").size
    terms = []
    if k > 1:
        for v in model.trainable_variables:
            reg = getattr(v, "regularizer", None)
            if reg is None or layout_of(v).kind == "partial":
                continue
            r = tf.cast(reg(v), tf.float32)
            terms.append((k - 1) * (r - tf.stop_gradient(r)))
        terms.extend(_layer_loss_corrections(model, k))
    return tf.add_n(terms) if terms else 0.0


def _layer_loss_corrections(model, k):
    """Terms that make the layers' own losses (activity regularisers, add_loss)
    of a model with split outputs enter once after the group mean.

    A layer whose output is a spatial block (tagged ``_tfhybrid_on_blocks`` by
    the rewrite) adds this block's share (an activity regulariser sums over
    the block's voxels): ``K x`` its loss, so the mean over the group is the
    sum over the blocks. A layer on replicated tensors adds the same loss on
    every rank: its value stays, its gradient is scaled by ``K``.
    """
    terms = []
    for layer in model._flatten_layers(include_self=False):
        own = layer._get_own_losses()
        blocks = getattr(layer, "_tfhybrid_on_blocks", False)
        for value in own:
            value = tf.reduce_sum(tf.cast(value, tf.float32))
            terms.append((k - 1) * (value if blocks else value - tf.stop_gradient(value)))
    return terms


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
    from tfhybrid.process_grid import unravel

    return unravel(runtime.current_grid().model_rank, tuple(spatial))


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


def split_labels(element, spatial, flags=None, names=None):
    """A ``(x, y[, sample_weight])`` element with ``y`` and a per-voxel
    ``sample_weight`` cut to this rank's spatial block (``x`` stays whole:
    the model's SpatialScatter splits it).

    ``flags``: per model output, True when it is split. With several outputs
    and ``y`` a list/tuple of one entry per output, or a dict keyed by the output
    names ``names``, only the entries of split outputs are cut (a
    classification head's labels stay whole).
    """
    if not isinstance(element, (tuple, list)) or len(element) < 2:
        return element
    out = list(element)
    for i, what in ((1, "labels"), (2, "sample weights")):
        if i < len(out) and out[i] is not None:
            out[i] = _cut(out[i], spatial, flags, what, names)
    return type(element)(out) if isinstance(element, tuple) else out


def _cut(value, spatial, flags, what, names=None, where=None):
    """``value`` (labels or weights, maybe one entry per output) with the
    entries of split outputs cut to this rank's block; ``where``: one predicate
    per output (None: cut every tensor of a split output), cutting only the
    tensors it holds true for; entries not matched to an output use the first
    split output's."""
    def cut(check):
        return lambda t: label_block(t, spatial, what) if check is None or check(t) else t

    checks = list(where) if where is not None else [None] * len(flags or ())
    default = next((c for c, f in zip(checks, flags or ()) if f), None)
    if flags is not None and isinstance(value, dict) and names and len(names) == len(flags):
        split = dict(zip(names, flags))
        check = dict(zip(names, checks))
        return {k: tf.nest.map_structure(cut(check.get(k, default)), v)
                if split.get(k, True) else v for k, v in value.items()}

    if flags is not None and len(flags) > 1 and isinstance(value, (tuple, list)) and \
            len(value) == len(flags):
        parts = [tf.nest.map_structure(cut(c), v) if split else v
                 for v, split, c in zip(value, flags, checks)]
        return type(value)(parts)
    return tf.nest.map_structure(cut(default), value)


def full_labels_to_blocks(model, data):
    """``data`` (a train/test step's element) with per-voxel labels and sample
    weights given at the whole volume's size cut to this rank's block.

    ``tfhybrid.data.shard(..., model=model)`` and ``tfhybrid.data.volumes``
    cut them already; ``model.fit(x, y)`` / ``evaluate(x, y)`` on numpy
    arrays or a dataset of whole volumes pass them whole (the input is split
    by the model's SpatialScatter), which failed in Keras' loss with a shape
    mismatch. A tensor is cut when its spatial sizes along the split axes
    are its output's whole size (block x blocks); tensors already at block size,
    per-sample labels and broadcast weights pass unchanged. Each split output
    is judged by its own block (deep supervision: a half-resolution output's
    whole size is the full-resolution output's block size). Static shapes
    decide (at trace time).
    """
    split = split_outputs_of(model)
    if split is None or not isinstance(data, (tuple, list)) or len(data) < 2:
        return data
    flags, spatial = split
    checks = [_whole_check(o, spatial) if f else None for o, f in zip(model.outputs, flags)]
    names = list(getattr(model, "output_names", None) or [])
    out = list(data)
    for i, what in ((1, "labels"), (2, "sample weights")):
        if i < len(out) and out[i] is not None:
            out[i] = _cut(out[i], spatial, flags, what, names, where=checks)
    return type(data)(out) if isinstance(data, tuple) else out


def _whole_check(output, spatial):
    """Whether a label tensor has ``output``'s whole spatial size (its block x the
    blocks) along every split axis."""
    block = tuple(output.shape[1:1 + len(spatial)])
    full = tuple(None if b is None else b * k for b, k in zip(block, spatial))
    axes = [d for d, k in enumerate(spatial) if k > 1]

    def whole(t):
        shape = tuple(getattr(t, "shape", ()))
        if len(shape) < len(spatial) + 1:
            return False
        return bool(axes) and all(shape[d + 1] == full[d] and full[d] != block[d]
                                  for d in axes)
    return whole


def whole_predictions(model, result):
    """``model.predict``'s ``result`` with each split output's blocks put
    together into whole volumes, as single-process ``predict`` returns them
    (collective over the model group: one allgather per split output).
    Outputs that are not split, and models without split outputs, are
    returned unchanged."""
    split = split_outputs_of(model)
    if split is None:
        return result
    flags, spatial = split
    from tfhybrid.comm import backend

    group = runtime.current_grid().group("model")
    coords = [_unravel_rank(r, spatial) for r in range(group.size)]

    def whole(block, number):
        block = np.asarray(block)
        parts = backend.allgather(tf.convert_to_tensor(block[None]), group.ranks,
                                  f"predict.whole.{number}").numpy()
        out = np.empty((block.shape[0],) + tuple(n * k for n, k in zip(
            block.shape[1:1 + len(spatial)], spatial)) + block.shape[1 + len(spatial):],
            block.dtype)
        for part, c in zip(parts, coords):
            where = (slice(None),) + tuple(slice(i * n, (i + 1) * n) for i, n in zip(
                c, block.shape[1:1 + len(spatial)]))
            out[where] = part
        return out

    names = list(getattr(model, "output_names", None) or [])
    if isinstance(result, dict) and names and len(names) == len(flags):
        split_by_name = dict(zip(names, flags))
        return {k: whole(v, i) if split_by_name.get(k) else v
                for i, (k, v) in enumerate(result.items())}
    if isinstance(result, (list, tuple)) and len(result) == len(flags) and len(flags) > 1:
        return type(result)(whole(v, i) if f else v
                            for i, (v, f) in enumerate(zip(result, flags)))
    return whole(result, 0) if flags[0] else result


def _unravel_rank(rank, spatial):
    from tfhybrid.process_grid import unravel

    return unravel(rank, tuple(spatial))
