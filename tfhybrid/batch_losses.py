"""Compiled losses whose reduction is not a mean over the batch, made exact
when the global batch is split into row blocks.

The optimizer averages gradients over the ranks that hold different rows
(:mod:`tfhybrid.optimizer.reduction`), and the guards sum the loss tracker's
states over them: right for Keras' default ``sum_over_batch_size`` (equal
blocks: the mean of the block means is the global mean), wrong by the
number of blocks ``D`` for the others (with ``reduction="sum"`` under ``d``
at 2 ranks, both the gradient and the logged loss would be half the
single-process ones).

* ``reduction="sum"``: the block's loss is multiplied by ``D``, so the
  average over the blocks is the global batch's sum (the logged loss too);
  by ``D / D`` when every rank fed the same rows (whole arrays on every rank:
  the guards set ``copies``), so that each row counts once.
* ``reduction="mean_with_sample_weight"`` with sample weights: ``D x``
  (the block's weighted sum) / (the sum of the weights over every block's
  rows, one scalar allreduce without gradient).

Split outputs of ``s``/``ds`` models (per-voxel, in blocks) are handled by
:mod:`tfhybrid.layers.spatial.output`, which scales by their blocks as well;
this module leaves them alone. ``p`` and ``ls`` models say their blocks
themselves (``row_blocks()``: the pipelines; the FC workers for the FC loss,
the CONV workers for the loss they log).

**Blocks of unequal rows.** The average of the block means is the global mean
only when every block has the same rows. Per-rank arrays of unequal length
(``fit(x[rank::size], ...)`` on 51 rows: a last batch of 2 rows on rank 0 and
1 on rank 1) or a per-rank dataset whose last batch differs between ranks
(``dataset.shard(size, rank).batch(b)``) gave such a step: silently other
weights than one process (``d``, 2 ranks, 51 rows, 2 epochs: 0.28 relative).
When the guards cannot rule it out at the start of ``fit`` (the ranks' array
lengths differ, or a dataset's batch size is not static and it does not come
from :func:`tfhybrid.data.shard`), they set the model's row-weighting flag;
``train_step`` then scales each ``sum_over_batch_size`` loss by ``D x n / N``
(``n`` this block's rows, ``N`` the global batch's: one scalar allreduce per
step) and weighs the loss tracker by ``N / D``, so the gradient and the logged
loss are those of the global batch. ``sum`` and ``mean_with_sample_weight``
are exact for any block sizes already.

**Losses computed over the whole batch.** A loss whose values are one scalar
for the batch (``keras.losses.Dice()`` and ``Tversky()`` with their default
``axis=None``, or any function reducing over the rows itself) is not the mean
of its values on the row blocks: averaged over the blocks it trained other
weights than one process, silently (``d``, 2 ranks, Dice: 4.5e-3 off after 2
steps). Such a loss (found at trace time from the shape of the values its
``call`` returns) is computed on the whole batch on every rank: the row
blocks' ``y_true``, ``y_pred`` and sample weights are all-gathered over the
row-block ranks (:func:`gather_rows`, one allgather each plus one for the
block sizes), and its gradient enters ``blocks`` times (its value once), so
that the optimizer's average over the blocks gives the whole batch's
gradient. Where every rank fed the same rows (``copies``) it is computed on
the local rows, which are the whole batch.
"""
import contextlib
import copy
import weakref

import tensorflow as tf

from tfhybrid import runtime

_WRAPPED = "_tfhybrid_batch_losses_wrapped"
REDUCTIONS = ("sum", "mean_with_sample_weight")
MEAN = "sum_over_batch_size"       # Keras' default: weighted only for unequal blocks
_FACTOR = "_tfhybrid_rows_factor"  # the traced step's D x n / N (None outside train_step)


