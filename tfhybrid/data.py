"""Input sharding: which rows of each global batch this rank feeds.

Every rank reads the same stream of *global* batches and keeps one block of
rows of each. By default the global batch is split into ``p_data`` blocks and
rank ``r`` keeps block ``data_rank(r)``, so all ranks of a model group see the
same rows (the model group holds one replica). Strategies whose early layers
are data-parallel over all ranks (SplitBrain's ``gmp``, plain ``d``) mark the
transformed model with ``_tfhybrid_batch_split = "world"``; with such a model
the batch is split into ``p`` blocks and rank ``r`` keeps block ``r``.

Record files (``shard(files, reader=...)``) are the exception to the shared
stream: each block opens only its share of the files (:func:`record_plan`),
and the blocks' local batches still make the global batches of one process
reading :func:`record_order`.

## Forms

:func:`shard` has three forms, chosen by its arguments.

The **scaling form** takes single rows (a dataset of single samples, or a
list of file names) with ``batch_size=`` (the global batch) and yields this
rank's local batches: the raw rows are grouped into global batches
(remainder dropped), this rank keeps its block of each, and only those rows
go through ``map_fn`` (the decode), so each rank decodes
``batch_size / blocks`` rows per step whatever the world size. The
**batched form** takes a dataset of global batches and keeps this rank's
rows of each (every rank reads and decodes the whole global batch). Both
give every rank the same rows, and both have every rank *read* every raw
row (a dataset of rows is one stream).

The **record-file form**, ``shard(files, reader=tf.data.TFRecordDataset,
batch_size=64, map_fn=parse)``, also reads only this rank's share: each
block of the global batch (a data-parallel group: its ranks read the same
files and rows; under ``d``/``gmp`` every rank) opens only its share of
the files, so each rank reads ``total / blocks`` raw records when the
number of files is a multiple of ``blocks`` and divides the global batch
(fewer files than blocks: each rank reads one file's worth; otherwise
``total / gcd(files, batch, blocks)`` and rank 0 warns). The global
batches are exactly those of one process reading
:func:`record_order` ``(files, batch_size, reader)``: the files read side
by side, ``batch_size / len(files)`` records of each per global batch
(in consecutive groups of files when there are more files than that
divides), whatever the number of ranks, so without ``shuffle`` the
numbers equal one process's. ``shuffle=N`` shuffles each block's records
(buffer of N, one seed on every rank, every epoch anew): the global
batches then depend on the number of blocks. Every epoch has the same,
known number of global batches (Keras' steps per epoch): as many as the
file group with the fewest records fills (rank 0 warns when files differ
in length). Counting them at ``shard`` reads only the record headers of
an uncompressed ``TFRecordDataset`` (other readers: one pass over this
rank's files, without ``map_fn``); ``shard`` is then collective (one
allgather): call it on every rank.

## Remainders

``shard``'s ``remainder`` (batched form and arrays) says what to do with a
global batch whose rows do not split into equal blocks (``.batch(B)``
without ``drop_remainder``: its partial last batch, or every batch when
``B`` is not a multiple of the blocks).

* ``"drop"`` (datasets' default) cuts such a batch into blocks of
  ``rows // blocks`` rows or one row more, so every row is trained and
  evaluated as in one process (``fit``'s guards find the unequal blocks and
  weigh each by its rows); a batch of fewer rows than blocks is skipped on
  every rank (rank 0 warns). Where blocks must be equal (gmp's model
  groups, p/ls parts, s/ds outputs, ``Config(guards=False)``) each rank
  keeps ``rows // blocks`` rows of a partial last batch (rank 0 warns what
  it dropped), and a ``.batch(B)`` whose ``B`` is not a multiple of the
  blocks is refused (ValueError).
* ``"error"`` (arrays' default: trim them yourself) refuses any uneven
  batch.

The scaling form drops the partial last batch.

## Autotuning

``shard(..., autotune=False)`` (the default, datasets only) turns tf.data's
autotuning off for the returned pipeline (``Options().autotune.enabled``):
its tuning thread often delays the end of every pass over the data (each
fit, epoch, evaluate) by up to one tuning period (doubling from 10 ms to
60 s), and under data parallelism that rank holds up the others.
``autotune=True`` keeps TensorFlow's autotuning.
"""
from __future__ import annotations

