"""Evaluation metrics averaged over ranks: MetricAverageCallback and average_logs."""
import keras
import numpy as np

import tfhybrid
from tfhybrid.comm import backend

from conftest import randn


def test_evaluate_results_are_world_averages(grid_of):
    grid = grid_of(1)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1, kernel_initializer="ones")])
    model.compile(loss="mse")
    x = randn((8, 3), "x", grid.rank)                       # different rows on every rank
    y = np.zeros((8, 1), np.float32)
    local = [float(np.mean(np.sum(randn((8, 3), "x", r), 1) ** 2)) for r in range(grid.size)]
    seen = {}
    probe = keras.callbacks.LambdaCallback(on_test_end=lambda logs: seen.update(logs))
    results = model.evaluate(x, y, batch_size=8, verbose=0, return_dict=True,
                             callbacks=[tfhybrid.callbacks.MetricAverageCallback(), probe])
    np.testing.assert_allclose(results["loss"], local[grid.rank], rtol=1e-5)   # Keras: local
    np.testing.assert_allclose(seen["loss"], np.mean(local), rtol=1e-5)       # later callbacks
    averaged = tfhybrid.callbacks.average_logs(results)
    np.testing.assert_allclose(averaged["loss"], np.mean(local), rtol=1e-5)
    backend.barrier()


def _evaluate_case(grid, strategy):
    """(single-process results, transformed-model results) on the same 36 samples."""
    import pytest
    import tensorflow as tf

    from conftest import rng
    keras.utils.set_random_seed(3)
    inputs = keras.Input((6,))
    hidden = keras.layers.Dense(8, activation="relu", name="fc1")(inputs)
    model = keras.Model(inputs, keras.layers.Dense(4, name="fc2")(hidden))
    x = randn((36, 6), "eval-x")
    y = rng("eval-y").integers(0, 4, 36)
    metrics = lambda: ["accuracy", keras.metrics.SparseTopKCategoricalAccuracy(2, name="top2")]  # noqa: E731
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    model.compile(loss=loss, metrics=metrics())
    # 36 rows in global batches of 8: the last batch has 4 rows, so a mean of
    # per-batch means would weigh it wrong; the metric states do not.
    reference = model.evaluate(x, y, batch_size=8, verbose=0, return_dict=True)
    pmodel = tfhybrid.transform(model, strategy=strategy)
    pmodel.compile(optimizer=tfhybrid.DistributedOptimizer(keras.optimizers.SGD(0.1)),
                   loss=loss, metrics=metrics())
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(8)
    if tfhybrid.data.batch_split(pmodel)[0] > 4:
        pytest.skip("the last batch of 4 rows does not split over more than 4 blocks")
    got = pmodel.evaluate(tfhybrid.data.shard(data, model=pmodel), verbose=0, return_dict=True)
    return reference, got


import pytest  # noqa: E402


@pytest.mark.parametrize("strategy,mp", [("d", 1), ("df", 2), ("gmp", 2), ("f", 4)])
def test_transformed_evaluate_equals_single_process(grid_of, strategy, mp):
    """evaluate of a transformed model: the global metrics, on every rank (Config default)."""
    grid = grid_of(mp)
    reference, got = _evaluate_case(grid, strategy)
    assert set(got) == set(reference)
    for key in reference:
        np.testing.assert_allclose(got[key], reference[key], rtol=1e-5, atol=1e-6, err_msg=key)
    backend.barrier()


def test_average_metrics_false_keeps_per_rank_values():
    tfhybrid.shutdown()
    tfhybrid.init(model_parallel=1, config=tfhybrid.Config(average_metrics=False))
    try:
        reference, got = _evaluate_case(tfhybrid.grid(), "d")
        losses = backend.allgather(np.array([got["loss"]], np.float64), tuple(
            range(tfhybrid.grid().size)), "test.losses").numpy()
        assert np.ptp(losses) > 1e-3        # each rank's own rows
        assert abs(got["loss"] - reference["loss"]) > 1e-4
        backend.barrier()
    finally:
        tfhybrid.shutdown()


def test_fit_validation_metrics_are_global(grid_of):
    """fit's validation runs the transformed model's evaluate: global metrics in the history."""
    import tensorflow as tf

    from conftest import rng
    grid_of(1)
    keras.utils.set_random_seed(4)
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(3, name="fc")])
    x, y = randn((32, 5), "val-x"), rng("val-y").integers(0, 3, 32)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    model.compile(loss=loss, metrics=["accuracy"])
    reference = model.evaluate(x, y, batch_size=8, verbose=0, return_dict=True)
    pmodel = tfhybrid.transform(model, strategy="d")
    pmodel.compile(optimizer=tfhybrid.DistributedOptimizer(keras.optimizers.SGD(0.0)),
                   loss=loss, metrics=["accuracy"])
    data = tfhybrid.data.shard(tf.data.Dataset.from_tensor_slices((x, y)).batch(8), model=pmodel)
    history = pmodel.fit(data, validation_data=data, epochs=1, verbose=0, shuffle=False,
                         callbacks=tfhybrid.callbacks.standard())
    np.testing.assert_allclose(history.history["val_loss"][-1], reference["loss"], rtol=1e-5)
    np.testing.assert_allclose(history.history["val_accuracy"][-1], reference["accuracy"],
                               rtol=1e-6)
    backend.barrier()


