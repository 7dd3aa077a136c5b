"""DistributedOptimizer outside plain model.fit: the reduction rule per layout,
GradientTape loops, custom train_step, XLA safety and the callbacks.

Run under ``horovodrun -np 2`` and ``-np 4``; references are computed on
every rank from all ranks' (seeded) inputs or by single-process training.
"""
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfhybrid
from tfhybrid.layout import VariableLayout, set_layout

from conftest import all_model_parallel_values, randn
from test_optimizer_fit import (GLOBAL_BATCH, LOSS, assert_weights_close, global_dataset,
                                make_data, make_model, make_optimizer, reference_weights)

SHAPES = [(3, 4), (5,), (2, 2, 2)]


def tagged_variables():
    """One variable per layout kind; a partial one over the model group."""
    layouts = [VariableLayout(), VariableLayout(kind="sharded"),
               VariableLayout(kind="partial", grad_scale=0.5)]
    out = []
    for i, (shape, layout) in enumerate(zip(SHAPES, layouts)):
        out.append(set_layout(keras.Variable(np.zeros(shape, np.float32), name=f"v{i}"), layout))
    return out


def expected_reduction(grid, kind_index, op, grad_of):
    """numpy reference of the layout rule from every rank's local gradient."""
    world = range(grid.size)
    if kind_index == 0:
        value = np.mean([grad_of(r) for r in world], axis=0)
    elif kind_index == 1:
        value = np.mean([grad_of(r) for r in grid.group("data").ranks], axis=0)
    else:
        value = np.mean([grad_of(r) for r in world], axis=0) * grid.model_size * 0.5
    return value * (grid.data_size if op == "sum" else 1)


@pytest.mark.parametrize("mp", all_model_parallel_values(), ids=lambda m: f"mp{m}")
@pytest.mark.parametrize("op", ["average", "sum"])
@pytest.mark.parametrize("mode", ["eager", "function"])
def test_reduction_rule_per_layout(grid_of, mp, op, mode):
    grid = grid_of(mp)
    variables = tagged_variables()
    opt = tfhybrid.DistributedOptimizer(keras.optimizers.SGD(1.0), op=op, bucket_bytes=40)
    local = [randn(v.shape, "grad", i, grid.rank) for i, v in enumerate(variables)]
    def reduce(grads):   # variables are captured: tf.function args would become tensors
        return opt.reduce_gradients(grads, variables)

    if mode == "function":
        reduce = tf.function(reduce)
    out = reduce([tf.constant(g) for g in local])
    for i, (v, g) in enumerate(zip(variables, out)):
        want = expected_reduction(grid, i, op, lambda r: randn(v.shape, "grad", i, r))
        np.testing.assert_allclose(g.numpy(), want, rtol=1e-5, atol=1e-6, err_msg=v.name)


def tape_step(model, opt, x, y):
    with tf.GradientTape() as tape:
        loss = LOSS(y, model(x, training=True))
    grads = tape.gradient(loss, model.trainable_variables)
    opt.apply(grads, model.trainable_variables)
    return loss


@pytest.mark.parametrize("mode", ["eager", "function"])
def test_gradient_tape_loop(grid_of, mode):
    grid = grid_of(1)
    x, y = make_data()
    model = make_model()
    opt = tfhybrid.DistributedOptimizer(make_optimizer("adam"), bucket_bytes=256)
    step = tape_step if mode == "eager" else tf.function(tape_step, jit_compile=False)
    for xb, yb in tfhybrid.data.shard(global_dataset(x, y)):
        step(model, opt, xb, yb)
    assert grid.size == 1 or len(opt.communication_plan()["buckets"]) > 1
    assert_weights_close(model.get_weights(), reference_weights("adam", x, y))


class CustomStepModel(keras.Model):
    """A subclassed model with its own train_step, as Keras' guide writes it."""

    def __init__(self, inner, **kwargs):
        super().__init__(**kwargs)
        self.inner = inner

    def call(self, x, training=False):
        return self.inner(x, training=training)

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            loss = LOSS(y, self(x, training=True))
        grads = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply(grads, self.trainable_variables)
        return {"loss": loss}


def test_custom_train_step(grid_of):
    grid_of(1)
    x, y = make_data()
    model = CustomStepModel(make_model())
    model.compile(optimizer=tfhybrid.DistributedOptimizer(make_optimizer("sgd")), jit_compile=False)
    model.fit(tfhybrid.data.shard(global_dataset(x, y)), epochs=1, verbose=0, shuffle=False)
    assert_weights_close(model.inner.get_weights(), reference_weights("sgd", x, y))


