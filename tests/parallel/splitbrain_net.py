"""A small SplitBrain-style network and its single-process reference, shared by
tests/parallel/test_layers_splitbrain*.py.

conv (data parallel over all ranks) -> Flatten -> ModuloLayer -> f(16) -> c(12)
-> plain Dense(8) -> f(8) [-> ShardLayer] -> f(8) [-> ShardLayer] -> inverse.
``reduce_by_layout`` writes out the DistributedOptimizer's reduction rule;
``check_sgd_steps`` trains both with it and compares. ``small_cnn`` and
``small_data`` are the plain Keras model and data that the gmp ``transform``
tests (B scheme, periodic averaging) rewrite.
"""
import keras
import numpy as np
import tensorflow as tf

from tfhybrid.comm import backend
from tfhybrid.layers import (ChannelParallelDense, FilterParallelDense, ModuloInverseLayer,
                             ModuloLayer, ShardLayer)
from tfhybrid.layout import layout_of

from conftest import randn, rng
from layers_testing import FWD, GRAD, expected

PG, R = "replicated_partial_grad", "replicated"
B, IMG, CLASSES, LR = 4, (6, 6, 2), 8, 0.1


def seeded(layer, shape, key):
    layer.build(shape)
    layer.set_weights([randn(w.shape, key, i) * 0.5 for i, w in enumerate(layer.weights)])
    return layer


def reference_layers():
    return [seeded(keras.layers.Conv2D(4, 3, activation="relu", name="conv"), (None,) + IMG, "c"),
            seeded(keras.layers.Dense(16, activation="relu", name="fc16"), (None, 64), "d16"),
            seeded(keras.layers.Dense(12, activation="relu", name="fc12"), (None, 16), "d12"),
            seeded(keras.layers.Dense(8, activation="tanh", name="fc8a"), (None, 12), "d8a"),
            seeded(keras.layers.Dense(8, activation="relu", name="fc8"), (None, 8), "d8"),
            seeded(keras.layers.Dense(CLASSES, name="logits"), (None, 8), "d8out")]


def clone(layer):
    new = type(layer).from_config(layer.get_config())
    new.build(layer._build_shapes_dict["input_shape"])
    new.set_weights(layer.get_weights())
    return new


def reference_model():
    conv, *fcs = reference_layers()
    return keras.Sequential([keras.Input(IMG), conv, keras.layers.Flatten()] + fcs)


def splitbrain_model(scheme, entry, exit_):
    """conv -> Flatten -> Modulo -> f(16) -> c(12) -> Dense(8) -> f(8) [-> Shard] -> f(8) -> inverse.

    ``scheme`` "BK": ModuloLayer, region, ModuloInverseLayer; "B" or "B/K": the
    region is the ModuloLayer's ``body``."""
    conv, d16, d12, d8a, d8, d5 = reference_layers()
    region = [
        FilterParallelDense.from_layer(d16, input_layout=PG if entry == PG else R,
                                       output_layout="split"),
        ChannelParallelDense.from_layer(d12, input_layout="split"),
        clone(d8a),                                          # a plain replicated Dense
    ]
    if exit_ == "shard":      # f(split) -> Shard -> f(partial grad, split) -> Shard -> inverse(P)
        region += [FilterParallelDense.from_layer(d8, output_layout="split"), ShardLayer(),
                   FilterParallelDense.from_layer(d5, input_layout=PG, output_layout="split"),
                   ShardLayer()]
        inverse_in = PG
    else:                     # f -> f(gather) -> inverse(R)
        region += [FilterParallelDense.from_layer(d8),
                   FilterParallelDense.from_layer(d5, output_layout=R)]
        inverse_in = R
    head = [keras.Input(IMG), clone(conv), keras.layers.Flatten()]
    if scheme == "BK":
        tail = [ModuloLayer("BK", output_layout=entry)] + region + \
            [ModuloInverseLayer(input_layout=inverse_in)]
    else:
        tail = [ModuloLayer(scheme, body=keras.Sequential(region), output_layout=entry,
                            inverse_input_layout=inverse_in)]
    return keras.Sequential(head + tail)


