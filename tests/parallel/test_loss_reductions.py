"""Losses that are not a mean over the batch, and the per-batch APIs' logs.

The optimizer averages gradients over the ranks holding different rows, right
for Keras' default ``sum_over_batch_size``. A ``reduction="sum"`` loss was
half the single-process gradient at 2 data-parallel ranks (and half the
logged loss), silently; ``mean_with_sample_weight`` divided by each rank's
own weight sum. ``train_on_batch``/``test_on_batch`` returned each rank's own
rows' logs. Each case: the transformed model on this rank's rows vs one
process on the whole batch (SGD, so a gradient off by a factor shows in the
weights), History and weights.
"""
import keras
import numpy as np
import pytest

import tfhybrid
from tfhybrid.comm import backend

from conftest import reference_once, world_size

N, FEATURES, CLASSES, BATCH = 64, 8, 4, 16
CASES = [("d", 1), ("df", 2)] if world_size() > 2 else [("d", 1)]


def _data():
    rng = np.random.RandomState(7)
    x = rng.randn(N, FEATURES).astype(np.float32)
    y = rng.randint(0, CLASSES, N)
    w = (0.25 + 2 * rng.rand(N)).astype(np.float32)
    return x, y, w


def _model():
    keras.utils.set_random_seed(2)
    return keras.Sequential([
        keras.Input((FEATURES,)),
        keras.layers.Dense(8, activation="relu", name="fc0",
                           kernel_regularizer=keras.regularizers.L2(0.01)),
        keras.layers.Dense(CLASSES, name="fc1")])


def _compile(model, reduction, distributed):
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=reduction)
    opt = keras.optimizers.SGD(0.05)
    model.compile(optimizer=tfhybrid.DistributedOptimizer(opt) if distributed else opt,
                  loss=loss, metrics=["accuracy"])
    return model


def _rows(grid, strategy):
    """This rank's rows of every global batch (d splits over every rank)."""
    return (grid.size, grid.rank) if strategy == "d" else (grid.data_size, grid.data_rank)


