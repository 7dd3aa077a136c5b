"""Input sharding: which rows of each global batch this rank feeds.

Every rank reads the same stream of *global* batches and keeps one block of
rows of each. By default the global batch is split into ``p_data`` blocks and
rank ``r`` keeps block ``data_rank(r)``, so all ranks of a model group see the
same rows (the model group holds one replica). Strategies whose early layers
are data-parallel over all ranks (SplitBrain's ``gmp``, plain ``d``) mark the
transformed model with ``_tfhybrid_batch_split = "world"``; with such a model
the batch is split into ``p`` blocks and rank ``r`` keeps block ``r``.
"""
from __future__ import annotations

import numpy as np
import tensorflow as tf

from tfhybrid import runtime

SPLITS = ("data", "world")


def batch_split(model=None):
    """``(blocks, index)``: how this rank splits a global batch for ``model``.

    Raises:
        ValueError: if the model's ``_tfhybrid_batch_split`` is not "data" or "world".
    """
    grid = runtime.current_grid()
    if model is not None and not hasattr(model, "layers"):
        raise TypeError(f"Received an invalid `model`: {model!r:.60} (type "
                        f"{type(model).__name__}); expected the model returned by "
                        "tfhybrid.transform, or None. Pass the global batch size by keyword: "
                        "shard(arrays, batch_size=64).")
    split = getattr(model, "_tfhybrid_batch_split", "data") if model is not None else "data"
    if split not in SPLITS:
        raise ValueError(f"Model {getattr(model, 'name', model)!r} has an invalid "
                         f"_tfhybrid_batch_split={split!r}; expected one of {SPLITS}.")
    return (grid.size, grid.rank) if split == "world" else (grid.data_size, grid.data_rank)


def _divisible_error(batch, blocks):
    return (f"The global batch of {batch} rows cannot be split evenly over {blocks} "
            f"data-parallel ranks: use a global batch that is a multiple of {blocks} "
            "(batch the dataset with drop_remainder=True so the last batch is full too).")


def _shard_dataset(dataset, blocks, index):
    def rows(t):
        n = t.shape[0]
        if n is not None and n % blocks:
            raise ValueError(_divisible_error(n, blocks))
        size = tf.shape(t)[0]
        with tf.control_dependencies([tf.debugging.assert_equal(
                size % blocks, 0, message=f"global batch not divisible by {blocks} "
                "data-parallel ranks (use drop_remainder=True)")]):
            local = size // blocks
        return t[index * local:(index + 1) * local]

    def select(*batch):
        out = tf.nest.map_structure(rows, batch)
        return out[0] if len(out) == 1 else out

    return dataset.map(select, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)


def _shard_arrays(arrays, batch_size, blocks, index):
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"Received an invalid value for `batch_size`: {batch_size!r}; "
                         "expected the global batch size (a positive integer) with arrays.")
    if batch_size % blocks:
        raise ValueError(_divisible_error(batch_size, blocks))
    flat = tf.nest.flatten(arrays)
    if not flat:
        raise ValueError(f"Received no arrays to shard: {arrays!r}; pass numpy arrays of "
                         "whole samples, e.g. shard((x, y), batch_size=64).")
    lengths = sorted({len(a) for a in flat})
    if len(lengths) > 1:
        raise ValueError(f"Received arrays of different lengths {lengths}; every array must "
                         "hold one row per sample (x and y of the same samples).")
    n = lengths[0]
    if n % batch_size and (n % batch_size) % blocks:
        raise ValueError(_divisible_error(n % batch_size, blocks) + f" (the last batch of "
                         f"{n} samples in batches of {batch_size})")

    def rows(a):
        a = np.asarray(a)
        keep = []
        for start in range(0, n, batch_size):
            local = min(batch_size, n - start) // blocks
            keep.append(a[start + index * local:start + (index + 1) * local])
        return np.concatenate(keep)

    return tf.nest.map_structure(rows, arrays)


def _pipeline(dataset):
    """Class names of ``dataset``'s single-input chain, newest first (tf.data internals)."""
    names = []
    while dataset is not None and len(names) < 200:
        names.append(type(dataset).__name__)
        try:
            inputs = dataset._inputs()
        except Exception:  # noqa: BLE001 - unknown dataset kinds: stop walking
            break
        dataset = inputs[0] if len(inputs) == 1 else None
    return names


def _batched_upstream(dataset) -> bool:
    """True if a batching op appears before any unbatch, walking from the end."""
    for name in _pipeline(dataset):
        if "Unbatch" in name:
            return False
        if "Batch" in name:
            return True
    return False


