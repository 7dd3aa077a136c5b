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

import os
import warnings
import weakref

import numpy as np
import tensorflow as tf

from tfhybrid import runtime

SPLITS = ("data", "world")
REMAINDERS = ("drop", "error")


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
    blocks = getattr(model, "_tfhybrid_batch_blocks", None)   # ls: role-dependent blocks
    if blocks is not None:
        return blocks
    split = getattr(model, "_tfhybrid_batch_split", "data") if model is not None else "data"
    if split not in SPLITS:
        raise ValueError(f"Model {getattr(model, 'name', model)!r} has an invalid "
                         f"_tfhybrid_batch_split={split!r}; expected one of {SPLITS}.")
    return (grid.size, grid.rank) if split == "world" else (grid.data_size, grid.data_rank)


def _divisible_error(batch, blocks):
    return (f"The global batch of {batch} rows cannot be split evenly over {blocks} "
            f"data-parallel ranks: use a global batch that is a multiple of {blocks} "
            "(batch the dataset with drop_remainder=True so the last batch is full too).")


def _batch_dims(dataset):
    """The static leading dimensions of ``dataset``'s element components (None: unknown)."""
    return {spec.shape[0] for spec in tf.nest.flatten(dataset.element_spec)
            if isinstance(spec, tf.TensorSpec) and spec.shape.rank}


#: tf.data ops that keep the number and sizes of batches (walked by _short_batches).
_SIZE_KEEPING = ("Prefetch", "Map", "Shuffle", "Cache", "Options", "Model")


def _short_batches(dataset, blocks):
    """How many batches of ``dataset`` have fewer than ``blocks`` rows, or None if unknown.

    Known for ``rows.batch(B)`` over a dataset of known length, followed by
    ops that keep the batches (map, shuffle, prefetch, cache): the last
    batch of ``N % B`` rows is the only partial one.
    """
    node = dataset
    for _ in range(50):
        name = type(node).__name__
        if name in ("_BatchDataset", "_ParallelBatchDataset"):
            try:
                batch = int(node._batch_size.numpy())
                drop = bool(node._drop_remainder.numpy())
                rows = int(node._input_dataset.cardinality().numpy())
            except Exception:  # noqa: BLE001 - tf.data internals differ: unknown
                return None
            if rows < 0:
                return None
            return int(not drop and 0 < rows % batch < blocks)
        if not any(k in name for k in _SIZE_KEEPING):
            return None
        try:
            inputs = node._inputs()
        except Exception:  # noqa: BLE001
            return None
        if len(inputs) != 1:
            return None
        node = inputs[0]
    return None


def _warn_if(condition, template, *values):
    """Traced: a Python ``UserWarning`` ``template.format(*values)`` when ``condition`` holds."""
    def emit(*args):
        warnings.warn(template.format(*(int(v) for v in args)), UserWarning, stacklevel=2)
        return np.int32(0)

    def show():
        return tf.py_function(emit, list(values), tf.int32)

    return tf.cond(condition, show, lambda: tf.constant(0, tf.int32))