def global_batch(grid, step):
    x = randn((grid.size * B,) + IMG, "gx", step)
    y = rng("gy", step).integers(0, CLASSES, grid.size * B).astype(np.int32)
    return x, y


LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def grad_step(model, mode):
    """``step(x, y) -> (loss, grads)`` of the mean loss, traced once for tf.function."""
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = LOSS(y, model(x, training=True))
        return loss, tape.gradient(loss, model.trainable_weights)
    if mode == "function":
        step = tf.function(step)

    def run(x, y):
        loss, grads = step(tf.constant(x), tf.constant(y))
        return float(loss), [g.numpy() for g in grads]
    return run


def reduce_by_layout(variables, grads, grid):
    """The optimizer's rule, written out: sum over ranks, times a factor, times grad_scale."""
    out = []
    for i, (v, gr) in enumerate(zip(variables, grads)):
        lay = layout_of(v)
        if lay.kind == "sharded":
            ranks, factor = grid.group("data").ranks, 1.0 / grid.data_size
        elif lay.kind == "partial":
            ranks, factor = tuple(range(grid.size)), grid.model_size / grid.size
        else:
            ranks, factor = tuple(range(grid.size)), 1.0 / grid.size
        if len(ranks) > 1:
            gr = backend.allreduce(tf.constant(gr), ranks, f"test.reduce{i}").numpy()
        out.append(gr * factor * lay.grad_scale)
    return out


def world_mean(value, grid):
    if grid.size == 1:
        return value
    return float(backend.allreduce(tf.constant(value), tuple(range(grid.size)), "test.loss")
                 ) / grid.size


def check_grads(variables, grads, ref_grads, g):
    for v, gr, full in zip(variables, grads, ref_grads):
        np.testing.assert_allclose(gr, expected(v, full, g), err_msg=v.path, **GRAD)


def check_sgd_steps(grid, ref, par, mode, steps=2):
    """``steps`` SGD steps of ``ref`` on the global batch and of ``par`` on this
    rank's rows (gradients reduced by layout) give the same loss, reduced
    gradients and weights."""
    g, own = grid.group("model"), slice(grid.rank * B, (grid.rank + 1) * B)
    assert all(layout_of(v).grad_scale == 1.0 for v in par.trainable_weights)
    ref_step, par_step = grad_step(ref, "eager"), grad_step(par, mode)
    for step in range(steps):
        x, y = global_batch(grid, step)
        ref_loss, ref_grads = ref_step(x, y)
        loss, grads = par_step(x[own], y[own])
        np.testing.assert_allclose(world_mean(loss, grid), ref_loss, **FWD)
        reduced = reduce_by_layout(par.trainable_weights, grads, grid)
        check_grads(par.trainable_weights, reduced, ref_grads, g)
        for v, gr in zip(ref.trainable_weights, ref_grads):
            v.assign_sub(LR * gr)
        for v, gr in zip(par.trainable_weights, reduced):
            v.assign_sub(LR * gr)
    for v, w in zip(par.trainable_weights, ref.trainable_weights):
        np.testing.assert_allclose(v.numpy(), expected(v, w.numpy(), g), err_msg=v.path, **GRAD)


def small_cnn(seed=0):
    """Conv -> Flatten -> Dense(16) -> Dense(8) -> Dense(4) softmax, on 6x6x2."""
    keras.utils.set_random_seed(seed)
    i = keras.Input((6, 6, 2))
    x = keras.layers.Conv2D(4, 3, activation="relu", name="conv")(i)
    x = keras.layers.Flatten(name="flat")(x)
    x = keras.layers.Dense(16, activation="relu", name="fc1")(x)
    x = keras.layers.Dense(8, activation="tanh", name="fc2")(x)
    x = keras.layers.Dense(4, activation="softmax", name="out")(x)
    return keras.Model(i, x, name="cnn")


def small_data(n, key):
    """``n`` seeded inputs for ``small_cnn`` and labels in 0..3."""
    x = randn((n, 6, 6, 2), key, "x")
    y = rng(key, "y").integers(0, 4, size=n).astype(np.int32)
    return x, y
