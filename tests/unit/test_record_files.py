"""data.shard(files, reader=...): which files each block reads, the global batches
they make (one process, each block built in turn), and the errors."""
import os

import pytest
import tensorflow as tf

from tfhybrid import data


def write(folder, sizes, compression=None):
    """TFRecord files holding the records "0", "1", ... in order."""
    paths, k = [], 0
    for i, n in enumerate(sizes):
        path = os.path.join(folder, f"part-{i}.tfrecord")
        with tf.io.TFRecordWriter(path, compression) as w:
            for _ in range(n):
                w.write(str(k).encode())
                k += 1
        paths.append(path)
    return paths


def numbers(batch):
    return [int(v) for v in tf.strings.to_number(batch, tf.int64).numpy()]


@pytest.mark.parametrize("n_files, batch, blocks, expect", [
    # (file groups of each block, records per group per batch, split)
    (4, 16, 2, ([[(0,), (1,)], [(2,), (3,)]], 4, 1)),
    (4, 16, 4, ([[(0,)], [(1,)], [(2,)], [(3,)]], 4, 1)),
    (2, 16, 4, ([[(0,)], [(0,)], [(1,)], [(1,)]], 8, 2)),        # fewer files than blocks
    (8, 4, 2, ([[(0, 1), (2, 3)], [(4, 5), (6, 7)]], 1, 1)),    # more files than the batch
    (3, 6, 2, ([[(0,), (1,), (2,)], [(0,), (1,), (2,)]], 2, 2)),  # 3 files, 2 blocks: shared
])
def test_record_plan(n_files, batch, blocks, expect):
    groups, per_batch, split = expect
    plans = [data.record_plan(n_files, batch, blocks, i) for i in range(blocks)]
    assert [list(p.file_groups) for p in plans] == groups
    assert all(p.per_batch == per_batch and p.split == split for p in plans)
    assert [p.part for p in plans] == [i % split for i in range(blocks)]


def test_record_order_is_the_documented_interleave(tmp_path):
    files = write(tmp_path, [12, 12, 12, 12])
    got = [numbers(b) for b in data.record_order(files, 8).batch(8, drop_remainder=True)]
    plain = (tf.data.Dataset.from_tensor_slices(files)
             .interleave(tf.data.TFRecordDataset, cycle_length=4, block_length=2)
             .batch(8, drop_remainder=True))
    assert got == [numbers(b) for b in plain]
    assert got[0] == [0, 1, 12, 13, 24, 25, 36, 37]


@pytest.mark.parametrize("sizes, batch, blocks, read", [
    ([32] * 4, 16, 2, [64, 64]),
    ([32] * 4, 16, 4, [32] * 4),
    ([64] * 2, 16, 4, [64] * 4),            # fewer files than blocks: one file each
    ([20] * 6, 16, 4, [56] * 4),            # 6 files over 4 blocks: half each (warned)
    ([3] * 8, 4, 2, [12, 12]),              # 8 files, batch 4: groups of 2 files
])
def test_blocks_make_the_global_batches_of_one_process(tmp_path, sizes, batch, blocks, read):
    files = write(tmp_path, sizes)
    count = tf.Variable(0, dtype=tf.int64)

    def reader(names):
        return tf.data.TFRecordDataset(names).map(lambda r: (count.assign_add(1), r)[1])

    parts, reads = [], []
    with pytest.warns(UserWarning, match="do not divide") if len(sizes) == 6 else \
            _no_warning():
        for i in range(blocks):
            ds = data._record_batches(files, reader, batch, blocks, i, None, None, None)
            count.assign(0)
            parts.append([numbers(b) for b in ds])
            reads.append(int(count.numpy()))
            assert int(ds.cardinality()) == len(parts[-1])
    order = [numbers(b) for b in data.record_order(files, batch).batch(batch, drop_remainder=True)]
    joined = [sum((p[k] for p in parts), []) for k in range(len(parts[0]))]
    assert joined == order                  # equal files: every full batch, in order
    assert reads == read