@pytest.mark.parametrize("strategy,mp", CASES, ids=lambda c: str(c))
@pytest.mark.parametrize("reduction", ["sum", "mean_with_sample_weight"])
def test_fit_with_sum_and_weighted_mean_losses_equals_one_process(grid_of, strategy, mp,
                                                                  reduction):
    grid = grid_of(mp)
    x, y, w = _data()

    def compute():
        ref = _compile(_model(), reduction, False)
        h_ref = ref.fit(x, y, sample_weight=w, batch_size=BATCH, epochs=2, shuffle=False,
                        verbose=0)
        return h_ref.history, ref.get_weights(), ref.evaluate(
            x, y, sample_weight=w, batch_size=BATCH, verbose=0, return_dict=True)
    history, weights, want = reference_once(compute, reduction, N, BATCH)
    blocks, index = _rows(grid, strategy)
    pmodel = _compile(tfhybrid.transform(_model(), strategy=strategy), reduction, True)
    h = pmodel.fit(x[index::blocks], y[index::blocks], sample_weight=w[index::blocks],
                   batch_size=BATCH // blocks, epochs=2, shuffle=False, verbose=0)
    for key in ("loss", "accuracy"):
        np.testing.assert_allclose(h.history[key], history[key], rtol=1e-5, err_msg=key)
    for a, b in zip(tfhybrid.gather(pmodel).get_weights(), weights):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    got = pmodel.evaluate(x[index::blocks], y[index::blocks], sample_weight=w[index::blocks],
                          batch_size=BATCH // blocks, verbose=0, return_dict=True)
    for key in want:
        np.testing.assert_allclose(got[key], want[key], rtol=1e-5, err_msg=key)
    backend.barrier()


@pytest.mark.parametrize("strategy,mp", CASES, ids=lambda c: str(c))
def test_train_and_test_on_batch_return_the_global_batch_logs(grid_of, strategy, mp):
    grid = grid_of(mp)
    x, y, _ = _data()
    ref = _compile(_model(), "sum_over_batch_size", False)
    blocks, index = _rows(grid, strategy)
    pmodel = _compile(tfhybrid.transform(_model(), strategy=strategy), "sum_over_batch_size",
                      True)
    for start in range(0, N, BATCH):
        xb, yb = x[start:start + BATCH], y[start:start + BATCH]
        want = ref.train_on_batch(xb, yb, return_dict=True)
        got = pmodel.train_on_batch(xb[index::blocks], yb[index::blocks], return_dict=True)
        assert set(got) == set(want)
        for key in want:
            np.testing.assert_allclose(got[key], want[key], rtol=1e-5, err_msg=key)
    flat = pmodel.test_on_batch(x[index::blocks], y[index::blocks])
    np.testing.assert_allclose(flat, ref.test_on_batch(x, y), rtol=1e-5)
    for a, b in zip(tfhybrid.gather(pmodel).get_weights(), ref.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    backend.barrier()


@pytest.mark.parametrize("strategy,mp", [("f", "N"), ("c", "N")] + (
    [("df", 2)] if world_size() > 2 else []), ids=lambda c: str(c))
def test_logged_loss_holds_every_block_of_regularised_split_weights(grid_of, strategy, mp):
    """Each rank's loss held only its own block's L2 penalty: History and
    evaluate were below one process's (the gradients were right)."""
    grid = grid_of(world_size() if mp == "N" else mp)
    x, y, _ = _data()

    def compute():
        ref = _compile(_model(), "sum_over_batch_size", False)
        h_ref = ref.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
        return (h_ref.history["loss"], ref.evaluate(x, y, verbose=0, return_dict=True)["loss"],
                ref.get_weights())
    want_loss, want_eval, weights = reference_once(compute, N, BATCH)
    blocks, index = _rows(grid, strategy)
    pmodel = _compile(tfhybrid.transform(_model(), strategy=strategy), "sum_over_batch_size",
                      True)
    h = pmodel.fit(x[index::blocks], y[index::blocks], batch_size=BATCH // blocks, epochs=2,
                   shuffle=False, verbose=0)
    np.testing.assert_allclose(h.history["loss"], want_loss, rtol=1e-5)
    got = pmodel.evaluate(x[index::blocks], y[index::blocks], verbose=0, return_dict=True)
    np.testing.assert_allclose(got["loss"], want_eval, rtol=1e-5)
    for a, b in zip(tfhybrid.gather(pmodel).get_weights(), weights):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    backend.barrier()


def _conv_model():
    keras.utils.set_random_seed(4)
    l2 = keras.regularizers.L2(0.05)
    inp = keras.Input((12, 12, 3))
    h = keras.layers.Conv2D(8, 3, padding="same", activation="relu", kernel_regularizer=l2,
                            name="conv0")(inp)
    h = keras.layers.MaxPooling2D(2, name="pool0")(h)
    h = keras.layers.Conv2D(8, 3, padding="same", activation="relu", kernel_regularizer=l2,
                            bias_regularizer=l2, name="conv1")(h)
    h = keras.layers.Flatten(name="flat")(h)
    return keras.Model(inp, keras.layers.Dense(2, kernel_regularizer=l2, name="head")(h))


@pytest.mark.parametrize("strategy,mp", [("s", "N")] + (
    [("ds", 2)] if world_size() > 2 else []), ids=lambda c: str(c))
def test_regularised_spatial_weights_enter_once(grid_of, strategy, mp):
    """s/ds with a gathered output: each rank of a model group added the whole
    penalty of the spatial kernels, whose gradients the optimizer sums over
    the group (K times the penalty's gradient: 8e-3 off after 8 steps)."""
    grid = grid_of(world_size() if mp == "N" else mp)
    rng = np.random.RandomState(0)
    x = rng.randn(32, 12, 12, 3).astype(np.float32)
    y = rng.randn(32, 2).astype(np.float32)

    def compute():
        ref = _conv_model()
        ref.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
        h_ref = ref.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
        return h_ref.history["loss"], ref.get_weights()
    want_loss, weights = reference_once(compute, x, y)
    blocks, index = grid.data_size, grid.data_rank
    pmodel = tfhybrid.transform(_conv_model(), strategy=strategy)
    pmodel.compile(optimizer=tfhybrid.DistributedOptimizer(keras.optimizers.SGD(0.01)),
                   loss="mse")
    h = pmodel.fit(x[index::blocks], y[index::blocks], batch_size=8 // blocks, epochs=2,
                   shuffle=False, verbose=0)
    np.testing.assert_allclose(h.history["loss"], want_loss, rtol=1e-5)
    for a, b in zip(tfhybrid.gather(pmodel).get_weights(), weights):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
    backend.barrier()


def _staged_model(regularized):
    keras.utils.set_random_seed(5)
    l2 = keras.regularizers.L2(0.05) if regularized else None
    inp = keras.Input((10, 10, 3))
    h = keras.layers.Conv2D(8, 3, padding="same", activation="relu", kernel_regularizer=l2,
                            name="c0")(inp)
    h = keras.layers.MaxPooling2D(2, name="p0")(h)
    h = keras.layers.Conv2D(8, 3, padding="same", activation="relu", name="c1")(h)
    h = keras.layers.Flatten(name="fl")(h)
    h = keras.layers.Dense(16, activation="relu", name="fc0")(h)
    h = keras.layers.Dense(16, activation="relu", kernel_regularizer=l2, name="fc1")(h)
    return keras.Model(inp, keras.layers.Dense(4, activation="softmax", name="out")(h))


STAGED = [("p", 2), ("ls", 1)] + ([("p", 4), ("ls", 1, 2)] if world_size() > 2 else [])


@pytest.mark.parametrize("case", STAGED, ids=lambda c: "-".join(map(str, c)))
@pytest.mark.parametrize("reduction,regularized", [("sum_over_batch_size", True),
                                                   ("sum", True), ("sum", False)])
def test_pipeline_and_layer_separation_losses_equal_one_process(grid_of, case, reduction,
                                                                regularized):
    """p logged the penalties of the weights after the update; ls missed the CONV
    part's penalty gradient (weights 10 % off with L2 0.05) and each role logged
    its own part's penalties only."""
    strategy, mp = case[0], case[1]
    grid_of(mp)
    rng = np.random.RandomState(1)
    x = rng.randn(48, 10, 10, 3).astype(np.float32)
    y = rng.randint(0, 4, 48)
    lr = 0.002 if reduction == "sum" else 0.05

    def compiled(model, distributed):
        opt = keras.optimizers.SGD(lr)
        model.compile(optimizer=tfhybrid.DistributedOptimizer(opt) if distributed else opt,
                      loss=keras.losses.SparseCategoricalCrossentropy(reduction=reduction),
                      metrics=["accuracy"])
        return model


    def compute():
        ref = compiled(_staged_model(regularized), False)
        h_ref = ref.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
        return (h_ref.history["loss"], ref.evaluate(x, y, batch_size=8, verbose=0)[0],
                ref.get_weights())
    want_loss, want_eval, weights = reference_once(compute, reduction, regularized, lr, x, y)
    kwargs = {"fc_workers": case[2]} if len(case) > 2 else {}
    pmodel = compiled(tfhybrid.transform(_staged_model(regularized), strategy=strategy,
                                         **kwargs), True)
    local = tfhybrid.data.local_batch_size(8, pmodel)
    xl, yl = tfhybrid.data.shard((x, y), model=pmodel, batch_size=8)
    h = pmodel.fit(xl, yl, batch_size=local, epochs=2, shuffle=False, verbose=0)
    np.testing.assert_allclose(h.history["loss"], want_loss, rtol=1e-5)
    got = pmodel.evaluate(xl, yl, batch_size=local, verbose=0, return_dict=True)
    np.testing.assert_allclose(got["loss"], want_eval, rtol=1e-5)
    for a, b in zip(tfhybrid.gather(pmodel).get_weights(), weights):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
    backend.barrier()
