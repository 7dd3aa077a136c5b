"""Blocks of a global batch that hold unequal rows.

Horovod's way of feeding arrays, ``fit(x[rank::size], ...)`` with the per-rank
batch size (what the guards' own duplicate-rows warning recommends), gives
the ranks arrays of unequal length when the rows do not divide by the ranks:
61 rows over 2 ranks end in a last batch of 7 rows on rank 0 and 6 on rank 1.
Averaging the two block means as if they were equal would make the weights
differ from one process silently, while the logged loss is right; a per-rank
dataset (``dataset.shard(size, rank).batch(b)``) does the same. The guards
find such inputs at the start of ``fit`` and the step weighs each block by its
rows (one scalar allreduce per step, only then); inputs known to give equal
blocks (equal arrays, ``data.shard``, a static batch size) keep the plain
step. A ``validation_split`` that cuts each rank's arrays off one process's
cut warns on rank 0. Each case: the numbers of one process on the whole data.
"""
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfhybrid
from tfhybrid import guards, runtime

from conftest import compiled_transform, reference_once, rng, world_size

N, BATCH = 61, 16
CASES = [("d", 1), ("df", 2)]


def _data(n=N):
    x = rng("uneven-x", str(n)).standard_normal((n, 6)).astype(np.float32)
    y = (x[:, 0] + 0.5 * x[:, 1] > 0).astype(np.int32) + (x[:, 2] > 0.5).astype(np.int32)
    w = rng("uneven-w", str(n)).uniform(0.2, 2.0, n).astype(np.float32)
    return x, y, w


def _model(reduction):
    keras.utils.set_random_seed(11)
    model = keras.Sequential([keras.Input((6,)),
                              keras.layers.Dense(8, activation="relu", name="fc0"),
                              keras.layers.Dense(3, activation="softmax", name="fc1")])
    return model, dict(optimizer=keras.optimizers.SGD(0.1),
                       loss=keras.losses.SparseCategoricalCrossentropy(reduction=reduction),
                       metrics=["accuracy"])


def _transformed(grid_of, strategy, mp, reduction="sum_over_batch_size"):
    """``_model(reduction)`` transformed under ``strategy`` and compiled with
    its optimizer in a DistributedOptimizer (the reference: :func:`_reference`)."""
    if mp >= world_size():
        pytest.skip("needs more than one data-parallel rank")
    grid_of(mp)
    return compiled_transform(_model, strategy, reduction)


def _reference(reduction, x, y, sample_weight=None, epochs=2, **fit):
    """(fit's History dict, weights, evaluate's dict) of the unmodified model
    trained on the whole data in one process (rank 0, once per run:
    conftest.reference_once)."""
    def compute():
        reference, kwargs = _model(reduction)
        reference.compile(**kwargs)
        history = reference.fit(x, y, sample_weight=sample_weight, batch_size=BATCH,
                                epochs=epochs, shuffle=False, verbose=0, **fit).history
        return history, reference.get_weights(), reference.evaluate(
            x, y, batch_size=BATCH, verbose=0, return_dict=True)
    return reference_once(compute, reduction, x, y, sample_weight, epochs, fit, BATCH)


def _mine(*arrays):
    """This rank's rows, Horovod's way: every D-th row from its data rank."""
    grid = runtime.current_grid()
    return [a[grid.data_rank::grid.data_size] for a in arrays]


def _local_batch():
    return BATCH // runtime.current_grid().data_size


def _same_training(model, history, expected):
    """``expected``: :func:`_reference`'s (History dict, weights, ...)."""
    for key, value in expected[0].items():
        np.testing.assert_allclose(history.history[key], value, rtol=2e-5, atol=1e-6,
                                   err_msg=key)
    for a, b in zip(tfhybrid.gather(model).get_weights(), expected[1]):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


class _Flag(keras.callbacks.Callback):
    """Records the model's row-weighting flag during fit."""

    def __init__(self):
        super().__init__()
        self.seen = set()

    def on_train_batch_end(self, batch, logs=None):
        self.seen.add(guards.row_weighting(self.model))