class _no_warning:
    def __enter__(self):
        import warnings
        self._w = warnings.catch_warnings()
        self._w.__enter__()
        warnings.simplefilter("error")

    def __exit__(self, *exc):
        self._w.__exit__(*exc)


def test_unequal_files_stop_at_the_shortest_and_warn(tmp_path):
    files = write(tmp_path, [8, 6, 8, 8])
    with pytest.warns(UserWarning, match="different numbers of records"):
        ds = data._record_batches(files, tf.data.TFRecordDataset, 8, 1, 0, None, None, None)
    batches = [numbers(b) for b in ds]
    assert len(batches) == int(ds.cardinality()) == 3          # 6 // 2
    assert batches[0] == [0, 1, 8, 9, 14, 15, 22, 23]


def test_map_fn_and_headers_count_compressed_with_a_reader(tmp_path):
    files = write(tmp_path, [4, 4], compression="GZIP")
    reader = lambda f: tf.data.TFRecordDataset(f, compression_type="GZIP")  # noqa: E731
    ds = data.shard(files, reader=reader, batch_size=4,
                    map_fn=lambda r: tf.strings.to_number(r, tf.int64) * 10)
    assert [b.numpy().tolist() for b in ds] == [[0, 10, 40, 50], [20, 30, 60, 70]]


@pytest.mark.parametrize("files, kwargs, error, match", [
    ([], {}, ValueError, "empty list of record files"),
    ("one.tfrecord", {}, ValueError, "one file name"),
    ([1, 2], {}, ValueError, "must be a file name"),
    (None, {"reader": 3}, ValueError, "invalid value for `reader`"),
    (None, {"reader": lambda f: [1]}, ValueError, "returned list"),
    (None, {"batch_size": None}, ValueError, "without `batch_size`"),
    (None, {"remainder": "drop"}, ValueError, "remainder= with reader="),
    (None, {"batch_size": 64}, ValueError, "no full global batch"),
    (None, {"map_fn": 5}, ValueError, "invalid value for `map_fn`"),
    (None, {"shuffle": 0}, ValueError, "invalid value for `shuffle`"),
])
def test_errors(tmp_path, files, kwargs, error, match):
    real = write(tmp_path, [4, 4])
    args = dict(reader=tf.data.TFRecordDataset, batch_size=4)
    args.update(kwargs)
    with pytest.raises(error, match=match):
        data.shard(real if files is None else files, **args)


def test_missing_and_repeated_files_are_named(tmp_path):
    real = write(tmp_path, [4])
    gone = str(tmp_path / "gone.tfrecord")
    with pytest.raises(FileNotFoundError, match="gone.tfrecord"):
        data.shard(real + [gone], reader=tf.data.TFRecordDataset, batch_size=2)
    with pytest.raises(ValueError, match="listed twice"):
        data.shard(real + real, reader=tf.data.TFRecordDataset, batch_size=2)
    with pytest.raises(ValueError, match="reader= takes a list"):
        data.shard(tf.data.TFRecordDataset(real), reader=tf.data.TFRecordDataset, batch_size=2)


def test_not_a_tfrecord_file(tmp_path):
    path = tmp_path / "text.tfrecord"
    path.write_bytes(b"not a record file at all, just text\n" * 3)
    with pytest.raises(ValueError, match="not an uncompressed TFRecord"):
        data.shard([str(path)], reader=tf.data.TFRecordDataset, batch_size=1)


def test_shuffle_keeps_each_batch_a_permutation_of_rows(tmp_path):
    files = write(tmp_path, [8, 8])
    ds = data.shard(files, reader=tf.data.TFRecordDataset, batch_size=4, shuffle=16, seed=1)
    epochs = [[numbers(b) for b in ds] for _ in range(2)]
    for batches in epochs:
        assert sorted(v for b in batches for v in b) == list(range(16))
    assert epochs[0] != epochs[1]                   # reshuffled every epoch (seed 1)