import collections
import math
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
    found = _batch_op(dataset)
    if found is None or found[2] < 0:
        return None
    batch, drop, rows = found
    return int(not drop and 0 < rows % batch < blocks)


def _batch_op(dataset):
    """``(B, drop_remainder, rows or -1)`` of the ``.batch(B)`` that makes
    ``dataset``'s batches (followed only by ops that keep them: map, shuffle,
    prefetch, cache), ``rows`` its input's cardinality; None if not found."""
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
            return batch, drop, max(rows, -1)
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


def _unequal_allowed(model):
    """``(True, "")`` when the ranks' blocks of a global batch may differ by a
    row for ``model``, else ``(False, why not)``.

    ``fit`` then weighs each block by its rows (the guards find such a dataset
    at its start: :func:`tfhybrid.batch_losses.rows_factor`), so the step is
    the global batch's, and ``evaluate`` sums the metric states of the blocks.
    That needs the guards, one row block per rank group of plain layers, and a
    model group whose ranks feed the same rows (or a model group of one).
    """
    if not runtime.config_or_default().guards:
        return False, ("blocks of unequal rows are weighed by the guards, which are off "
                       "(Config(guards=False))")
    if model is None:
        return True, ""
    if getattr(model, "_tfhybrid_batch_blocks", None) is not None \
            or callable(getattr(model, "row_blocks", None)):
        return False, "its parts (p, ls) cut every global batch into equal blocks"
    if any(getattr(model, "_tfhybrid_split_outputs", ())):
        return False, "its outputs stay in spatial blocks (s, ds), cut into equal blocks"
    if getattr(model, "_tfhybrid_batch_split", "data") == "world" \
            and runtime.current_grid().model_size > 1:
        return False, ("each model group gathers its ranks' rows into one batch (gmp), "
                       "which needs equal blocks")
    return True, ""


def _splits_unequally(dataset, blocks, remainder, allowed):
    """True when :func:`_shard_dataset` gives the ranks blocks that may differ by a
    row: a batch size not known statically (``.batch(B)`` without
    ``drop_remainder``), ``remainder="drop"``, ``allowed`` (:func:`_unequal_allowed`),
    and not every batch known to divide into ``blocks`` equal blocks."""
    if not allowed or remainder != "drop" or None not in _batch_dims(dataset):
        return False
    found = _batch_op(dataset)
    if found is None:
        return True
    batch, drop, rows = found
    return bool(batch % blocks or (not drop and (rows < 0 or (rows % batch) % blocks)))


def _odd_batch_error(batch, blocks, why):
    return (f"tfhybrid.data.shard: global batches of {batch} rows (.batch({batch})) do not split "
            f"into {blocks} equal blocks, one per data-parallel rank, and this model needs "
            f"equal blocks: {why}. Each rank would drop {batch % blocks} row(s) of every "
            f"global batch. Batch by a multiple of {blocks} (e.g. "
            f".batch({batch - batch % blocks}) or .batch({batch - batch % blocks + blocks})).")


def _shard_dataset(dataset, blocks, index, remainder="drop", allowed=(False, "")):
    dims = _batch_dims(dataset)
    for n in dims:
        if n is not None and n % blocks:
            raise ValueError(_divisible_error(n, blocks))
    uneven = None in dims and remainder == "drop"
    # blocks of size // blocks or one row more (the first size % blocks ranks):
    # every row of the batch is trained, as in one process
    unequal = _splits_unequally(dataset, blocks, remainder, allowed[0])
    found = _batch_op(dataset) if uneven and not unequal else None
    if found is not None and found[0] % blocks:      # every batch would lose rows
        raise ValueError(_odd_batch_error(found[0], blocks, allowed[1] or "unknown"))
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
        if unequal:
            local, extra = size // blocks, size % blocks
            start = index * local + tf.minimum(index, extra)
            return t[start:start + local + tf.cast(index < extra, size.dtype)]
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
        if uneven and not unequal and runtime.is_root():
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
    or ``predict`` pass) often waits for that thread's next period (TF
    2.18.1, plain Keras, one process too: up to a third of a short epoch);
    under data parallelism the waiting rank holds the others at their next
    collective.
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