@pytest.mark.parametrize("reduction", ["sum_over_batch_size", "sum", "weights"])
@pytest.mark.parametrize("strategy,mp", CASES, ids=lambda c: str(c))
def test_per_rank_arrays_of_unequal_length_train_like_one_process(grid_of, strategy, mp,
                                                                  reduction):
    weights = reduction == "weights"
    model = _transformed(grid_of, strategy, mp, "sum_over_batch_size" if weights else reduction)
    x, y, w = _data()
    xs, ys, ws = _mine(x, y, w)
    flag = _Flag()
    history = model.fit(xs, ys, sample_weight=ws if weights else None,
                        batch_size=_local_batch(), epochs=2, shuffle=False, verbose=0,
                        callbacks=[flag])
    expected = _reference("sum_over_batch_size" if weights else reduction, x, y,
                          w if weights else None)
    _same_training(model, history, expected)
    assert flag.seen == {True}
    assert not guards.row_weighting(model)            # this fit's inputs only
    got = model.evaluate(xs, ys, batch_size=_local_batch(), verbose=0, return_dict=True)
    want = expected[2]
    for key, value in want.items():
        np.testing.assert_allclose(got[key], value, rtol=2e-5, err_msg=key)


def test_a_per_rank_dataset_with_unequal_last_batches_trains_like_one_process(grid_of):
    model = _transformed(grid_of, "d", 1)
    x, y, _ = _data()
    grid = runtime.current_grid()
    local = tf.data.Dataset.from_tensor_slices((x, y)).shard(grid.size, grid.rank)
    history = model.fit(local.batch(_local_batch()), epochs=2, verbose=0)
    expected = _reference("sum_over_batch_size", x, y)
    _same_training(model, history, expected)


@pytest.mark.parametrize("form", ["arrays", "scaling", "batched"])
def test_inputs_of_equal_blocks_keep_the_plain_step(grid_of, form):
    model = _transformed(grid_of, "d", 1)
    x, y, _ = _data(64)
    if form == "arrays":
        data, kwargs = tuple(_mine(x, y)), dict(batch_size=_local_batch(), shuffle=False)
    elif form == "scaling":
        rows = tf.data.Dataset.from_tensor_slices((x, y))
        data, kwargs = (tfhybrid.data.shard(rows, model=model, batch_size=BATCH),), {}
    else:        # the batched form, cached and prefetched after shard
        batches = tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH)
        data = (tfhybrid.data.shard(batches, model=model).cache().prefetch(2),)
        kwargs = {}
    flag = _Flag()
    history = model.fit(*data, epochs=2, verbose=0, callbacks=[flag], **kwargs)
    assert flag.seen == {False}
    expected = _reference("sum_over_batch_size", x, y)
    _same_training(model, history, expected)


@pytest.mark.parametrize("split,warns", [(0.25, False), (0.2, True)])
def test_a_validation_split_off_one_process_cut_warns(grid_of, split, warns):
    model = _transformed(grid_of, "d", 1)
    x, y, _ = _data(64)
    xs, ys = _mine(x, y)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        history = model.fit(xs, ys, batch_size=_local_batch(), epochs=1, shuffle=False,
                            verbose=0, validation_split=split)
    said = [str(w.message) for w in caught if "validation_split" in str(w.message)]
    assert len(said) == (1 if warns and tfhybrid.is_root() else 0), said
    if warns and said:
        assert "validation_data=" in said[0]
    if not warns:        # a cut on a global batch boundary: one process's rows
        expected = _reference("sum_over_batch_size", x, y, epochs=1, validation_split=split)
        _same_training(model, history, expected)


def test_per_rank_validation_arrays_of_unequal_length_validate_like_one_process(grid_of):
    # even training rows, uneven validation rows: a sum loss's val_loss counts each row once
    model = _transformed(grid_of, "d", 1, "sum")
    x, y, _ = _data(64)
    xv, yv, _ = _data(61)
    history = model.fit(*_mine(x, y), batch_size=_local_batch(), epochs=2, shuffle=False,
                        verbose=0, validation_data=tuple(_mine(xv, yv)))
    expected = _reference("sum", x, y, validation_data=(xv, yv))
    _same_training(model, history, expected)