def row_blocks(model):
    """(number of row blocks of the global batch, the ranks that hold this
    rank's counterparts in the other blocks) for transformed ``model``."""
    own = getattr(model, "row_blocks", None)
    if callable(own):          # p, ls: their roles decide
        return own()
    grid = runtime.current_grid()
    if getattr(model, "_tfhybrid_batch_split", "data") == "world":
        return grid.size, tuple(range(grid.size))
    return grid.data_size, tuple(grid.data_group_ranks(grid.model_rank))


def wrap(model):
    """Wrap ``model``'s compiled losses of reduction ``sum`` and
    ``mean_with_sample_weight`` (once per compile; Keras builds the compiled
    loss at its first call, so the wrapping rides on that build)."""
    compiled = getattr(model, "_compile_loss", None)
    if compiled is None or getattr(compiled, _WRAPPED, False):
        return
    object.__setattr__(compiled, _WRAPPED, True)
    blocks, ranks = row_blocks(model)
    if blocks == 1:
        return
    build = compiled.build

    def build_and_wrap(y_true, y_pred):
        build(y_true, y_pred)
        _wrap_flat(model, compiled, blocks, ranks)

    compiled.build = build_and_wrap
    if compiled.built:
        _wrap_flat(model, compiled, blocks, ranks)


def _split_output(model, path):
    flags = getattr(model, "_tfhybrid_split_outputs", ())
    if not any(flags):
        return False
    from tfhybrid.layers.spatial.output import output_index

    index = output_index(model, path)
    return index is None or (index < len(flags) and flags[index])


def _wrap_flat(model, compiled, blocks, ranks):
    owner = weakref.ref(model)
    for i, entry in enumerate(list(compiled._flat_losses)):
        fn = entry.loss
        reduction = getattr(fn, "reduction", MEAN)
        if reduction not in REDUCTIONS + (MEAN,) or isinstance(fn, BlockRowsLoss) \
                or _split_output(model, entry.path):
            continue
        loss = BlockRowsLoss(fn, reduction, blocks, ranks)
        loss.copies = getattr(model, "_tfhybrid_row_copies", None)
        loss.owner = owner
        compiled._flat_losses[i] = entry._replace(loss=loss)


def rows_factor(model, data, flag):
    """``D x n / N`` for this step's batch ``data`` when ``flag`` (a boolean
    variable) is set, else 1: ``n`` this rank's rows, ``N`` the sum over the
    row blocks (one scalar allreduce, only when set; ``flag`` is the same on
    every rank). None when ``model`` has one row block, or split outputs
    (s/ds per-voxel losses scale by their blocks themselves)."""
    blocks, ranks = row_blocks(model)
    if blocks == 1 or len(ranks) < 2 or any(getattr(model, "_tfhybrid_split_outputs", ())):
        return None
    first = next((t for t in tf.nest.flatten(data) if t is not None), None)
    if first is None:
        return None

    def weighted():
        from tfhybrid.comm import backend

        # x the flag (1 here) read from its variable: a static batch size would
        # make the rows a constant, and Grappler would run the allreduce of a
        # constant while optimising the graph, on those ranks only (a hang)
        rows = tf.cast(tf.shape(first)[0], tf.float32) * tf.cast(flag, tf.float32)
        total = backend.allreduce(rows, tuple(ranks), "batch_losses.rows")
        return tf.math.divide_no_nan(blocks * rows, total)

    return tf.cond(flag, weighted, lambda: tf.constant(1.0, tf.float32))


@contextlib.contextmanager
def weighted_rows(model, factor):
    """Inside Keras' ``train_step``: the ``sum_over_batch_size`` losses scale by
    ``factor`` (:func:`rows_factor`) and the loss tracker weighs the step by its
    rows / ``factor`` (``N / D``), so that the summed tracker states give the
    global batch's loss."""
    tracker = getattr(model, "_loss_tracker", None)
    if factor is None or tracker is None:
        yield
        return
    keras_update = tracker.update_state

    def update_state(values, sample_weight=None):
        if sample_weight is not None:
            sample_weight = tf.cast(sample_weight, tf.float32) / factor
        return keras_update(values, sample_weight=sample_weight)

    object.__setattr__(model, _FACTOR, factor)
    object.__setattr__(tracker, "update_state", update_state)
    try:
        yield
    finally:
        object.__setattr__(model, _FACTOR, None)
        del tracker.__dict__["update_state"]