# -- record files: each data-parallel block reads only its share of the files ------

RecordPlan = collections.namedtuple(
    "RecordPlan", "file_groups per_batch split part groups readers")
RecordPlan.__doc__ = """Which files one block of the global batch reads (arithmetic, no I/O).

``n_files`` files are taken in ``groups = gcd(n_files, batch_size)``
consecutive file groups (one file each when ``n_files`` divides the global
batch); global batch ``k`` holds records ``k * per_batch .. (k + 1) *
per_batch - 1`` of every file group (a group read as its files one after
another), in group order, ``per_batch = batch_size // groups``. The blocks
form ``readers = gcd(groups, blocks)`` sets of ``split = blocks / readers``
consecutive blocks; a set reads ``groups / readers`` file groups
(``file_groups``: the file indices of each) and its blocks keep part
``part`` of each batch's share: block ``index`` gets exactly positions
``index * local .. (index + 1) * local - 1`` of every global batch.
"""


def record_plan(n_files, batch_size, blocks, index) -> RecordPlan:
    """The :data:`RecordPlan` of block ``index`` of ``blocks`` for ``n_files``
    record files and a global batch of ``batch_size``.

    Example:
        >>> record_plan(4, 16, 2, 1).file_groups     # 4 files, batch 16, block 1 of 2
        ((2,), (3,))
    """
    groups = math.gcd(n_files, batch_size)
    per_file_group, per_batch = n_files // groups, batch_size // groups
    readers = math.gcd(groups, blocks)
    split = blocks // readers
    reader_index, part = divmod(index, split)
    mine = range(reader_index * (groups // readers), (reader_index + 1) * (groups // readers))
    return RecordPlan(tuple(tuple(range(j * per_file_group, (j + 1) * per_file_group))
                            for j in mine), per_batch, split, part, groups, readers)


def _record_file_names(files):
    """``files`` as a list of str; raises for anything but existing, distinct files."""
    if isinstance(files, (str, bytes, os.PathLike)):
        raise ValueError(f"Received one file name {files!r} with reader=: pass a list of "
                         "record files, e.g. shard([path], reader=tf.data.TFRecordDataset, "
                         "batch_size=64) or shard(sorted(tf.io.gfile.glob(pattern)), ...).")
    if isinstance(files, tf.data.Dataset) or not isinstance(files, (list, tuple)):
        raise ValueError(f"Received {type(files).__name__} with reader=: reader= takes a list "
                         "of record file names (shard(files, reader=tf.data.TFRecordDataset, "
                         "batch_size=64)); for a dataset of records, drop reader=.")
    if not files:
        raise ValueError("Received an empty list of record files: pass at least one file "
                         "name, e.g. sorted(tf.io.gfile.glob('train-*.tfrecord')).")
    names = []
    for f in files:
        if not isinstance(f, (str, bytes, os.PathLike)):
            raise ValueError(f"Received {f!r} (type {type(f).__name__}) in the list of "
                             "record files: every item must be a file name (str or path).")
        names.append(os.fsdecode(f))
    seen = set()
    for name in names:
        if name in seen:
            raise ValueError(f"Record file {name!r} is listed twice: its records would be "
                             "read twice per epoch. Pass each file once.")
        seen.add(name)
    missing = [name for name in names if not tf.io.gfile.exists(name)]
    if missing:
        more = f" (and {len(missing) - 1} more of the {len(names)})" if len(missing) > 1 else ""
        raise FileNotFoundError(f"Record file {missing[0]!r} does not exist{more}: "
                                "tfhybrid.data.shard(files, reader=...) needs every file "
                                "readable on every rank.")
    return names


def _plain_tfrecords(dataset) -> bool:
    """True when ``dataset`` is an uncompressed ``TFRecordDataset``, possibly
    followed by per-record maps, prefetch or options (one element per record)."""
    for _ in range(32):
        name = type(dataset).__name__
        if name == "TFRecordDatasetV2":
            return getattr(dataset, "_compression_type", None) in (None, "")
        if name not in ("_MapDataset", "_ParallelMapDataset", "_PrefetchDataset",
                        "_OptionsDataset"):
            return False
        try:
            inputs = dataset._inputs()
        except Exception:  # noqa: BLE001 - tf.data internals differ: count by reading
            return False
        if len(inputs) != 1:
            return False
        dataset = inputs[0]
    return False


def _count_tfrecords(path) -> int:
    """Records in the uncompressed TFRecord file ``path``, from the records'
    length headers alone (12 bytes read per record; the data is skipped)."""
    size = tf.io.gfile.stat(path).length
    count = pos = 0
    opened = open(path, "rb") if "://" not in path else tf.io.gfile.GFile(path, "rb")
    with opened as f:
        while pos < size:
            f.seek(pos)
            head = f.read(8)
            if len(head) < 8:
                break
            pos += 16 + int.from_bytes(head, "little")
            count += 1
    if pos != size:
        raise ValueError(f"Record file {path!r} is not an uncompressed TFRecord file (its "
                         f"record {count} runs past the file's {size} bytes): pass the "
                         "reader that wrote it, e.g. reader=lambda f: "
                         "tf.data.TFRecordDataset(f, compression_type='GZIP').")
    return count


def _count_records(path, reader, plain) -> int:
    if plain:
        return _count_tfrecords(path)
    ones = reader([path]).map(lambda *_: tf.constant(1, tf.int64))
    return int(ones.reduce(tf.constant(0, tf.int64), lambda total, one: total + one))


def _record_stream(file_groups, per_batch, reader):
    """The records of ``file_groups`` (lists of names) read side by side,
    ``per_batch`` records of each group in turn."""
    if len(file_groups) == 1:
        return reader(list(file_groups[0]))
    return tf.data.Dataset.from_tensor_slices([list(g) for g in file_groups]).interleave(
        reader, cycle_length=len(file_groups), block_length=per_batch)


def _check_reader(reader):
    if not callable(reader):
        raise ValueError(f"Received an invalid value for `reader`: {reader!r}; expected a "
                         "function of a list of file names returning a tf.data.Dataset of "
                         "raw records, e.g. reader=tf.data.TFRecordDataset.")


def record_order(files, batch_size, reader=tf.data.TFRecordDataset):
    """The raw records of ``files`` in the order of :func:`shard`'s global
    batches (one process, no ranks involved).

    ``shard(files, reader=reader, batch_size=B, map_fn=f)`` on any number of
    ranks trains on the global batches of
    ``record_order(files, B, reader).map(f).batch(B, drop_remainder=True)``
    (without ``shuffle``; each rank feeds its block of rows of each). The
    files are taken in ``V = gcd(len(files), B)`` consecutive groups (one file
    each when ``len(files)`` divides ``B``), a group read as its files one
    after another, and the groups are read side by side, ``B / V`` records of
    each in turn::

        groups = [files[j * len(files) // V:(j + 1) * len(files) // V] for j in range(V)]
        tf.data.Dataset.from_tensor_slices(groups).interleave(
            reader, cycle_length=V, block_length=B // V)

    so global batch ``k`` holds records ``k * B / V .. (k + 1) * B / V - 1``
    of every group. For files of equal length this is every record, all
    global batches full but the dropped remainder; :func:`shard` stops each
    epoch when the file group with the fewest records runs out (here the
    other groups continue).

    Raises:
        ValueError / FileNotFoundError: as :func:`shard` with ``reader=``.
    """
    names = _record_file_names(files)
    _check_reader(reader)
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"Received an invalid value for `batch_size`: {batch_size!r}; "
                         "expected the global batch size (a positive integer).")
    plan = record_plan(len(names), batch_size, 1, 0)
    return _record_stream([[names[i] for i in g] for g in plan.file_groups], plan.per_batch,
                          reader)


def _record_steps(local_steps, shortest, longest):
    """Global batches per epoch: the least over every rank's file groups
    (collective over the world when there are several ranks)."""
    from tfhybrid.comm import backend

    mine = np.array([[local_steps, shortest, longest]], np.int64)
    if backend.is_initialized() and backend.size() > 1:
        world = tuple(range(backend.size()))
        mine = backend.allgather(tf.constant(mine), world, "data.record_steps").numpy()
    return int(mine[:, 0].min()), int(mine[:, 1].min()), int(mine[:, 2].max())


def _record_batches(files, reader, batch_size, blocks, index, map_fn, shuffle, seed):
    """This rank's local batches of the record files ``files``: its file
    groups only (see :func:`record_plan`), with a known number of batches."""
    from tfhybrid.comm import backend

    names = _record_file_names(files)
    _check_reader(reader)
    if batch_size is None:
        raise ValueError(f"Received {len(names)} record files without `batch_size`: pass the "
                         "global batch, e.g. shard(files, reader=tf.data.TFRecordDataset, "
                         "batch_size=64, map_fn=decode).")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"Received an invalid value for `batch_size`: {batch_size!r}; "
                         "expected the global batch size (a positive integer).")
    if batch_size % blocks:
        raise ValueError(_divisible_error(batch_size, blocks))
    if shuffle is not None and (isinstance(shuffle, bool) or not isinstance(shuffle, int)
                                or shuffle < 1):
        raise ValueError(f"Received an invalid value for `shuffle`: {shuffle!r}; expected "
                         "a shuffle buffer size in records (a positive integer), or None.")
    if map_fn is not None and not callable(map_fn):
        raise ValueError(f"Received an invalid value for `map_fn`: {map_fn!r}; expected a "
                         "function of one record (e.g. one that parses and decodes it), or "
                         "None.")
    plan = record_plan(len(names), batch_size, blocks, index)
    groups = [[names[i] for i in g] for g in plan.file_groups]
    probe = reader([groups[0][0]])
    if not isinstance(probe, tf.data.Dataset):
        raise ValueError(f"`reader` returned {type(probe).__name__} for [{groups[0][0]!r}]; "
                         "expected a tf.data.Dataset of raw records (e.g. "
                         "reader=tf.data.TFRecordDataset).")
    plain = _plain_tfrecords(probe)
    counts, error = {}, None
    try:          # a file only this rank reads may fail: every rank stops alike
        for group in groups:
            for name in group:
                counts[name] = _count_records(name, reader, plain)
    except Exception as err:  # noqa: BLE001 - raised below, on every rank
        error = err
    if backend.is_initialized() and backend.size() > 1:
        backend.raise_together(error, "tfhybrid.data.shard: counting the records of the "
                               "record files")
    elif error is not None:
        raise error
    per_group = [sum(counts[n] for n in group) for group in groups]
    steps, shortest, longest = _record_steps(min(per_group) // plan.per_batch,
                                             min(per_group), max(per_group))
    if steps == 0:
        raise ValueError(f"The record files make no full global batch of {batch_size}: each "
                         f"takes {plan.per_batch} records per global batch from each of "
                         f"{plan.groups} groups of files, and the shortest group holds "
                         f"{shortest} records. Use a smaller batch_size or more records.")
    if runtime.is_root():
        if longest // plan.per_batch > steps:
            warnings.warn(
                f"tfhybrid.data.shard: the record files hold different numbers of records "
                f"({shortest} to {longest} per group of {len(names) // plan.groups} files): "
                f"each epoch takes {plan.per_batch} records of every group per global batch "
                f"and stops after {steps} batches, when the shortest group runs out; the "
                "longer groups' later records are not used. Write files of equal length.",
                stacklevel=3)
        if plan.split > 1 and len(names) >= blocks:
            warnings.warn(
                f"tfhybrid.data.shard: {len(names)} record files do not divide over {blocks} "
                f"data-parallel blocks: each rank reads 1/{plan.readers} of the records "
                f"and keeps 1/{blocks}. A number of files that is a multiple of {blocks} and "
                f"divides the global batch ({batch_size}) lets each read only its 1/{blocks}.",
                stacklevel=3)
    local = batch_size // blocks
    stream = _record_stream(groups, plan.per_batch, reader).take(
        steps * len(groups) * plan.per_batch)
    if shuffle is not None:       # the same seed on every rank: a block's ranks agree
        stream = stream.shuffle(shuffle, seed=_shared_seed(seed), reshuffle_each_iteration=True)
    if plan.split > 1:           # the blocks reading the same groups: each keeps its part
        start, stop = plan.part * local, (plan.part + 1) * local

        def part(*share):
            out = tf.nest.map_structure(lambda t: t[start:stop], share)
            return out[0] if len(out) == 1 else out

        stream = stream.batch(plan.split * local, drop_remainder=True).map(part).unbatch()
    if map_fn is not None:
        stream = stream.map(map_fn, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
    return stream.batch(local, drop_remainder=True).apply(
        tf.data.experimental.assert_cardinality(steps))


def _check_remainder(remainder):
    """Raise ValueError unless ``remainder`` is None or one of :data:`REMAINDERS`."""
    if remainder is not None and remainder not in REMAINDERS:
        raise ValueError(f"Received an invalid value for `remainder`: {remainder!r}; expected "
                         f"one of {REMAINDERS} (or None: 'drop' for datasets, 'error' for "
                         "arrays).")


def _file_rows(files, batch_size):
    """The scaling form's dataset of the file names ``files``, one row each (needs ``batch_size``)."""
    if batch_size is None:
        raise ValueError(f"Received a list of {len(files)} file names without "
                         "`batch_size`: pass the global batch, e.g. shard(files, "
                         "batch_size=64, map_fn=load).")
    return tf.data.Dataset.from_tensor_slices([os.fspath(f) for f in files])


def _check_row_batch(dataset, batch_size, blocks):
    """Raise ValueError unless ``batch_size`` is a positive global batch that ``blocks``
    divides and ``dataset`` (the scaling form's rows) is not batched already."""
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


def _batched_form(dataset, model, blocks, index, remainder, autotune, map_fn, shuffle):
    """The batched form: this rank's rows of each global batch of ``dataset``, registered
    with :func:`equal_blocks` unless the ranks' blocks may differ by a row."""
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
    allowed = _unequal_allowed(model)
    out = _without_autotune_stall(_labels_in_blocks(_shard_dataset(
        dataset, blocks, index, remainder or "drop", allowed), model), autotune)
    # blocks that may differ by a row: fit's guards weigh them by their rows
    unequal = _splits_unequally(dataset, blocks, remainder or "drop", allowed[0])
    return out if unequal else _equal(out)


def shard(dataset, model=None, batch_size=None, *, map_fn=None, shuffle=None, seed=None,
          remainder=None, autotune=False, reader=None):
    """The rows of every global batch that this rank must feed.

    Three forms, chosen by the arguments: the **scaling form** (single rows with
    ``batch_size=``), the **batched form** (a dataset of global batches) and the
    **record-file form** (record files with ``reader=``); see the module documentation, *Forms*.

    Args:
        dataset: A ``tf.data.Dataset`` yielding global batches (``x``, ``(x, y)`` or
            ``(x, y, sample_weight)``, any nesting); or, with ``batch_size``, a dataset of
            single rows or a list of file names (one row each); or numpy arrays / a tuple
            of arrays of whole samples with ``batch_size``; or, with ``reader``, a list of
            record file names (the record-file form).
        model: Optional (transformed) model; its ``_tfhybrid_batch_split`` ("data", the
            default, or "world") chooses the split. Pass it: without it, ``d``/``gmp``
            models split by the data axis only. When the model's outputs stay in spatial
            blocks (per-voxel outputs under s/ds), ``y`` and a per-voxel
            ``sample_weight`` are also cut to this rank's block.
        batch_size: The global batch size: required with arrays and with single rows
            (the scaling form).
        map_fn: Scaling form only: a function of one row (e.g. read and decode an image)
            applied to this rank's rows only.
        shuffle: Scaling form only: shuffle buffer size in rows; the raw rows are
            shuffled (every epoch anew) before grouping, identically on every rank.
        seed: The shuffle seed; None draws one on rank 0 and broadcasts it (then
            ``shard`` is collective: call it on every rank).
        remainder: Batched form and arrays: what to do with a global batch whose rows
            do not split into equal blocks. "drop" (datasets' default) cuts it into
            blocks of ``rows // blocks`` rows or one row more, or, where blocks must be
            equal, drops the extra rows or refuses the batch size; "error" (arrays'
            default) refuses any uneven batch. See the module documentation, *Remainders*.
        autotune: Datasets only. False (default): tf.data's autotuning is off for the
            returned pipeline, whose tuning thread delays the end of every pass over the
            data (see the module documentation, *Autotuning*). True keeps it.
        reader: Record files only: a function of a list of file names returning a
            ``tf.data.Dataset`` of their raw records in order (``tf.data.TFRecordDataset``,
            ``tf.data.TextLineDataset``, a lambda adding ``compression_type=``);
            ``map_fn`` parses and decodes one record.

    Returns:
        A ``tf.data.Dataset`` of local batches, or the arrays of this rank's
        rows (feed them with ``batch_size // blocks`` and ``shuffle=False``).

    Raises:
        ValueError: for a dataset of single samples without ``batch_size`` (it would
            split each sample's features), ``batch_size`` with a dataset already
            batched, or when a global batch is not divisible by the number of blocks (a
            static batch size; with remainder="error" and an unknown batch size the check
            runs per batch and raises ``tf.errors.InvalidArgumentError``), or for an
            unknown ``remainder``. With ``reader``: an empty list of files, a name listed
            twice, a reader that is not callable or returns no dataset, ``remainder``, a
            TFRecord file that is not one, or files too short for one global batch.
        FileNotFoundError: with ``reader``, naming the first missing file.
        TypeError: for any other kind of ``dataset``.

    Example:
        >>> rows = tf.data.Dataset.from_tensor_slices((png_bytes, labels))
        >>> decode = lambda b, y: (tf.io.decode_png(b, 3), y)
        >>> model.fit(tfhybrid.data.shard(rows, model=model, batch_size=64, map_fn=decode,
        ...                               shuffle=10000), epochs=2)
        >>> files = sorted(tf.io.gfile.glob("train-*.tfrecord"))    # e.g. 64 files
        >>> model.fit(tfhybrid.data.shard(files, reader=tf.data.TFRecordDataset, model=model,
        ...                               batch_size=64, map_fn=parse), epochs=2)
        >>> ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(64, drop_remainder=True)
        >>> model.fit(tfhybrid.data.shard(ds, model=model), epochs=2)
        >>> x_local, y_local = tfhybrid.data.shard((x, y), batch_size=64)
        >>> # 1000 samples in batches of 63 over 3 ranks: the last batch of 55
        >>> # rows gives 19, 18 and 18 rows to the ranks (every row trained)
        >>> ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(63)
        >>> model.fit(tfhybrid.data.shard(ds))
    """
    _check_remainder(remainder)
    _check_autotune(autotune)
    blocks, index = batch_split(model)
    if reader is not None:          # record files: each block reads its share of the files
        if remainder is not None:
            raise ValueError("Received remainder= with reader=: record files always drop the "
                             "records that make no full global batch; drop remainder=.")
        return _without_autotune_stall(_labels_in_blocks(_record_batches(
            dataset, reader, batch_size, blocks, index, map_fn, shuffle, seed), model), autotune)
    if _is_file_list(dataset):      # one row per file: the scaling form
        dataset = _file_rows(dataset, batch_size)
    if isinstance(dataset, tf.data.Dataset):
        if batch_size is not None:      # a dataset of single samples: batch it globally here
            _check_row_batch(dataset, batch_size, blocks)
            return _without_autotune_stall(_labels_in_blocks(_local_batches(
                dataset, batch_size, blocks, index, map_fn, shuffle, seed), model), autotune)
        return _batched_form(dataset, model, blocks, index, remainder, autotune, map_fn, shuffle)
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
