"""SplitBrain's "B" scheme under horovodrun: the K ranks of a model group take
turns broadcasting their B rows through the model-parallel region.

* the two primitives it is built from, against numpy: ``comm.broadcast``
  (forward: root's rows on every rank; backward: the partial gradients summed
  on the root, or the root's own replicated gradient) and ``comm.to_root``
  (forward: identity; backward: the root's gradient broadcast);
* ``ModuloLayer("B", body=...)`` in the SplitBrain network of
  ``splitbrain_net`` (conv data parallel, filter/channel-parallel Dense, a
  plain Dense, ShardLayers) against the unmodified Keras model in one
  process: loss, every gradient after the optimizer's layout rule, and the
  weights after two SGD steps;
* ``tfhybrid.transform(model, "gmp", scheme="B")`` trained with ``fit`` for
  STEPS steps against single-process ``fit`` (gathered weights, rtol 1e-4),
  and what ``describe`` reports for it (broadcast rounds, same bytes as BK).
"""
import keras
import numpy as np
import pytest
import tensorflow as tf

import tfhybrid
from tfhybrid import comm
from tfhybrid.layers import ModuloLayer
from tfhybrid.compose import transform
from tfhybrid.transformer import describe, gather

from conftest import model_parallel_values, randn, world_size
from layers_testing import FWD, GRAD, value_and_grads
from splitbrain_net import (B, LR, PG, R, check_sgd_steps, global_batch, reference_model,
                            small_cnn as cnn, small_data, splitbrain_model)

MPS = model_parallel_values()
N = world_size()


@pytest.fixture(params=MPS, ids=lambda m: f"mp{m}")
def grid(request, grid_of):
    return grid_of(request.param)


# -- the primitives ------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["eager", "function"])
@pytest.mark.parametrize("partial", [True, False], ids=["P-grad", "R-grad"])
def test_broadcast_forward_and_rooted_sum_backward(grid, partial, mode):
    g = grid.group("model")
    xs = [randn((B, 3), "bx", r) for r in g.ranks]
    # the gradient arriving at the output: P (a term per rank) or R (the same everywhere)
    ups = [randn((B, 3), "bu", r if partial else 0) for r in g.ranks]
    for root in range(g.size):
        def call(t, root=root):
            y = comm.broadcast(t, root, g, f"test.bcast{root}", partial_grad=partial)
            return y, tf.reduce_sum(y * ups[g.index])
        y, dx, _ = value_and_grads(call, [], xs[g.index], mode)
        np.testing.assert_allclose(y, xs[root], **FWD)
        want = (sum(ups) if partial else ups[g.index]) if g.index == root else 0 * ups[0]
        np.testing.assert_allclose(dx, want, **GRAD)


@pytest.mark.parametrize("mode", ["eager", "function"])
def test_to_root_broadcasts_the_roots_gradient(grid, mode):
    g = grid.group("model")
    x = randn((B, 3), "tx", g.ranks)
    ups = [randn((B, 3), "tu", r) for r in g.ranks]
    for root in range(g.size):
        def call(t, root=root):
            y = comm.to_root(t, root, g, f"test.root{root}")
            return y, tf.reduce_sum(y * ups[g.index])
        y, dx, _ = value_and_grads(call, [], x, mode)
        np.testing.assert_allclose(y, x, **FWD)
        np.testing.assert_allclose(dx, ups[root], **GRAD)


def test_root_out_of_range(grid_of):
    grid_of(1)
    with pytest.raises(ValueError, match=r"root=2; expected the index of a rank of the "
                                         r"model group, an integer in \[0, 1\)"):
        comm.broadcast(np.zeros((2, 2), np.float32), 2)


# -- ModuloLayer("B") in a SplitBrain network vs one process ---------------------------

CASES = [(PG, "gather", "function"), (R, "shard", "function"), (PG, "shard", "eager"),
         (R, "gather", "eager")]