def _unbatched_samples(dataset, model=None) -> bool:
    """True when the dataset yields single samples: by the model's input rank
    when ``model`` is given (an element one rank short of the model's input),
    else only when the pipeline reaches ``from_tensor_slices`` (or an unbatch)
    with no batching op on the way."""
    inputs = getattr(model, "inputs", None)
    if inputs and len(inputs) == 1:
        spec = dataset.element_spec
        x = spec[0] if isinstance(spec, tuple) else spec
        if isinstance(x, tf.TensorSpec) and x.shape.rank is not None:
            return x.shape.rank == len(inputs[0].shape) - 1
    for name in _pipeline(dataset):
        if "Unbatch" in name or name == "_TensorSliceDataset":
            return True
        if "Batch" in name:
            return False
    return False


def shard(dataset, model=None, batch_size=None):
    """The rows of every global batch that this rank must feed.

    Args:
        dataset: A ``tf.data.Dataset`` yielding global batches (``x``,
            ``(x, y)`` or ``(x, y, sample_weight)``, any nesting), or numpy
            arrays / a tuple of arrays of whole samples with ``batch_size``.
        model: Optional (transformed) model; its ``_tfhybrid_batch_split``
            ("data", the default, or "world") chooses the split.
        batch_size: The global batch size: required with arrays; with a
            dataset of single samples, ``shard`` batches it (dropping the
            remainder) before keeping this rank's rows.

    Returns:
        A ``tf.data.Dataset`` of local batches, or the arrays of this rank's
        rows (feed them with ``batch_size // blocks`` and ``shuffle=False``).

    Raises:
        ValueError: for a dataset of single samples without ``batch_size``
            (it would split each sample's features), ``batch_size`` with a
            dataset already batched, or when a global batch is not divisible by the number of
            blocks (for a dataset with unknown batch size the check runs
            per batch and raises ``tf.errors.InvalidArgumentError``).
        TypeError: for any other kind of ``dataset``.

    Example:
        >>> ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(64, drop_remainder=True)
        >>> model.fit(tfhybrid.data.shard(ds), epochs=2)
        >>> x_local, y_local = tfhybrid.data.shard((x, y), batch_size=64)
    """
    blocks, index = batch_split(model)
    if isinstance(dataset, tf.data.Dataset):
        if batch_size is not None:      # a dataset of single samples: batch it globally here
            if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
                raise ValueError(f"Received an invalid value for `batch_size`: {batch_size!r}; "
                                 "expected the global batch size (a positive integer).")
            if batch_size % blocks:
                raise ValueError(_divisible_error(batch_size, blocks))
            if _batched_upstream(dataset):
                raise ValueError(
                    f"Received batch_size={batch_size} with a dataset that is already batched "
                    "(its pipeline has a .batch()): pass either a dataset of single samples "
                    "with batch_size=<global batch>, or global batches without batch_size.")
            dataset = dataset.batch(batch_size, drop_remainder=True)
        elif _unbatched_samples(dataset, model):
            raise ValueError(
                "tfhybrid.data.shard received a dataset of single samples (elements without a "
                "batch dimension, e.g. from_tensor_slices with no .batch()), so it would split "
                "each sample's "
                "features across ranks. Batch it with the global batch size first "
                "(dataset.batch(64, drop_remainder=True)), or pass batch_size=64 and "
                "data.shard batches it.")
        return _shard_dataset(dataset, blocks, index) if blocks > 1 else dataset
    if isinstance(dataset, (np.ndarray, tuple, list, dict)):
        return _shard_arrays(dataset, batch_size, blocks, index)
    raise TypeError(f"Received an invalid `dataset` of type {type(dataset).__name__}; expected "
                    "a tf.data.Dataset of global batches or numpy arrays with batch_size.")


def local_batch_size(global_batch: int, model=None) -> int:
    """Rows per rank for ``global_batch``.

    Raises:
        ValueError: if ``global_batch`` is not divisible by the number of blocks.

    Example:
        >>> tfhybrid.data.local_batch_size(64)   # 4 data-parallel ranks
        16
    """
    if isinstance(global_batch, bool) or not isinstance(global_batch, int) or global_batch < 1:
        raise ValueError(f"Received an invalid value for `global_batch`: {global_batch!r}; "
                         "expected the global batch size (a positive integer).")
    blocks, _ = batch_split(model)
    if global_batch % blocks:
        raise ValueError(_divisible_error(global_batch, blocks))
    return global_batch // blocks