class BlockRowsLoss:
    """``fn`` on this rank's rows, as its share of the global batch's loss x ``blocks``
    (the optimizer's average over the blocks divides by ``blocks``).

    ``mean_with_sample_weight`` divides by the weight sum over :meth:`weight_ranks`
    (one scalar allreduce without gradient). Subclassed for the split outputs of
    s/ds models (:mod:`tfhybrid.layers.spatial.output`), whose blocks are also
    spatial."""

    collective = "batch_losses.weight_sum"
    # The number of ranks of each row-block group that fed the very same rows
    # (a variable the guards set: 1, or the group's size for whole arrays fed on
    # every rank), so that a ``sum`` counts each row once. None: 1.
    copies = None
    owner = None      # weak reference to the model (its traced step's rows factor)

    def __init__(self, fn, reduction, blocks, ranks):
        self.fn, self.reduction, self.blocks, self.ranks = fn, reduction, blocks, ranks
        self.name = getattr(fn, "name", "loss")
        self.summed = copy.copy(fn)
        self.summed.reduction = "sum"

    def weight_ranks(self, weights):
        """The ranks whose rows' weights make up the divisor."""
        return self.ranks

    def __call__(self, y_true, y_pred, sample_weight=None):
        if batch_level(self.fn, y_true, y_pred):
            return self.whole_batch(y_true, y_pred, sample_weight)
        if self.reduction == MEAN:
            loss = self.fn(y_true, y_pred, sample_weight)
            model = self.owner() if self.owner is not None else None
            factor = getattr(model, _FACTOR, None)
            return loss if factor is None else loss * tf.cast(factor, loss.dtype)
        if self.reduction == "sum":
            loss = self.fn(y_true, y_pred, sample_weight)
            if self.copies is None:
                return loss * self.blocks
            return loss * (self.blocks / tf.cast(self.copies, loss.dtype))
        if sample_weight is None:          # the plain mean over the rows
            return self.fn(y_true, y_pred, sample_weight)
        total = self.summed(y_true, y_pred, sample_weight)
        weights = tf.cast(tf.convert_to_tensor(sample_weight), total.dtype)
        divisor = tf.reduce_sum(weights)
        ranks = tuple(self.weight_ranks(weights))
        if len(ranks) > 1:
            from tfhybrid.comm import backend

            divisor = backend.allreduce(tf.stop_gradient(divisor), ranks, self.collective)
        return tf.math.divide_no_nan(total * self.blocks, divisor)


    def whole_batch(self, y_true, y_pred, sample_weight=None):
        """``fn`` on the whole batch (every row block gathered), the same on every
        rank, with its gradient x ``blocks``; on the local rows when every rank
        of the group fed the same rows (then they are the whole batch)."""
        if len(self.ranks) < 2:
            return self.fn(y_true, y_pred, sample_weight)

        def gathered():
            yt, yp, sw = gather_rows((y_true, y_pred, sample_weight), self.ranks,
                                     self.collective.replace("weight_sum", "whole_batch"))
            return gradient_times(self.fn(yt, yp, sw), self.blocks)

        if self.copies is None:
            return gathered()
        return tf.cond(tf.cast(self.copies, tf.float32) > 1.0,
                       lambda: self.fn(y_true, y_pred, sample_weight), gathered)


def loss_values_shape(fn, y_true, y_pred):
    """The static shape of the values Keras loss ``fn`` computes from ``y_true``
    and ``y_pred`` before its reduction (``fn.call``, traced only for its shape:
    nothing uses the ops, so Grappler prunes them); None when ``fn`` is not a
    Keras loss or the shape cannot be told."""
    call = getattr(fn, "call", None)
    if not callable(call):
        return None
    dtype = getattr(fn, "dtype", None)

    def convert(t):
        return tf.convert_to_tensor(t, dtype=dtype)

    try:
        values = call(tf.nest.map_structure(convert, y_true),
                      tf.nest.map_structure(convert, y_pred))
    except Exception:       # noqa: BLE001 - the loss's own error surfaces in its real call
        return None
    return getattr(values, "shape", None)


