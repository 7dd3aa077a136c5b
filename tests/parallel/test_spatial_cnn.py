"""A small spatially parallel CNN trained with SGD equals single-process training;
error messages of the spatial layers under a real process grid.

Run under ``horovodrun -np 2`` and ``-np 4``. The spatial model (scatter,
conv, pool, conv, gather, flatten, dense) starts from the plain model's
weights; each data group trains on its share of the global batch, and the
gradients are reduced by their layouts exactly as the DistributedOptimizer
does (partial: sum over the group, average over the rest; replicated:
average over the world).
"""
import keras
import numpy as np
import pytest
import tensorflow as tf

import tfhybrid
from tfhybrid.comm import backend
from tfhybrid.layers import (SpatialConv2D, SpatialGather, SpatialMaxPooling2D,
                             SpatialScatter)
from tfhybrid.layout import layout_of

from conftest import randn, rng
from test_spatial_conv import split_specs

SHAPE, CLASSES, BATCH, STEPS = (16, 8, 3), 5, 8, 4


def plain_model():
    inputs = keras.Input(SHAPE)
    x = keras.layers.Conv2D(4, 3, padding="same", activation="relu")(inputs)
    x = keras.layers.MaxPooling2D(2)(x)
    x = keras.layers.Conv2D(6, 3, strides=2, padding="same", activation="relu")(x)
    x = keras.layers.Flatten()(x)
    return keras.Model(inputs, keras.layers.Dense(CLASSES)(x))


def spatial_model(split):
    """The plain model over spatial blocks (the first conv overlapped, the second not)."""
    inputs = keras.Input(SHAPE)
    x = SpatialScatter(split=split)(inputs)
    x = SpatialConv2D(4, 3, padding="same", activation="relu", split=split, overlap=True)(x)
    x = SpatialMaxPooling2D(2, split=split)(x)
    x = SpatialConv2D(6, 3, strides=2, padding="same", activation="relu", split=split)(x)
    x = SpatialGather(split=split)(x)
    x = keras.layers.Flatten()(x)
    return keras.Model(inputs, keras.layers.Dense(CLASSES)(x))


def reduce_by_layout(grads, variables, grid):
    """The DistributedOptimizer's rule, written out with raw collectives."""
    world = tuple(range(grid.size))
    out = []
    for i, (g, v) in enumerate(zip(grads, variables)):
        layout = layout_of(v)
        scale = grid.group(layout.group).size if layout.kind == "partial" else 1
        if grid.size > 1:
            g = backend.allreduce(g, world, f"test.grad{i}", average=True)
        out.append(g * scale * layout.grad_scale)
    return out


def train(model, x, y, grid=None):
    optimizer = keras.optimizers.SGD(0.1)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        if grid is not None:
            grads = reduce_by_layout(grads, model.trainable_variables, grid)
        optimizer.apply(grads, model.trainable_variables)
        return loss

    return [float(step(x, y)) for _ in range(STEPS)]


@pytest.mark.parametrize("spec", split_specs(2) + split_specs(2, few=True), ids=str)
def test_spatial_cnn_trains_like_the_plain_model(grid_of, spec):
    mp, split = spec
    grid = grid_of(mp)
    x = randn((BATCH, *SHAPE), "x")
    y = rng("y").integers(0, CLASSES, BATCH).astype(np.int32)
    keras.utils.set_random_seed(7)
    reference = plain_model()
    model = spatial_model(split)
    model.set_weights(reference.get_weights())
    kinds = [layout_of(v).kind for v in model.trainable_variables]
    assert kinds == ["partial"] * 4 + ["replicated"] * 2
    rows = slice(grid.data_rank * BATCH // grid.data_size,
                 (grid.data_rank + 1) * BATCH // grid.data_size)
    losses = train(model, x[rows], y[rows], grid)
    ref_losses = train(reference, x, y)
    for got, want in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    if grid.data_size == 1:
        np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)


@pytest.mark.parametrize("spec", split_specs(2)[:1], ids=str)
def test_spatial_cnn_fits_with_the_distributed_optimizer(grid_of, spec):
    mp, split = spec
    grid = grid_of(mp)
    x = randn((BATCH, *SHAPE), "x")
    y = rng("y").integers(0, CLASSES, BATCH).astype(np.int32)
    keras.utils.set_random_seed(7)
    reference = plain_model()
    model = spatial_model(split)
    model.set_weights(reference.get_weights())
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    model.compile(optimizer=tfhybrid.DistributedOptimizer(keras.optimizers.SGD(0.1)), loss=loss)
    rows = slice(grid.data_rank * BATCH // grid.data_size,
                 (grid.data_rank + 1) * BATCH // grid.data_size)
    local = BATCH // grid.data_size
    model.fit(x[rows], y[rows], batch_size=local, epochs=STEPS, shuffle=False, verbose=0)
    train(reference, x, y)
    for got, want in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


# -- error messages under a real grid ---------------------------------------------------

def test_output_that_does_not_split_names_shape_grid_and_sizes(grid_of):
    grid_of(2)
    conv = SpatialConv2D(2, 3, strides=2, padding="valid", split="height", name="c1")
    with pytest.raises(ValueError) as err:
        conv(keras.Input((8, 6, 3)))       # global height 16 -> output 7 over 2 ranks
    msg = str(err.value)
    for part in ("SpatialConv2D 'c1'", "(None, 16, 6, 3)", "2x1 grid", "output size 7",
                 "14 or 18"):
        assert part in msg, (part, msg)


def test_block_smaller_than_halo_names_shape_grid_and_sizes(grid_of):
    grid_of(2)
    conv = SpatialConv2D(2, 7, padding="same", split="width", name="c7")
    with pytest.raises(ValueError) as err:
        conv(keras.Input((5, 2, 3)))       # blocks of 2 columns, halo 3
    msg = str(err.value)
    for part in ("SpatialConv2D 'c7'", "(None, 5, 4, 3)", "1x2 grid", "width",
                 "smaller than the halo", "sizes: 6"):
        assert part in msg, (part, msg)


def test_pooling_output_that_does_not_split(grid_of):
    grid_of(2)
    pool = SpatialMaxPooling2D(2, split="height", name="p1")
    with pytest.raises(ValueError, match=r"p1.*\(None, 6, 4, 1\).*output size 3.*4 or 8"):
        pool(keras.Input((3, 4, 1)))


def test_grid_that_does_not_match_the_group(grid_of):
    grid_of(2)
    with pytest.raises(ValueError, match=r"split=\(2, 2\).*group of 2 ranks"):
        SpatialConv2D(2, 3, split=(2, 2))(keras.Input((4, 4, 1)))


def test_from_layer_of_an_unbuilt_layer(grid_of):
    grid_of(2)
    with pytest.raises(ValueError, match="not built"):
        SpatialConv2D.from_layer(keras.layers.Conv2D(2, 3))
    assert tfhybrid.grid().model_size == 2
