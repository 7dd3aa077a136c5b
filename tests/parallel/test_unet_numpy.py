"""A segmentation model under s/ds fed the way Keras users feed one: numpy
arrays of whole volumes, per-voxel labels and weights, no tfhybrid.data.

``fit(x, y, sample_weight=w)``, ``evaluate(x, y)`` and ``predict(x)`` of the
transformed model equal the unmodified model's in one process: the model's
input scatter splits x, its train/test steps cut whole-volume labels and
weights to the rank's block (before: Keras' "Arguments `target` and `output`
must have the same shape"), and ``predict`` puts the output blocks together
into whole volumes (before: each rank got its block).
"""
import keras
import numpy as np
import pytest

import tfhybrid
from tfhybrid import transform

from conftest import randn, reference_once, rng, world_size
from unet_models import unet3d

BATCH = 2


def cases():
    """-np 2: s over both ranks; -np 4: ds (2 data x 2 spatial; s is -np 2's path)."""
    return [("ds", 2)] if world_size() >= 4 else [("s", world_size())]


@pytest.mark.parametrize("strategy,mp", cases(), ids=[c[0] for c in cases()])
def test_numpy_fit_evaluate_predict_equal_single_process(grid_of, strategy, mp):
    x = randn((4, 8, 8, 8, 1), "unet-numpy", "x")
    y = rng("unet-numpy", "y").integers(0, 3, (4, 8, 8, 8))
    w = rng("unet-numpy", "w").random((4, 8, 8, 8)).astype(np.float32)
    loss = keras.losses.SparseCategoricalCrossentropy()

    def build():
        keras.utils.set_random_seed(0)
        return unet3d((8, 8, 8, 1), classes=3, filters=2, depth=2)

    def compute():
        ref = build()
        ref.compile(keras.optimizers.SGD(0.1), loss, metrics=["accuracy"], jit_compile=False)
        want_history = ref.fit(x, y, sample_weight=w, batch_size=BATCH, epochs=2, shuffle=False,
                               verbose=0).history
        want_eval = ref.evaluate(x, y, batch_size=BATCH, verbose=0)
        want_pred = ref.predict(x, batch_size=BATCH, verbose=0)
        return want_history, want_eval, want_pred, ref.get_weights()

    grid = grid_of(mp)
    want_history, want_eval, want_pred, expected = reference_once(compute, x, y, w, BATCH)
    model = transform(build(), strategy)
    model.compile(tfhybrid.DistributedOptimizer(keras.optimizers.SGD(0.1)), loss,
                  metrics=["accuracy"], jit_compile=False)
    # every rank of a data group feeds the same rows; data group g takes its
    # part of each global batch (rows k*BATCH + g*local ... of step k)
    local = BATCH // grid.data_size
    rows = np.concatenate([np.arange(k * BATCH + grid.data_rank * local,
                                     k * BATCH + (grid.data_rank + 1) * local)
                           for k in range(len(x) // BATCH)])
    history = model.fit(x[rows], y[rows], sample_weight=w[rows], batch_size=local, epochs=2,
                        shuffle=False, verbose=0).history
    got_eval = model.evaluate(x[rows], y[rows], batch_size=local, verbose=0)
    got_pred = model.predict(x[rows], batch_size=local, verbose=0)
    for i, (a, e) in enumerate(zip(tfhybrid.gather(model).get_weights(), expected)):
        np.testing.assert_allclose(a, e, rtol=1e-4, atol=1e-6, err_msg=f"weight {i}")
    np.testing.assert_allclose(history["loss"], want_history["loss"], rtol=1e-4)
    np.testing.assert_allclose(got_eval, want_eval, rtol=1e-4, atol=1e-7)
    assert got_pred.shape == want_pred[rows].shape
    np.testing.assert_allclose(got_pred, want_pred[rows], rtol=1e-4, atol=1e-6)
