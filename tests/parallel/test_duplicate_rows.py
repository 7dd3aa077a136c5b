"""Every rank fed the very same rows (whole arrays, or one unsharded dataset).

The commonest Horovod-style script evaluates ``model.evaluate(x_test,
y_test)`` on every rank. Keras' mean loss and accuracy come out right
either way, but summing every metric's states over the data-parallel ranks
would multiply counts (``TruePositives``) by the ranks, and a
``reduction="sum"`` loss too, in ``fit`` as well (gradients 2x those of one
process at np2). Whole arrays are found before the first step
(a fingerprint in the start-of-fit / evaluate allgather) and each row counts
once; an unsharded dataset is found at its first batches (evaluate: counts
exact; a ``sum`` loss is refused, its first steps having counted rows twice).
Each case: the numbers of one process training the unmodified model.
"""
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfhybrid
from tfhybrid import runtime
from tfhybrid.guards import ConsistencyError

from conftest import compiled_transform, reference_once, rng, world_size

N, BATCH = 48, 16
CASES = [("d", 1), ("f", world_size()), ("df", 2)]


def _data(key="train"):
    x = rng("dup-x", key).standard_normal((N, 6)).astype(np.float32)
    y = (x[:, 0] + 0.3 * x[:, 1] > 0).astype(np.float32)[:, None]
    return x, y


def _model(reduction="sum"):
    keras.utils.set_random_seed(7)
    model = keras.Sequential([keras.Input((6,)),
                              keras.layers.Dense(8, activation="relu", name="fc0"),
                              keras.layers.Dense(1, activation="sigmoid", name="fc1")])
    return model, dict(optimizer=keras.optimizers.SGD(0.05),
                       loss=keras.losses.BinaryCrossentropy(reduction=reduction),
                       metrics=[keras.metrics.TruePositives(name="tp"), "accuracy"])


def _transformed(grid_of, strategy, mp, reduction="sum"):
    """``_model(reduction)`` transformed under ``strategy`` and compiled with
    its optimizer in a DistributedOptimizer (the reference: :func:`_reference`)."""
    grid_of(mp)
    return compiled_transform(_model, strategy, reduction)


def _reference(reduction="sum", epochs=2, validation=False):
    """The unmodified model in one process on the whole data (rank 0, once per
    run: conftest.reference_once): (evaluate's dict before fit, fit's History
    dict, with ``_data("validation")`` as validation_data if ``validation``,
    evaluate's dict after fit, the weights after fit)."""
    def compute():
        reference, kwargs = _model(reduction)
        reference.compile(**kwargs)
        x, y = _data()
        before = reference.evaluate(x, y, batch_size=BATCH, verbose=0, return_dict=True)
        fit = {"validation_data": _data("validation")} if validation else {}
        history = reference.fit(x, y, batch_size=BATCH, epochs=epochs, shuffle=False,
                                verbose=0, **fit).history
        after = reference.evaluate(x, y, batch_size=BATCH, verbose=0, return_dict=True)
        return before, history, after, reference.get_weights()
    return reference_once(compute, reduction, epochs, validation, N, BATCH)


def _same(got, want):
    for key, value in want.items():
        np.testing.assert_allclose(got[key], value, rtol=2e-5, atol=1e-5, err_msg=key)


@pytest.mark.parametrize("strategy,mp", CASES, ids=lambda c: str(c))
def test_whole_arrays_on_every_rank_count_each_row_once(grid_of, strategy, mp):
    model = _transformed(grid_of, strategy, mp)
    x, y = _data()
    xv, yv = _data("validation")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = model.evaluate(x, y, batch_size=BATCH, verbose=0, return_dict=True)
        history = model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0,
                            validation_data=(xv, yv))
    want, expected, _, weights = _reference("sum", validation=True)
    _same(got, want)
    assert want["tp"] > 0
    _same(history.history, expected)
    for a, b in zip(tfhybrid.gather(model).get_weights(), weights):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    if runtime.current_grid().data_size > 1 or strategy == "d":
        warned = any("fed identical rows" in str(w.message) for w in caught)
        assert warned == (tfhybrid.rank() == 0)


@pytest.mark.parametrize("validation", ["arrays", "dataset"])
@pytest.mark.parametrize("strategy,mp", CASES[:1] + CASES[2:], ids=lambda c: str(c))
def test_sharded_training_with_whole_validation_data(grid_of, strategy, mp, validation):
    """Validation on every rank's whole arrays or one unsharded dataset (fit's
    own evaluate: its CallbackList, so fit lists the EvaluateRows callback)."""
    reduction = "sum" if validation == "arrays" else "sum_over_batch_size"
    model = _transformed(grid_of, strategy, mp, reduction)
    x, y = _data()
    xv, yv = _data("validation")
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH)
    val = ((xv, yv) if validation == "arrays"
           else tf.data.Dataset.from_tensor_slices((xv, yv)).batch(BATCH))
    history = model.fit(tfhybrid.data.shard(ds, model=model), epochs=2, verbose=0,
                        validation_data=val, validation_batch_size=BATCH
                        if validation == "arrays" else None)
    _, expected, want, _ = _reference(reduction, validation=True)
    _same(history.history, expected)
    # and a sharded evaluate after it counts each rank's rows (copies back to 1)
    got = model.evaluate(tfhybrid.data.shard(ds, model=model), verbose=0, return_dict=True)
    _same(got, want)


@pytest.mark.parametrize("strategy,mp", CASES[:1] + CASES[2:], ids=lambda c: str(c))
def test_unsharded_dataset_in_evaluate_counts_each_row_once(grid_of, strategy, mp):
    model = _transformed(grid_of, strategy, mp, reduction="sum_over_batch_size")
    x, y = _data()
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH)
    got = model.evaluate(ds, verbose=0, return_dict=True)
    want, expected, _, _ = _reference("sum_over_batch_size")
    _same(got, want)
    history = model.fit(ds, epochs=2, verbose=0)      # mean loss: exact, counts once
    _same(history.history, expected)


def test_unsharded_dataset_with_sum_loss_is_refused(grid_of):
    model = _transformed(grid_of, "d", 1)
    x, y = _data()
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH)
    with pytest.raises(ConsistencyError, match=r"identical rows in evaluate.*reduction='sum'"
                                               r".*tfhybrid.data.shard"):
        model.evaluate(ds, verbose=0)
    with pytest.raises(ConsistencyError, match=r"identical rows at step 2 of fit.*"
                                               r"reduction='sum'"):
        model.fit(ds, epochs=1, verbose=0)


def test_callback_evaluate_inside_fit_keeps_fits_copies(grid_of):
    """A callback evaluating sharded data at each epoch's end, inside a fit on
    whole arrays: the evaluate set the copies back to 1, so the fit's next
    steps counted each row twice (reduction='sum')."""
    model = _transformed(grid_of, "d", 1)
    x, y = _data()
    xv, yv = _data("validation")
    grid = runtime.current_grid()
    shard = (xv[grid.rank::grid.size], yv[grid.rank::grid.size])

    class EvaluateEachEpoch(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            self.model.evaluate(*shard, batch_size=4, verbose=0)

    history = model.fit(x, y, batch_size=BATCH, epochs=3, shuffle=False, verbose=0,
                        callbacks=[EvaluateEachEpoch()])
    _, expected, _, _ = _reference("sum", epochs=3)
    _same(history.history, expected)
