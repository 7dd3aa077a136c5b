"""Metric states summed over the ranks that fed disjoint rows, so ``evaluate``
returns the global data set's metrics on every rank."""
from __future__ import annotations

import numpy as np
import tensorflow as tf

from tfhybrid import runtime
from tfhybrid.comm.variables import sum_variables
from tfhybrid.layout import layout_of
from tfhybrid.guards.consistency import row_copies


def metric_ranks(model):
    """The ranks whose metric states together cover each global batch once.

    With the batch split over the data axis, the ranks of a model group
    compute on the same rows: one member per model group (this rank's data
    group) covers the batch once. With a world split every rank holds its
    own rows: the world. With outputs split into spatial blocks every rank
    holds its own voxels: the world (metrics of values replicated in a
    model group, such as the loss, are means and unchanged by the sum).
    """
    grid = runtime.current_grid()
    if getattr(model, "_tfhybrid_batch_split", "data") == "world":
        return tuple(range(grid.size))
    if any(getattr(model, "_tfhybrid_split_outputs", ())):   # per-voxel blocks: every rank
        return tuple(range(grid.size))
    return tuple(grid.data_group_ranks(grid.model_rank))


def sum_metric_states(model):
    """Sum every metric variable of ``model`` over :func:`metric_ranks` (collective).

    Keras metrics keep additive states (Mean: total and count; accuracy,
    precision, AUC: counts), so after the sum each ``metric.result()`` is the
    metric of the rows of every rank, as one process evaluating the whole
    data set computes it (float64 sums, then the variables' own dtype).
    The states stay summed until the next ``reset_metrics``. A custom metric
    whose state is not a sum (a maximum, a last value) would be wrong: use
    ``Config(average_metrics=False)`` and reduce it yourself.

    Example:
        >>> tfhybrid.guards.sum_metric_states(model)   # custom evaluation loops
        >>> {m.name: float(m.result()) for m in model.metrics}
    """
    ranks = metric_ranks(model)
    variables = [v for v in model.metrics_variables
                 if v.dtype in ("float16", "bfloat16", "float32", "float64", "int32", "int64")]
    if len(ranks) < 2 or not variables:
        return
    if runtime.current_grid().model_rank != 0:
        # metrics of a replicated output beside split ones (every rank of a model
        # group holds the same rows): counted once, by the model group's first rank
        for v in _replicated_output_metric_variables(model):
            v.assign(tf.zeros_like(v))
    sum_variables(variables, ranks, "metric_states.sum", copies=row_copies(model))


def _replicated_output_metric_variables(model):
    """Metric variables of the outputs that are not split when others are
    (a classification head beside a per-voxel one)."""
    flags = getattr(model, "_tfhybrid_split_outputs", ())
    compiled = getattr(model, "_compile_metrics", None)
    if not any(flags) or all(flags) or compiled is None or not compiled.built:
        return []
    out = []
    for group in (compiled._flat_metrics, compiled._flat_weighted_metrics):
        for split, entry in zip(flags, group):
            if split or entry is None:
                continue
            for m in getattr(entry, "metrics", [entry]):
                out.extend(m.variables)
    return out


def _average_step_logs(logs, ranks):
    """Average the scalar logs of a custom ``test_step`` over ``ranks`` (collective)."""
    from tfhybrid.comm import backend

    keys = sorted(k for k, v in logs.items() if np.ndim(v) == 0)
    if len(ranks) < 2 or not keys:
        return logs
    values = tf.constant([float(logs[k]) for k in keys], tf.float64)
    mean = backend.allreduce(values, ranks, "metric_states.logs", average=True).numpy()
    return {**logs, **{k: float(v) for k, v in zip(keys, mean)}}


def summary_note(model) -> str:
    """The line ``model.summary()`` adds: the counts above are this rank's.

    Local, not collective (``summary`` is often called on rank 0 only): the
    full size is estimated from the blocks' layouts (sharded blocks x model
    group size); ``tfhybrid.gather(model).summary()`` prints the exact counts.
    """
    grid = runtime.current_grid()
    info = getattr(model, "_tfhybrid_transform", None)
    strategy = getattr(getattr(info, "plan", None), "strategy", "?")
    local = sharded = 0
    for v in model.weights:
        n = int(np.prod(v.shape))
        local += n
        if layout_of(v).kind == "sharded":
            sharded += n
    full = local + sharded * (grid.model_size - 1)
    text = (f"tfhybrid: the parameter counts above are global rank {grid.rank}'s "
            f"(of {grid.size}; strategy {strategy!r}, grid {grid.data_size} data x "
            f"{grid.model_size} model)")
    if sharded:
        text += (f": {sharded:,} of its {local:,} parameters are its blocks of weights "
                 f"sharded over its model group; the full model has about {full:,} "
                 "(tfhybrid.gather(model).summary() prints the exact counts).")
    else:
        text += f": every weight is whole on every rank ({local:,} parameters)."
    return text
