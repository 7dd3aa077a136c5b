"""tfhybrid.data.shard: each rank's rows of every global batch.

Run under ``horovodrun -np 2`` and ``-np 4`` with model_parallel 1, 2, 4:
the local blocks of all ranks, gathered in rank order, must rebuild each
global batch (split "world"), or every model group must see the same rows and
the data groups together the whole batch (split "data", the default).
"""
import keras
import numpy as np
import pytest
import tensorflow as tf

import tfhybrid

from conftest import all_model_parallel_values

MPS = all_model_parallel_values()
BATCH = 8


def global_batches(n_batches=3, batch=BATCH):
    x = np.arange(n_batches * batch * 3, dtype=np.float32).reshape(-1, 3)
    y = np.arange(n_batches * batch, dtype=np.int32)
    return x, y


def split_model(split):
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model._tfhybrid_batch_split = split
    return model


def expected_rows(batch, blocks, index):
    local = len(batch) // blocks
    return batch[index * local:(index + 1) * local]


@pytest.mark.parametrize("mp", MPS, ids=lambda m: f"mp{m}")
@pytest.mark.parametrize("split", [None, "data", "world"])
def test_dataset_rows(grid_of, mp, split):
    grid = grid_of(mp)
    x, y = global_batches()
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH)
    model = split_model(split) if split else None
    blocks, index = ((grid.size, grid.rank) if split == "world"
                     else (grid.data_size, grid.data_rank))
    got = list(tfhybrid.data.shard(ds, model))
    assert len(got) == 3
    for b, (xb, yb) in enumerate(got):
        np.testing.assert_array_equal(xb.numpy(), expected_rows(x[b * BATCH:(b + 1) * BATCH],
                                                                blocks, index))
        np.testing.assert_array_equal(yb.numpy(), expected_rows(y[b * BATCH:(b + 1) * BATCH],
                                                                blocks, index))


def test_dict_features_and_sample_weights(grid_of):
    grid = grid_of(1)
    x, y = global_batches(1)
    ds = tf.data.Dataset.from_tensor_slices(({"a": x, "b": y}, y, y * 2.0)).batch(BATCH)
    feats, labels, weights = next(iter(tfhybrid.data.shard(ds)))
    np.testing.assert_array_equal(feats["a"].numpy(), expected_rows(x, grid.size, grid.rank))
    np.testing.assert_array_equal(weights.numpy(), expected_rows(y * 2.0, grid.size, grid.rank))
    assert labels.shape[0] == BATCH // grid.size


def test_indivisible_static_batch_raises(grid_of):
    grid = grid_of(1)
    if grid.size == 1:
        pytest.skip("every batch divides one rank")
    ds = tf.data.Dataset.from_tensor_slices(np.zeros((6 * grid.size + 2, 3))).batch(
        6 * grid.size + 1, drop_remainder=True)
    with pytest.raises(ValueError, match=rf"global batch of {6 * grid.size + 1} rows cannot be "
                                         rf"split evenly over {grid.size} data-parallel ranks"):
        tfhybrid.data.shard(ds)


def test_indivisible_dynamic_batch_raises_at_runtime(grid_of):
    grid = grid_of(1)
    if grid.size == 1:
        pytest.skip("every batch divides one rank")
    ds = tf.data.Dataset.from_tensor_slices(np.zeros((grid.size + 1, 3))).batch(grid.size)
    it = iter(tfhybrid.data.shard(ds))
    next(it)
    with pytest.raises(tf.errors.InvalidArgumentError, match="not divisible"):
        next(it)


@pytest.mark.parametrize("mp", MPS, ids=lambda m: f"mp{m}")
def test_numpy_arrays(grid_of, mp):
    grid = grid_of(mp)
    x, y = global_batches(3)
    x, y = x[:-4], y[:-4]                       # last global batch of 4 rows
    if 4 % grid.data_size:
        with pytest.raises(ValueError, match=f"global batch of 4 rows.*over {grid.data_size}"):
            tfhybrid.data.shard((x, y), batch_size=BATCH)
        return
    xl, yl = tfhybrid.data.shard((x, y), batch_size=BATCH)
    want = np.concatenate([expected_rows(y[s:s + BATCH], grid.data_size, grid.data_rank)
                           for s in range(0, len(y), BATCH)])
    np.testing.assert_array_equal(yl, want)
    np.testing.assert_array_equal(xl[:, 0], want * 3)


def test_bad_arguments(grid_of):
    grid = grid_of(1)
    with pytest.raises(TypeError, match="invalid `dataset` of type int"):
        tfhybrid.data.shard(5)
    with pytest.raises(ValueError, match=r"`batch_size`: None; expected the global batch size"):
        tfhybrid.data.shard(np.zeros((8, 2)))
    with pytest.raises(ValueError, match=r"_tfhybrid_batch_split='rows'"):
        tfhybrid.data.shard(tf.data.Dataset.range(4).batch(2), split_model("rows"))
    assert tfhybrid.data.local_batch_size(8 * grid.data_size) == 8
    if grid.size > 1:
        with pytest.raises(ValueError, match=f"global batch of 3 rows.*{grid.data_size}"):
            tfhybrid.data.local_batch_size(3)