def xla_model():
    model = make_model()
    model.compile(optimizer=tfhybrid.DistributedOptimizer(make_optimizer("sgd")), loss=LOSS,
                  jit_compile=True)
    assert model.jit_compile
    return model


def test_xla_is_switched_off_by_standard_callbacks(grid_of):
    grid_of(1)
    x, y = make_data()
    model = xla_model()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.fit(tfhybrid.data.shard(global_dataset(x, y)), epochs=1, verbose=0, shuffle=False,
                  callbacks=tfhybrid.callbacks.standard())
    assert not model.jit_compile
    assert any("turning off XLA" in str(w.message) for w in caught)
    assert_weights_close(model.get_weights(), reference_weights("sgd", x, y))


def test_xla_without_callbacks_raises_clear_error(grid_of):
    grid = grid_of(1)
    if grid.size == 1:
        pytest.skip("a single process issues no collectives")
    x, y = make_data()
    model = xla_model()
    with pytest.raises(RuntimeError, match="cannot run inside XLA.*jit_compile=False"):
        model.fit(tfhybrid.data.shard(global_dataset(x, y)), epochs=1, verbose=0, shuffle=False)


def test_broadcast_starts_every_rank_from_root(grid_of):
    """Ranks build different initial weights; after broadcast they train as rank 0's."""
    grid = grid_of(1)
    x, y = make_data()
    model = make_model(seed=100 + grid.rank)
    model.compile(optimizer=tfhybrid.DistributedOptimizer(make_optimizer("adam")), loss=LOSS,
                  jit_compile=False)
    history = model.fit(tfhybrid.data.shard(global_dataset(x, y)), epochs=2, verbose=0,
                        shuffle=False, callbacks=tfhybrid.callbacks.standard())
    reference = make_model(seed=100)
    reference.compile(optimizer=make_optimizer("adam"), loss=LOSS, jit_compile=False)
    ref_history = reference.fit(x, y, batch_size=GLOBAL_BATCH, shuffle=False, epochs=2, verbose=0)
    assert_weights_close(model.get_weights(), reference.get_weights())
    # Metric averaging: the epoch loss is the mean of the ranks' running means,
    # which for equal local batches is the single-process epoch loss.
    np.testing.assert_allclose(history.history["loss"], ref_history.history["loss"], rtol=1e-5)


@pytest.mark.parametrize("mp", all_model_parallel_values(), ids=lambda m: f"mp{m}")
def test_broadcast_sends_only_groups_that_differ(grid_of, mp):
    """Replicas equal bit for bit: only the digest allgather, no broadcast. One
    float32 ulp off on the last rank (a replicated and a sharded variable):
    broadcast, and every rank (data group) ends with its root's bytes."""
    from tfhybrid.comm import backend

    grid = grid_of(mp)
    variables = tagged_variables()[:2] + [keras.Variable(np.arange(3, dtype=np.int32))]
    for i, v in enumerate(variables[:2]):      # the same block on the ranks of a data group
        v.assign(randn(v.shape, "bcast", i, grid.model_rank if i == 1 else 0))
    model = type("Holder", (), {"variables": variables, "optimizer": None})()
    before = [v.numpy().copy() for v in variables]
    with backend.recording_collectives() as calls:
        tfhybrid.callbacks.broadcast_model(model)
    assert sorted({op for op, *_ in calls}) == (["allgather"] if grid.size > 1 else [])
    for v, b in zip(variables, before):
        np.testing.assert_array_equal(v.numpy(), b)
    if grid.size == 1:
        return
    last = grid.rank == grid.size - 1
    for v in variables[:2]:
        if last:
            v.assign(np.nextafter(v.numpy(), np.float32(np.inf)))
    with backend.recording_collectives() as calls:
        tfhybrid.callbacks.broadcast_model(model)
    assert sorted({op for op, *_ in calls}) == ["allgather", "broadcast"]
    # float32 groups: the world's, and the blocks' data groups (the same group at
    # mp1; none when a block has no replica); never the equal int32 group
    groups = {"world"} | ({"data"} if 1 < grid.data_size < grid.size else set())
    assert len([op for op, *_ in calls if op == "broadcast"]) == len(groups)
    for i, (v, b) in enumerate(zip(variables, before)):
        if i == 1 and grid.data_size == 1 and last:    # this rank's own block: kept
            b = np.nextafter(b, np.float32(np.inf))
        np.testing.assert_array_equal(v.numpy(), b)


