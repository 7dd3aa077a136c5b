"""SplitBrain training under horovodrun equals single-process training.

conv data-parallel over all ranks -> ModuloLayer ("BK" or "B/K") ->
filter/channel-parallel Dense, a plain Dense, ShardLayer -> inverse -> loss,
against the same Keras model trained on the global batch in one process:
each rank computes the gradient of its own rows' mean loss, the gradients
are reduced by the variable layouts (world average / data-group average /
group sum, times grad_scale, which stays 1) and must equal the
single-process gradient of the mean loss over the global batch; then SGD
steps, the DistributedOptimizer and ``model.fit``.
"""
import keras
import numpy as np
import pytest

from conftest import model_parallel_values
from layers_testing import GRAD, expected
from splitbrain_net import (B, LOSS, LR, PG, R, check_sgd_steps, global_batch, grad_step,
                            reference_model, splitbrain_model)

MPS = model_parallel_values()


@pytest.fixture(params=MPS, ids=lambda m: f"mp{m}")
def grid(request, grid_of):
    return grid_of(request.param)


CASES = [("BK", PG, "gather", "function"), ("BK", R, "shard", "eager"),
         ("B/K", PG, "shard", "function"), ("B/K", R, "gather", "eager")]


@pytest.mark.parametrize("scheme,entry,exit_,mode", CASES)
def test_splitbrain_training_equals_single_process(grid, scheme, entry, exit_, mode):
    check_sgd_steps(grid, reference_model(), splitbrain_model(scheme, entry, exit_), mode)


def test_splitbrain_with_distributed_optimizer(grid):
    tfhybrid_opt = pytest.importorskip("tfhybrid.optimizer")
    ref, par = reference_model(), splitbrain_model("BK", PG, "shard")
    opt = tfhybrid_opt.DistributedOptimizer(keras.optimizers.SGD(LR))
    ref_opt = keras.optimizers.SGD(LR)
    own = slice(grid.rank * B, (grid.rank + 1) * B)
    ref_step, par_step = grad_step(ref, "eager"), grad_step(par, "function")
    for step in range(2):
        x, y = global_batch(grid, step)
        _, ref_grads = ref_step(x, y)
        _, grads = par_step(x[own], y[own])
        ref_opt.apply(ref_grads, ref.trainable_weights)
        opt.apply(grads, par.trainable_weights)
    g = grid.group("model")
    for v, w in zip(par.trainable_weights, ref.trainable_weights):
        np.testing.assert_allclose(v.numpy(), expected(v, w.numpy(), g), err_msg=v.path, **GRAD)


@pytest.mark.parametrize("scheme", ["B/K"])
def test_splitbrain_model_fit_with_distributed_optimizer(grid, scheme):
    """model.fit on own rows + DistributedOptimizer == SGD on the global batches."""
    tfhybrid_opt = pytest.importorskip("tfhybrid.optimizer")
    ref, par = reference_model(), splitbrain_model(scheme, PG, "gather")
    ref_step = grad_step(ref, "eager")
    batches = [global_batch(grid, step) for step in range(2)]
    for x, y in batches:
        for v, gr in zip(ref.trainable_weights, ref_step(x, y)[1]):
            v.assign_sub(LR * gr)
    own = slice(grid.rank * B, (grid.rank + 1) * B)
    par.compile(optimizer=tfhybrid_opt.DistributedOptimizer(keras.optimizers.SGD(LR)),
                loss=LOSS, jit_compile=False)
    par.fit(np.concatenate([x[own] for x, _ in batches]),
            np.concatenate([y[own] for _, y in batches]),
            batch_size=B, epochs=1, shuffle=False, verbose=0)
    g = grid.group("model")
    for v, w in zip(par.trainable_weights, ref.trainable_weights):
        np.testing.assert_allclose(v.numpy(), expected(v, w.numpy(), g), err_msg=v.path, **GRAD)