def batch_level(fn, y_true, y_pred) -> bool:
    """Whether loss ``fn`` reduces over the whole batch itself (its values are one
    scalar, e.g. ``keras.losses.Dice()`` with ``axis=None``): then the mean of its
    values on row blocks is not its value on the batch."""
    shape = loss_values_shape(fn, y_true, y_pred)
    return shape is not None and shape.rank == 0 and tf.nest.flatten(y_pred)[0].shape.rank > 0


def gradient_times(value, factor):
    """``value`` whose gradient is ``factor`` times its own (the value unchanged)."""
    if factor == 1:
        return value
    return value + (factor - 1) * (value - tf.stop_gradient(value))


def gather_rows(tensors, ranks, name):
    """Each of ``tensors`` (None stays None) with the rows of every rank of ``ranks``
    in rank order (all-gathers; blocks may differ in rows); the gradient of each
    is this rank's rows of the gradient of the whole (no collective)."""
    from tfhybrid.comm import backend
    from tfhybrid.comm.p2p import anchored

    ranks = tuple(ranks)
    me = ranks.index(runtime.current_grid().rank)
    present = [t for t in tf.nest.flatten(tensors) if t is not None]
    first = tf.convert_to_tensor(present[0])
    # the block's rows read from the tensor: never a constant input to a collective
    rows = anchored(tf.reshape(tf.cast(tf.shape(first)[0], tf.int64), [1]), [first])
    counts = backend.allgather(rows, ranks, f"{name}.rows")
    offset = tf.reduce_sum(counts[:me])

    def whole(t, i):
        t = tf.convert_to_tensor(t)

        @tf.custom_gradient
        def _gather(x):
            def grad(dy):
                n = tf.shape(x, out_type=tf.int64)[0]
                return tf.slice(dy, tf.concat([[offset], tf.zeros([dy.shape.rank - 1], tf.int64)], 0),
                                tf.concat([[n], tf.fill([dy.shape.rank - 1], tf.constant(-1, tf.int64))], 0))
            return backend.allgather(x, ranks, f"{name}.{i}"), grad

        return _gather(t)

    flat = tf.nest.flatten(tensors)
    out = [None if t is None else whole(t, i) for i, t in enumerate(flat)]
    return tf.nest.pack_sequence_as(tensors, out)


_METRICS_WRAPPED = "_tfhybrid_whole_batch_metrics"


def wrap_metrics(model):
    """Make ``model``'s compiled function metrics (``MeanMetricWrapper``: a
    function or a loss passed in ``metrics=``) whose values drop the rows (one
    scalar per batch, e.g. a Dice coefficient) or, on a split output, the
    voxels, update on the whole batch / volume, gathered as for the losses
    (:class:`BlockRowsLoss`): each block's value averaged over the ranks was
    not the batch's. Every rank then adds the same value, which the summed
    metric states (total and count alike) leave unchanged. Wrapped once per
    compile, on the compiled metrics' build."""
    compiled = getattr(model, "_compile_metrics", None)
    if compiled is None or getattr(compiled, _METRICS_WRAPPED, False):
        return
    object.__setattr__(compiled, _METRICS_WRAPPED, True)
    if runtime.current_grid().size == 1:
        return
    build = compiled.build

    def build_and_wrap(y_true, y_pred):
        build(y_true, y_pred)
        _wrap_metric_lists(model, compiled)

    compiled.build = build_and_wrap
    if compiled.built:
        _wrap_metric_lists(model, compiled)