@pytest.mark.parametrize("entry,exit_,mode", CASES)
def test_b_scheme_training_equals_single_process(grid, entry, exit_, mode):
    """Loss, reduced gradients and weights after 2 SGD steps equal the unmodified
    model's on the global batch (every gradient layout at both boundaries)."""
    ref, par = reference_model(), splitbrain_model("B", entry, exit_)
    assert [m.scheme for m in par.layers if isinstance(m, ModuloLayer)] == ["B"]
    check_sgd_steps(grid, ref, par, mode)


def test_b_scheme_traces_one_broadcast_per_round(grid_of):
    """K rounds: K forward broadcasts; with recompute each round is run again in the
    backward pass (K more), and its input gradient is reduced to the round's root."""
    grid = grid_of(MPS[-1])
    k = grid.model_size
    par = splitbrain_model("B", PG, "gather")
    x, y = global_batch(grid, 0)
    own = slice(grid.rank * B, (grid.rank + 1) * B)

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = keras.losses.sparse_categorical_crossentropy(y, par(x), from_logits=True)
        return tape.gradient(loss, par.trainable_weights)

    with comm.backend.recording_collectives() as calls:
        step.get_concrete_function(tf.constant(x[own]), tf.constant(y[own]))
    ops = [op for op, name, *_ in calls if "bcast" in name or "root" in name]
    assert ops.count("broadcast") == (2 * k + k if k > 1 else 0)   # fwd, recompute, to_root
    assert ops.count("alltoall") == (k if k > 1 else 0)            # rooted sums of dx


# -- transform(model, "gmp", scheme="B") trained with fit -------------------------------

STEPS, BATCH = 3, 8
LOSS = "sparse_categorical_crossentropy"


def data():
    return small_data(STEPS * BATCH, "gmp-b")


def dataset(x, y):
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH, drop_remainder=True)


def test_gmp_scheme_b_fit_equals_single_process(grid):
    x, y = data()
    ref = cnn()
    initial = ref.get_weights()
    ref.compile(optimizer=keras.optimizers.SGD(LR), loss=LOSS, jit_compile=False)
    ref.fit(dataset(x, y), epochs=1, shuffle=False, verbose=0)
    pmodel = transform(cnn(), "gmp", scheme="B", ccr_threshold=0, fallback="replicate")
    modulo = [m for m in pmodel.layers if isinstance(m, ModuloLayer)]
    if grid.model_size > 1:
        assert [m.scheme for m in modulo] == ["B"]
        assert {"fc1", "fc2", "out"} <= {layer.name for layer in modulo[0].body.layers}
    pmodel.compile(optimizer=tfhybrid.DistributedOptimizer(keras.optimizers.SGD(LR)),
                   loss=LOSS, jit_compile=False)
    pmodel.fit(tfhybrid.data.shard(dataset(x, y), model=pmodel), epochs=1, shuffle=False,
               verbose=0)
    full = gather(pmodel).get_weights()
    moved = max(float(np.max(np.abs(e - w))) for e, w in zip(ref.get_weights(), initial))
    assert moved > 1e-3, "the reference did not train: the comparison would be vacuous"
    for i, (a, e) in enumerate(zip(full, ref.get_weights())):
        np.testing.assert_allclose(a, e, rtol=1e-4, atol=1e-6, err_msg=f"weight {i}")
    d = describe(pmodel, batch_size=BATCH, print_fn=None)
    bk = describe(transform(cnn(), "gmp", ccr_threshold=0, fallback="replicate"),
                  batch_size=BATCH, print_fn=None)
    assert d.param_bytes == bk.param_bytes and d.comm_bytes >= bk.comm_bytes
    if grid.model_size > 1:
        ops = {op for r in d.rows for _, op, _, _ in r.collectives}
        assert "broadcast" in ops and "reduce" in ops
        assert "scheme 'B'" in d.text
