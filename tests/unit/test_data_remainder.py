"""data.shard with partial last batches, in one process on a pretend grid of 2 ranks."""
import warnings

import numpy as np
import pytest
import tensorflow as tf

import tfhybrid
from tfhybrid import data, runtime
from tfhybrid.process_grid import ProcessGrid
from tests.pretend_grid import pretend


def rank_of_2(rank):
    """This process as ``rank`` of a pretend 2-rank data-parallel grid."""
    return pretend(2, rank, 1)


def rows(n, batch=8, drop=False):
    return tf.data.Dataset.from_tensor_slices(np.arange(n)).batch(batch, drop_remainder=drop)


@pytest.mark.parametrize("ds, short", [
    (rows(21), 0),                                   # last batch 5 rows >= 2 ranks
    (rows(17), 1),                                   # last batch 1 row < 2
    (rows(17, drop=True), 0),
    (rows(17).map(lambda x: x * 2).prefetch(1), 1),  # ops that keep the batches
    (rows(17).repeat(), None),
    (tf.data.Dataset.from_generator(lambda: iter([np.arange(3)]),
                                    output_signature=tf.TensorSpec([None], tf.int64)), None),
])
def test_short_batches(ds, short):
    assert data._short_batches(ds, 2) == short


@pytest.mark.parametrize("rank", [0, 1])
def test_partial_batches_trimmed_and_tiny_ones_skipped(rank):
    with rank_of_2(rank), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        local = tfhybrid.data.shard(rows(17 + 8))       # batches of 8, 8, 8, 1
        assert int(local.cardinality()) == 3            # Keras still knows the steps
        got = [b.numpy().tolist() for b in local]
        local21 = [b.numpy().tolist() for b in tfhybrid.data.shard(rows(21))]
        assert not data.equal_blocks(tfhybrid.data.shard(rows(21)))   # fit weighs the blocks
        assert data.equal_blocks(tfhybrid.data.shard(rows(24)))      # 8, 8, 8: equal blocks
    assert got == [list(range(s + 4 * rank, s + 4 * rank + 4)) for s in (0, 8, 16)]
    assert local21[-1] == [[16, 17, 18], [19, 20]][rank]     # 5 rows: 3 + 2, every row kept
    said = " ".join(str(w.message) for w in caught)
    if rank == 0:
        assert "skipped a global batch of 1 rows" in said
        assert "dropped" not in said
    else:
        assert "tfhybrid.data.shard" not in said


@pytest.mark.parametrize("rank", [0, 1])
def test_odd_batch_size_keeps_every_row_or_is_refused(rank):
    """``.batch(15)`` over 2 ranks: blocks of 8 and 7 rows (every row trained);
    where blocks must be equal (gmp's model groups) a ValueError that names the
    batch, the ranks and the fix, instead of a row of every batch dropped."""
    with rank_of_2(rank):
        got = [b.numpy().tolist() for b in tfhybrid.data.shard(rows(60, batch=15))]
        gmp = type("Gmp", (), {"layers": [], "_tfhybrid_batch_split": "world"})()
        runtime._STATE["grid"] = ProcessGrid(size=2, rank=rank, model_parallel=2)
        with pytest.raises(ValueError, match=r"batches of 15 rows .*2 equal blocks.*"
                                             r"\.batch\(14\) or \.batch\(16\)"):
            tfhybrid.data.shard(rows(60, batch=15), model=gmp)
    assert got == [list(range(s, s + 8)) if rank == 0 else list(range(s + 8, s + 15))
                   for s in (0, 15, 30, 45)]


def test_remainder_error_and_bad_value():
    with rank_of_2(0):
        local = tfhybrid.data.shard(rows(21), remainder="error")
        with pytest.raises(tf.errors.InvalidArgumentError, match="not divisible"):
            list(local)
        with pytest.raises(ValueError, match="`remainder`: 'keep'"):
            tfhybrid.data.shard(rows(21), remainder="keep")


def test_arrays_drop_their_last_rows_with_remainder_drop():
    x = np.arange(21)
    with rank_of_2(1):
        with pytest.raises(ValueError, match="remainder='drop'"):
            tfhybrid.data.shard(x, batch_size=8)
        local = tfhybrid.data.shard(x, batch_size=8, remainder="drop")   # silent on rank 1
    assert local.tolist() == [4, 5, 6, 7, 12, 13, 14, 15, 18, 19]
    with rank_of_2(0), pytest.warns(UserWarning, match="last global batch of 5 rows"):
        local = tfhybrid.data.shard(x, batch_size=8, remainder="drop")
    assert local.tolist() == [0, 1, 2, 3, 8, 9, 10, 11, 16, 17]


def _autotune(ds):
    return ds.options().autotune.enabled


@pytest.mark.parametrize("rank", [0, 1])
def test_shard_turns_tf_data_autotuning_off_unless_asked(rank, tmp_path):
    """Autotuning's model thread delays each iterator's end (every fit, epoch,
    evaluate) by up to one tuning period, so shard's datasets run without it."""
    singles = tf.data.Dataset.from_tensor_slices(np.arange(32))
    files = [str(tmp_path / f"{i}.bin") for i in range(8)]
    with rank_of_2(rank):
        made = [data.shard(singles, batch_size=8),                      # scaling form
                data.shard(files, batch_size=4),                        # file list
                data.shard(rows(32, drop=True)),                        # batched form
                data.shard(singles, batch_size=8, map_fn=lambda r: r * 2, shuffle=16, seed=1)]
        assert [_autotune(d) for d in made] == [False] * 4
        kept = [data.shard(singles, batch_size=8, autotune=True),
                data.shard(rows(32, drop=True), autotune=True)]
        assert [_autotune(d) for d in kept] == [None, None]     # TensorFlow's default: on
        # the rows themselves are unchanged by the option
        assert list(made[0].as_numpy_iterator())[0].tolist() == [4 * rank + i for i in range(4)]
        for bad in ("no", 1, None):
            with pytest.raises(ValueError, match="autotune"):
                data.shard(singles, batch_size=8, autotune=bad)


def test_volumes_turn_tf_data_autotuning_off_unless_asked(tmp_path):
    x = np.arange(4 * 4 * 4 * 4, dtype=np.float32).reshape(4, 4, 4, 4, 1)
    np.save(tmp_path / "x.npy", x)
    off = tfhybrid.data.volumes(str(tmp_path / "x.npy"), batch_size=2)
    on = tfhybrid.data.volumes(str(tmp_path / "x.npy"), batch_size=2, autotune=True)
    assert (_autotune(off), _autotune(on)) == (False, None)
    np.testing.assert_array_equal(next(iter(off)).numpy(), x[:2])