def test_start_of_fit_check_rides_in_the_broadcast_allgather(grid_of):
    """A transformed model's fit with standard(): the structure/steps check is
    the broadcast's digest allgather (no allgather of its own), and still refuses
    ranks that plan other step counts or hold other layers, before any broadcast."""
    from tfhybrid.comm import backend
    from tfhybrid.guards import ConsistencyError

    grid = grid_of(1)
    if grid.size == 1:
        pytest.skip("a single process issues no collectives")

    def build(name="fc"):
        keras.utils.set_random_seed(0)
        model = tfhybrid.transform(keras.Sequential([keras.Input((3,)),
                                                     keras.layers.Dense(2, name=name)]), "d")
        model.compile(optimizer=tfhybrid.DistributedOptimizer(keras.optimizers.SGD(0.1)),
                      loss="mse")
        return model

    x, y = np.ones((16, 3), np.float32), np.ones((16, 2), np.float32)
    model = build()
    with backend.recording_collectives() as calls:
        model.fit(x, y, batch_size=8, verbose=0, callbacks=tfhybrid.callbacks.standard())
    eager = [(op, name) for op, name, *_ in calls if op != "grouped_allreduce"]
    assert eager[0] == ("allgather", "tfh.broadcast.state.digest"), eager
    assert not [n for o, n in eager if "structure" in n or o == "broadcast"], eager
    n = 16 + 8 * (grid.rank % 2)                        # rank 1: one step more
    with pytest.raises(ConsistencyError, match=r"different numbers of steps.*rank 0: 2, rank 1: 3"):
        model.fit(np.ones((n, 3), np.float32), np.ones((n, 2), np.float32), batch_size=8,
                  verbose=0, callbacks=tfhybrid.callbacks.standard())
    drifted = build("fc" if grid.rank == 0 else "fc_1")
    with pytest.raises(ConsistencyError, match="other layer names"):
        drifted.fit(x, y, batch_size=8, verbose=0, callbacks=tfhybrid.callbacks.standard())


def test_learning_rate_warmup(grid_of):
    grid = grid_of(1)
    x, y = make_data(steps=4)
    model = make_model()
    model.compile(optimizer=tfhybrid.DistributedOptimizer(keras.optimizers.SGD(0.1)), loss=LOSS,
                  jit_compile=False)
    seen = []
    record = keras.callbacks.LambdaCallback(
        on_train_batch_begin=lambda b, logs: seen.append(float(model.optimizer.learning_rate)))
    callbacks = tfhybrid.callbacks.standard(warmup_steps=2, target_lr=0.1) + [record]
    model.fit(tfhybrid.data.shard(global_dataset(x, y)), epochs=1, verbose=0, shuffle=False,
              callbacks=callbacks)
    start = 0.1 / grid.data_size
    np.testing.assert_allclose(seen, [start, (start + 0.1) / 2, 0.1, 0.1], rtol=1e-6)


def ancestors(op):
    seen, stack = set(), [op]
    while stack:
        node = stack.pop()
        for parent in [t.op for t in node.inputs] + list(node.control_inputs):
            if parent not in seen:
                seen.add(parent)
                stack.append(parent)
    return seen


def test_buckets_can_overlap_backprop(grid_of):
    """In the traced step, the last layers' bucket allreduce does not wait for the
    first layer's weight gradient (so the executor can overlap it with backprop)."""
    grid = grid_of(1)
    if grid.size == 1:
        pytest.skip("a single process issues no collectives")
    x, y = make_data()
    model = make_model()
    opt = tfhybrid.DistributedOptimizer(make_optimizer("sgd"), bucket_bytes=300)
    graph = tf.function(tape_step).get_concrete_function(model, opt, x[:4], y[:4]).graph
    reductions = [op for op in graph.get_operations() if "Allreduce" in op.type]
    assert len(reductions) == len(opt.communication_plan()["buckets"]) >= 3
    first, last = reductions[0], reductions[-1]            # issue order: last layers first
    conv_grad = "Conv2DBackpropFilter"
    assert not any(a.type == conv_grad for a in ancestors(first))
    assert any(a.type == conv_grad for a in ancestors(last))
