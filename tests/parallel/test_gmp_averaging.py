"""gmp with SplitBrain's periodic model averaging (``average_every=N``, §4).

N > 1 is approximate by design, so it is not compared with single-process
training but with its own schedule written out in one process: two model
groups (``-np 2``: groups of one rank; ``-np 4``: groups of two, the
Dense layers partitioned), each with its own copy of the model-parallel part
(fc1, fc2, out) updated by SGD with the gradient of its own rows' mean loss,
the shared convolution updated with the world-mean gradient every step, and
the copies of the model-parallel part replaced by their mean after every
N-th step. After STEPS = 5 steps with N = 4 (one averaging, then one local
step) each rank's weights (its blocks of its group's copy) must equal the
schedule's to rtol 1e-4, for both ``averaging="p2p"`` and ``"ps"``.
N = 1 (the default) marks nothing, so every existing gmp test is the exact
synchronous case.
"""
import keras
import numpy as np
import pytest
import tensorflow as tf

import tfhybrid
from tfhybrid.optimizer.averaging import periodic_of
from tfhybrid.compose import transform
from tfhybrid.transformer.rewrite import find_layer

from conftest import world_size
from layers_testing import expected
from splitbrain_net import small_cnn as cnn, small_data

N = world_size()
STEPS, BATCH, EVERY, LR = 5, 8, 4, 0.2
LOSS = "sparse_categorical_crossentropy"
REGION = ("fc1", "fc2", "out")


def data():
    return small_data(STEPS * BATCH, "gmp-avg")


def schedule(grid, x, y):
    """The periodic-averaging schedule in one process: {layer: weights} per group."""
    groups = grid.data_size
    base = cnn()
    conv = base.get_layer("conv").get_weights()
    copies = [{n: base.get_layer(n).get_weights() for n in REGION} for _ in range(groups)]
    model, loss_fn = cnn(), keras.losses.SparseCategoricalCrossentropy()
    b = BATCH // grid.size
    for step in range(STEPS):
        xs, ys = x[step * BATCH:(step + 1) * BATCH], y[step * BATCH:(step + 1) * BATCH]
        conv_grads = []
        for d in range(groups):
            rows = np.concatenate([np.arange(r * b, (r + 1) * b)
                                   for r in grid.model_group_ranks(d)])
            model.get_layer("conv").set_weights(conv)
            for n in REGION:
                model.get_layer(n).set_weights(copies[d][n])
            with tf.GradientTape() as tape:
                loss = loss_fn(ys[rows], model(xs[rows]))
            grads = dict(zip([v.path for v in model.trainable_weights],
                             tape.gradient(loss, model.trainable_weights)))
            conv_grads.append([grads[v.path].numpy()
                               for v in model.get_layer("conv").trainable_weights])
            for n in REGION:
                layer = model.get_layer(n)
                copies[d][n] = [w - LR * grads[v.path].numpy()
                                for w, v in zip(copies[d][n], layer.trainable_weights)]
        conv = [w - LR * np.mean(gs, axis=0) for w, gs in zip(conv, zip(*conv_grads))]
        if (step + 1) % EVERY == 0:
            for n in REGION:
                mean = [np.mean(ws, axis=0) for ws in zip(*(c[n] for c in copies))]
                for c in copies:
                    c[n] = [w.copy() for w in mean]
    return conv, copies


@pytest.mark.parametrize("averaging", ["p2p", "ps"])
def test_periodic_averaging_follows_its_schedule(grid_of, averaging):
    grid = grid_of(N // 2)          # two model groups
    x, y = data()
    conv, copies = schedule(grid, x, y)
    differ = max(float(np.max(np.abs(a - b))) for n in REGION
                 for a, b in zip(copies[0][n], copies[1][n]))
    assert differ > 1e-5, "the groups' copies agree: the comparison would be vacuous"
    pmodel = transform(cnn(), "gmp", ccr_threshold=0, average_every=EVERY,
                       averaging=averaging)
    assert not any(periodic_of(v) for v in pmodel.get_layer("conv").trainable_weights)
    opt = tfhybrid.DistributedOptimizer(keras.optimizers.SGD(LR))
    pmodel.compile(optimizer=opt, loss=LOSS, jit_compile=False)
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH, drop_remainder=True)
    pmodel.fit(tfhybrid.data.shard(ds, model=pmodel), epochs=1, shuffle=False, verbose=0)
    g, mine = grid.group("model"), copies[grid.data_rank]
    for v, w in zip(pmodel.get_layer("conv").trainable_weights, conv):
        np.testing.assert_allclose(v.numpy(), w, rtol=1e-4, atol=1e-6, err_msg=v.path)
    for n in REGION:
        layer = find_layer(pmodel, n)
        assert all(periodic_of(v) is not None for v in layer.trainable_weights)
        for v, w in zip(layer.trainable_weights, mine[n]):
            np.testing.assert_allclose(v.numpy(), expected(v, w, g), rtol=1e-4, atol=1e-6,
                                       err_msg=v.path)
    plan = opt.averaging_plan(pmodel.trainable_weights)
    assert [(p["every"], p["method"], p["groups"]) for p in plan] == [(EVERY, averaging, 2)]
    assert plan[0]["payload"] == sum(4 * int(np.prod(v.shape)) for n in REGION
                                     for v in find_layer(pmodel, n).trainable_weights)


def test_average_every_1_marks_nothing(grid_of):
    grid_of(N // 2)
    pmodel = transform(cnn(), "gmp", ccr_threshold=0, average_every=1, averaging="ps")
    assert not any(periodic_of(v) is not None for v in pmodel.trainable_weights)