def _shard_dataset(dataset, blocks, index, remainder="drop"):
    dims = _batch_dims(dataset)
    for n in dims:
        if n is not None and n % blocks:
            raise ValueError(_divisible_error(n, blocks))
    uneven = None in dims and remainder == "drop"
    fix = ("Batch with drop_remainder=True to drop whole partial batches instead, or pass "
           "remainder='error' to refuse them.")
    if uneven:
        def big_enough(*batch):
            size = tf.shape(tf.nest.flatten(batch)[0])[0]
            keep = size >= blocks
            if runtime.is_root():     # the same decision on every rank; rank 0 says so
                done = _warn_if(tf.logical_not(keep), "tfhybrid.data.shard: skipped a global "
                                "batch of {} rows, fewer than the {} ranks, on every rank. "
                                + fix, size, blocks)
                with tf.control_dependencies([done]):
                    keep = tf.identity(keep)
            return keep

        short = _short_batches(dataset, blocks)
        count = int(dataset.cardinality().numpy()) if tf.executing_eagerly() else -1
        if short != 0:        # skip tiny batches (none known to exist: keep the cardinality)
            dataset = dataset.filter(big_enough)
            if short is not None and count >= 0:    # Keras then knows the steps per epoch
                dataset = dataset.apply(tf.data.experimental.assert_cardinality(count - short))

    def rows(t):
        size = tf.shape(t)[0]
        if uneven:
            local = size // blocks
        else:
            with tf.control_dependencies([tf.debugging.assert_equal(
                    size % blocks, 0, message=f"global batch not divisible by {blocks} "
                    "data-parallel ranks (remainder='error'; use drop_remainder=True)")]):
                local = size // blocks
        return t[index * local:(index + 1) * local]

    def select(*batch):
        out = tf.nest.map_structure(rows, batch)
        if uneven and runtime.is_root():
            size = tf.shape(tf.nest.flatten(batch)[0])[0]
            dropped = size % blocks
            done = _warn_if(dropped > 0, "tfhybrid.data.shard: dropped {} of the {} rows of a "
                            "global batch, not a multiple of the {} ranks: each rank keeps {} "
                            "rows. " + fix, dropped, size, blocks, size // blocks)
            with tf.control_dependencies([done]):
                out = tf.nest.map_structure(tf.identity, out)
        return out[0] if len(out) == 1 else out

    return dataset.map(select, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)


def _shard_arrays(arrays, batch_size, blocks, index, remainder="error"):
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
    last = n % batch_size
    if last and last % blocks:
        if remainder == "error":
            raise ValueError(_divisible_error(last, blocks) + f" (the last batch of "
                             f"{n} samples in batches of {batch_size}); or pass "
                             "remainder='drop' to drop its extra rows.")
        if runtime.is_root():
            warnings.warn(f"tfhybrid.data.shard: the last global batch of {last} rows (of {n} "
                          f"samples in batches of {batch_size}) keeps {last // blocks} rows per "
                          f"rank; its {last % blocks} rows beyond a multiple of {blocks} ranks "
                          "are dropped on every rank.", stacklevel=3)

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


def _check_autotune(autotune):
    if not isinstance(autotune, bool):
        raise ValueError(f"Received an invalid value for `autotune`: {autotune!r}; expected "
                         "False (the default: tf.data autotuning off) or True.")


def _without_autotune_stall(dataset, autotune):
    """``dataset`` with tf.data's autotuning off, unless ``autotune`` is True.

    With autotuning on (TensorFlow's default), every iterator starts a model
    thread that re-tunes the pipeline at periods doubling from 10 ms to 60 s;
    destroying the iterator (at the end of each ``fit``, epoch, ``evaluate``
    or ``predict`` pass) often waits for that thread's next period. Measured
    here (TF 2.18.1, plain Keras, one process): a 4.2 s epoch ended at 5.11 s
    in 2 of 4 fits, a 0.93 s epoch at 1.27 s in 6 of 6; under data
    parallelism the waiting rank holds the others at their next collective.
    Off, ``AUTOTUNE`` parallelism falls back to the number of cores and
    ``prefetch(AUTOTUNE)`` to TensorFlow's legacy buffer growth.
    """
    _check_autotune(autotune)
    if autotune:
        return dataset
    options = tf.data.Options()
    options.autotune.enabled = False
    return dataset.with_options(options)


# -- the scaling form: single rows in, this rank's local batches out --------------

def _is_file_list(value) -> bool:
    """A list/tuple of file names (str, bytes or os.PathLike), one row each."""
    return (isinstance(value, (list, tuple)) and len(value) > 0
            and all(isinstance(v, (str, bytes, os.PathLike)) for v in value))


def _shared_seed(seed):
    """``seed``, or one drawn on rank 0 and broadcast (collective when seed is None)."""
    if seed is not None:
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"Received an invalid value for `seed`: {seed!r}; expected an "
                             "integer (or None: one seed drawn on rank 0 and broadcast).")
        return seed
    from tfhybrid.comm import backend   # the seed travels like guards.set_consistent_seed's
    drawn = tf.constant([np.random.SeedSequence().entropy % (2**31 - 1)], tf.int64)
    if backend.is_initialized() and backend.size() > 1:
        world = tuple(range(backend.size()))
        drawn = backend.broadcast(drawn, 0, world, "data.shuffle_seed")
    return int(drawn.numpy()[0])