def _wrap_metric_lists(model, compiled):
    flags = getattr(model, "_tfhybrid_split_outputs", ()) or ()
    for lists in (compiled._flat_metrics, compiled._flat_weighted_metrics):
        for out, metrics in enumerate(lists or ()):
            split = out < len(flags) and flags[out]
            for i, metric in enumerate(getattr(metrics, "metrics", None) or ()):
                if callable(getattr(metric, "_fn", None)):
                    _wrap_metric(model, metric, split, f"metric_whole.{out}.{i}")


def _wrap_metric(model, metric, split, name):
    keras_update = metric.update_state

    def update_state(y_true, y_pred, sample_weight=None):
        kwargs = getattr(metric, "_fn_kwargs", None) or {}
        try:
            values = metric._fn(y_true, y_pred, **kwargs)
        except Exception:    # noqa: BLE001 - Keras' own call raises it below
            return keras_update(y_true, y_pred, sample_weight=sample_weight)
        rank = getattr(getattr(values, "shape", None), "rank", None)
        tensors = (y_true, y_pred, sample_weight)
        if rank is not None and split:
            from tfhybrid.layers.spatial.output import SPATIAL_GRID_ATTR, whole_volumes

            spatial = getattr(model, SPATIAL_GRID_ATTR)
            if rank <= len(spatial):        # the values drop the voxels: the whole volume
                tensors = whole_volumes(tensors, spatial, name)
        if rank == 0:                       # one value for the batch: the whole batch
            blocks, ranks = row_blocks(model)
            if blocks > 1 and len(ranks) > 1:
                tensors = gather_rows(tensors, ranks, f"{name}.rows")
        return keras_update(*tensors[:2], sample_weight=tensors[2])

    object.__setattr__(metric, "update_state", update_state)


def whole_regularization(model, loss):
    """``loss`` with every weight penalty entering once, as in one process.

    * A rank holding a block of a regularised weight (f, c, df:
      filter/channel-parallel kernels) adds only its block's penalty to its
      loss: the block's gradient is right, but the loss value (History,
      ``evaluate``) lacks the other blocks' share. That share is added here
      without gradient: one scalar allreduce per group of blocks per step.
    * A *partial* weight (the spatial layers of s/ds: each rank holds the whole
      kernel, the optimizer sums the ranks' gradients over the model group)
      would get its penalty's gradient once per rank, K times in all, on a
      model whose output is gathered, and drift silently from one process. Its
      penalty enters each rank's gradient x 1/K (the value is unchanged).
      A split output's loss is the group mean already
      (:mod:`tfhybrid.layers.spatial.output`), which weighs it 1/K.
    """
    grid = runtime.current_grid()
    if loss is None or grid.model_size == 1:
        return loss
    from tfhybrid.layout import layout_of

    groups, partial = {}, []
    split_outputs = any(getattr(model, "_tfhybrid_split_outputs", ()))
    for v in model.trainable_weights:
        regularizer = getattr(v, "regularizer", None)
        layout = layout_of(v)
        if regularizer is None or layout.kind not in ("sharded", "partial"):
            continue
        ranks = tuple(layout.group.ranks if hasattr(layout.group, "ranks")
                      else grid.group(layout.group).ranks)
        if len(ranks) == 1:
            continue
        penalty = tf.reduce_sum(tf.cast(regularizer(v), tf.float32))
        if layout.kind == "sharded":
            groups.setdefault(ranks, []).append(penalty)
        elif not split_outputs:
            partial.append((1.0 / len(ranks) - 1.0) * (penalty - tf.stop_gradient(penalty)))
    if partial:
        loss = loss + tf.cast(tf.add_n(partial), loss.dtype)
    if not groups:
        return loss
    from tfhybrid.comm import backend

    for i, (ranks, terms) in enumerate(groups.items()):
        own = tf.stop_gradient(tf.add_n(terms))
        total = backend.allreduce(own, ranks, f"batch_losses.regularization_sum.{i}")
        loss = loss + tf.cast(total - own, loss.dtype)
    return loss
