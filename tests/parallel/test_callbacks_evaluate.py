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