def test_fit_epoch_logs_are_the_global_batches(grid_of):
    """Without tfhybrid.callbacks.standard(): every rank's epoch logs (History,
    EarlyStopping, ReduceLROnPlateau read them) equal single-process fit's on
    the global batches (before: each rank logged its own rows, so a callback
    monitoring "loss" could stop one rank and not the others)."""
    import tensorflow as tf

    from conftest import rng, world_size

    def build():
        keras.utils.set_random_seed(5)
        inputs = keras.Input((6,))
        hidden = keras.layers.Dense(8, activation="relu", name="fc1")(inputs)
        return keras.Model(inputs, keras.layers.Dense(4, name="fc2")(hidden))

    x, y = randn((32, 6), "epoch-logs-x"), rng("epoch-logs-y").integers(0, 4, 32)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    reference = build()
    reference.compile(optimizer=keras.optimizers.SGD(0.1), loss=loss, metrics=["accuracy"])
    expected = reference.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0).history
    for strategy, mp in (("d", 1), ("f", world_size())):
        grid_of(mp)
        model = tfhybrid.transform(build(), strategy)
        model.compile(optimizer=tfhybrid.DistributedOptimizer(keras.optimizers.SGD(0.1)),
                      loss=loss, metrics=["accuracy"])
        data = tfhybrid.data.shard(tf.data.Dataset.from_tensor_slices((x, y)).batch(8),
                                   model=model)
        got = model.fit(data, epochs=2, verbose=0).history
        for key in ("loss", "accuracy"):
            np.testing.assert_allclose(got[key], expected[key], rtol=1e-5, atol=1e-6,
                                       err_msg=f"{strategy} {key}")
        gathered = backend.allgather(tf.constant([got["loss"]], tf.float64),
                                     tuple(range(backend.size())), f"logs.{strategy}").numpy()
        assert (gathered == gathered[0]).all(), gathered


def test_progress_bars_on_rank_0_only_unless_verbose_is_given(grid_of, capsys):
    """With Keras' default verbose ("auto") only rank 0 prints a progress bar
    (one per rank would interleave, each repeating rank 0's global logs); the
    other ranks are quiet. An explicit verbose is the script's choice on every
    rank."""
    grid = grid_of(1)
    keras.utils.set_random_seed(1)
    model = tfhybrid.transform(keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)]), "d")
    model.compile(optimizer=tfhybrid.DistributedOptimizer(keras.optimizers.SGD(0.1)), loss="mse")
    x, y = randn((8, 3), "bar-x", grid.rank), randn((8, 2), "bar-y", grid.rank)
    capsys.readouterr()
    model.fit(x, y, batch_size=4, epochs=2)
    model.evaluate(x, y, batch_size=4)
    model.predict(x, batch_size=4)
    default = capsys.readouterr().out
    shown = default.count("Epoch 1/2") == 1 and default.count("step") >= 4
    assert (shown, default == "") == (grid.rank == 0, grid.rank != 0), default
    model.fit(x, y, batch_size=4, epochs=2, verbose=2)
    assert "Epoch 1/2" in capsys.readouterr().out          # every rank: the script asked
    backend.barrier()


def test_csv_logger_and_tensorboard_write_on_rank_0_only(grid_of):
    """Every rank wrote them: one CSV file opened by every process, one
    TensorBoard event file per rank in one run directory (each epoch plotted
    once per rank)."""
    import os

    from conftest import job_dir
    grid = grid_of(1)
    keras.utils.set_random_seed(1)
    model = tfhybrid.transform(keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)]), "d")
    model.compile(optimizer=tfhybrid.DistributedOptimizer(keras.optimizers.SGD(0.1)), loss="mse")
    x, y = randn((8, 3), "log-x", grid.rank), randn((8, 2), "log-y", grid.rank)
    csv = os.path.join(job_dir(), "log.csv")
    board = os.path.join(job_dir(), "board")
    model.fit(x, y, batch_size=4, epochs=3, verbose=0,
              callbacks=[keras.callbacks.CSVLogger(csv), keras.callbacks.TensorBoard(board)])
    backend.barrier()
    with open(csv, encoding="utf-8") as fh:
        assert len(fh.read().strip().splitlines()) == 1 + 3
    assert len(os.listdir(os.path.join(board, "train"))) == 1
    backend.barrier()


def test_a_stop_set_on_one_rank_at_epoch_end_stops_every_rank(grid_of):
    """A callback deciding on this rank's own state (a wall-clock budget read
    from each rank's clock) stopped the last rank only: the others waited in
    the next epoch's collectives until the watchdog ended the job."""
    import warnings

    grid = grid_of(1)
    keras.utils.set_random_seed(1)
    model = tfhybrid.transform(keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)]), "d")
    model.compile(optimizer=tfhybrid.DistributedOptimizer(keras.optimizers.SGD(0.1)), loss="mse")
    x, y = randn((8, 3), "stop-x", grid.rank), randn((8, 2), "stop-y", grid.rank)

    class OwnClock(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            if grid.rank == grid.size - 1 and epoch == 1:
                self.model.stop_training = True

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        history = model.fit(x, y, batch_size=4, epochs=5, verbose=0, callbacks=[OwnClock()])
    assert history.epoch == [0, 1]
    warned = any("set model.stop_training at the end of epoch 2" in str(w.message)
                 for w in caught)
    assert warned == (grid.rank == 0)
    backend.barrier()