def _maps_rows(dataset) -> bool:
    """True when the dataset's last op is a per-row map (e.g. a decode)."""
    names = _pipeline(dataset)
    return bool(names) and "Map" in names[0] and "Batch" not in names[0]


def _local_batches(dataset, batch_size, blocks, index, map_fn, shuffle, seed):
    """This rank's local batches from a dataset of single rows.

    The rows are grouped into global batches *before* ``map_fn`` runs
    (grouping copies only the raw records: file names, encoded bytes), this
    rank keeps block ``index`` of each (the same rows as the batched form),
    and only those rows are mapped (decoded) and batched locally. Every rank
    of a model group keeps the same block, so they read the same rows in the
    same order; a shuffle runs before the grouping with one seed on all ranks.
    """
    local = batch_size // blocks
    if shuffle is not None:
        if isinstance(shuffle, bool) or not isinstance(shuffle, int) or shuffle < 1:
            raise ValueError(f"Received an invalid value for `shuffle`: {shuffle!r}; expected "
                             "a shuffle buffer size in rows (a positive integer), or None.")
        dataset = dataset.shuffle(shuffle, seed=_shared_seed(seed),
                                  reshuffle_each_iteration=True)
    if map_fn is not None and not callable(map_fn):
        raise ValueError(f"Received an invalid value for `map_fn`: {map_fn!r}; expected a "
                         "function of one row (e.g. one that decodes an image), or None.")
    if map_fn is None and blocks > 1 and _maps_rows(dataset):
        warnings.warn(
            "tfhybrid.data.shard: the dataset maps every row (e.g. a decode) before shard "
            f"keeps this rank's {local} of every {batch_size} rows, so each rank maps the "
            "whole global batch. Pass the per-row function as map_fn= instead "
            "(shard(raw_rows, batch_size=..., map_fn=decode)): only this rank's rows are "
            "mapped.", stacklevel=3)
    groups = dataset.batch(batch_size, drop_remainder=True)     # raw records of a global batch
    if blocks > 1:
        groups = _shard_dataset(groups, blocks, index)
    if map_fn is None:
        return groups
    return (groups.unbatch()
            .map(map_fn, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
            .batch(local, drop_remainder=True))


def shard(dataset, model=None, batch_size=None, *, map_fn=None, shuffle=None, seed=None,
          remainder=None, autotune=False):
    """The rows of every global batch that this rank must feed.

    Two forms. The **scaling form** takes single rows (a dataset of single
    samples, or a list of file names) with ``batch_size=`` (the global batch)
    and yields this rank's local batches: the raw rows are grouped into global
    batches (remainder dropped), this rank keeps its block of each, and only
    those rows go through ``map_fn`` (the decode), so each rank decodes
    ``batch_size / blocks`` rows per step whatever the world size. The
    **batched form** takes a dataset of global batches and keeps this rank's
    rows of each (every rank reads and decodes the whole global batch). Both
    give every rank the same rows.

    Args:
        dataset: A ``tf.data.Dataset`` yielding global batches (``x``,
            ``(x, y)`` or ``(x, y, sample_weight)``, any nesting); or, with
            ``batch_size``, a dataset of single rows or a list of file names
            (one row each); or numpy arrays / a tuple of arrays of whole
            samples with ``batch_size``.
        model: Optional (transformed) model; its ``_tfhybrid_batch_split``
            ("data", the default, or "world") chooses the split. Pass it:
            without it, ``d``/``gmp`` models split by the data axis only.
            When the model's outputs stay in spatial blocks (per-voxel
            outputs under s/ds), ``y`` and a per-voxel ``sample_weight`` are
            also cut to this rank's block.
        batch_size: The global batch size: required with arrays and with
            single rows (the scaling form).
        map_fn: Scaling form only: a function of one row (e.g. read and
            decode an image) applied to this rank's rows only.
        shuffle: Scaling form only: shuffle buffer size in rows; the raw rows
            are shuffled (every epoch anew) before grouping, identically on
            every rank.
        seed: The shuffle seed; None draws one on rank 0 and broadcasts it
            (then ``shard`` is collective: call it on every rank).
        remainder: Batched form and arrays: what to do with a global batch
            whose rows do not split into equal blocks (the last batch of
            ``.batch(B)`` without ``drop_remainder``). "drop" (datasets'
            default) keeps ``rows // blocks`` rows per rank, drops the rest
            and skips a batch of fewer rows than blocks, on every rank alike,
            so every rank runs the same number of steps (rank 0 warns what
            it dropped); "error" (arrays' default: trim them yourself)
            refuses it. (The scaling form drops the partial last batch.)
        autotune: Datasets only. False (default): tf.data's autotuning is
            off for the returned pipeline (``Options().autotune.enabled``):
            its tuning thread often delays the end of every pass over the
            data (each fit, epoch, evaluate) by up to one tuning period
            (doubling from 10 ms to 60 s), and under data parallelism that
            rank holds up the others. True keeps TensorFlow's autotuning.

    Returns:
        A ``tf.data.Dataset`` of local batches, or the arrays of this rank's
        rows (feed them with ``batch_size // blocks`` and ``shuffle=False``).

    Raises:
        ValueError: for a dataset of single samples without ``batch_size``
            (it would split each sample's features), ``batch_size`` with a
            dataset already batched, or when a global batch is not divisible by the number of
            blocks (a static batch size; with remainder="error" and an
            unknown batch size the check runs per batch and raises
            ``tf.errors.InvalidArgumentError``), or for an unknown
            ``remainder``.
        TypeError: for any other kind of ``dataset``.

    Example:
        >>> rows = tf.data.Dataset.from_tensor_slices((png_bytes, labels))
        >>> decode = lambda b, y: (tf.io.decode_png(b, 3), y)
        >>> model.fit(tfhybrid.data.shard(rows, model=model, batch_size=64, map_fn=decode,
        ...                               shuffle=10000), epochs=2)
        >>> ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(64, drop_remainder=True)
        >>> model.fit(tfhybrid.data.shard(ds, model=model), epochs=2)
        >>> x_local, y_local = tfhybrid.data.shard((x, y), batch_size=64)
        >>> # 1000 samples in batches of 63 over 3 ranks: the last batch of 55
        >>> # rows gives 18 rows to each rank (1 row dropped, rank 0 warns)
        >>> ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(63)
        >>> model.fit(tfhybrid.data.shard(ds))
    """
    if remainder is not None and remainder not in REMAINDERS:
        raise ValueError(f"Received an invalid value for `remainder`: {remainder!r}; expected "
                         f"one of {REMAINDERS} (or None: 'drop' for datasets, 'error' for "
                         "arrays).")
    _check_autotune(autotune)
    blocks, index = batch_split(model)
    if _is_file_list(dataset):      # one row per file: the scaling form
        if batch_size is None:
            raise ValueError(f"Received a list of {len(dataset)} file names without "
                             "`batch_size`: pass the global batch, e.g. shard(files, "
                             "batch_size=64, map_fn=load).")
        dataset = tf.data.Dataset.from_tensor_slices([os.fspath(f) for f in dataset])
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
            return _without_autotune_stall(_labels_in_blocks(_local_batches(
                dataset, batch_size, blocks, index, map_fn, shuffle, seed), model), autotune)
        if map_fn is not None or shuffle is not None:
            raise ValueError(
                "Received map_fn/shuffle without batch_size: they apply to a dataset of "
                "single rows. Pass shard(rows, batch_size=<global batch>, map_fn=..., "
                "shuffle=...), or map and shuffle a dataset of global batches yourself.")
        if _unbatched_samples(dataset, model):
            raise ValueError(
                "tfhybrid.data.shard received a dataset of single samples (elements without a "
                "batch dimension, e.g. from_tensor_slices with no .batch()), so it would split "
                "each sample's "
                "features across ranks. Batch it with the global batch size first "
                "(dataset.batch(64, drop_remainder=True)), or pass batch_size=64 and "
                "data.shard batches it.")
        if blocks == 1:
            return _equal(_without_autotune_stall(_labels_in_blocks(dataset, model), autotune))
        return _equal(_without_autotune_stall(_labels_in_blocks(_shard_dataset(
            dataset, blocks, index, remainder or "drop"), model), autotune))
    if isinstance(dataset, (np.ndarray, tuple, list, dict)):
        return _labels_in_blocks(_shard_arrays(dataset, batch_size, blocks, index,
                                               remainder or "error"), model)
    raise TypeError(f"Received an invalid `dataset` of type {type(dataset).__name__}; expected "
                    "a tf.data.Dataset of global batches or numpy arrays with batch_size.")


# The batched form's outputs: blocks of equal rows on every rank at every step
# (the partial last batch is cut alike), although their batch size is not static.
_EQUAL_BLOCKS = weakref.WeakSet()
# Transformations after shard that keep every rank's blocks equal.
_KEEPS_BLOCKS = frozenset({"CacheDataset", "_PrefetchDataset", "_RepeatDataset", "_TakeDataset",
                           "_SkipDataset", "_MapDataset", "_ParallelMapDataset",
                           "_OptionsDataset", "_ShuffleDataset", "_AssertCardinalityDataset"})


def _equal(dataset):
    _EQUAL_BLOCKS.add(dataset)
    return dataset


def equal_blocks(dataset) -> bool:
    """True when every rank's ``dataset`` yields batches of the same rows at every
    step: its batch size is static, or it is :func:`shard`'s batched form
    (possibly followed by cache, prefetch, repeat, take, skip, map, shuffle)."""
    if not isinstance(dataset, tf.data.Dataset):
        return False
    flat = tf.nest.flatten(dataset.element_spec)
    if flat and all(getattr(s, "shape", None) is not None and s.shape.rank
                    and s.shape[0] is not None for s in flat):
        return True
    for _ in range(64):
        if dataset in _EQUAL_BLOCKS:
            return True
        if type(dataset).__name__ not in _KEEPS_BLOCKS:
            return False
        dataset = getattr(dataset, "_input_dataset", None)
        if dataset is None:
            return False
    return False


def _labels_in_blocks(data, model):
    """``data`` with per-voxel labels (and sample weights) cut to this rank's
    spatial block when ``model``'s outputs stay split (s/ds segmentation
    models: :mod:`tfhybrid.layers.spatial.output`); else unchanged."""
    from tfhybrid.layers.spatial.output import split_labels, split_outputs_of

    split = split_outputs_of(model) if model is not None else None
    if split is None:
        return data
    flags, spatial = split
    names = list(getattr(model, "output_names", None) or [])   # labels as a dict by output
    if isinstance(data, tf.data.Dataset):
        return data.map(lambda *e: split_labels(e, spatial, flags, names) if len(e) > 1
                        else e[0], num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
    return split_labels(data, spatial, flags, names)


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


# Sharded volume input (each rank reads only its block): tfhybrid/volumes.py.
from tfhybrid.volumes import volumes  # noqa: E402,F401
