"""MobileNet-style blocks (DepthwiseConv2D, SeparableConv2D) under ``s``/``ds``.

Depthwise and separable convolutions have a spatial rule (without one, under
``s`` the spatial region would stop at the first one and every rank would run
the rest of the network on the whole image). They run on blocks with a halo
(``SpatialDepthwiseConv2D``, ``SpatialSeparableConv2D``: the depthwise step
exchanges the halo, a separable layer's 1x1 pointwise step runs on the
block). Each case: the layers and their outputs/gradients equal Keras' on
the whole input, block by block; fit history and gathered weights equal one
process on the whole data.
"""
import os

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfhybrid
from tfhybrid.layers import SpatialDepthwiseConv2D, SpatialSeparableConv2D

from conftest import assert_weights_like, job_dir, reference_once, rng, world_size

N, BATCH, CLASSES = 16, 8, 3
CASES = ([("s", 2, "height"), ("s", 2, "width"), ("d", 1, None), ("f", 2, None)]
         if world_size() == 2 else [("ds", 2, "height"), ("s", 4, (2, 2)), ("s", 4, "height")])


def _model():
    keras.utils.set_random_seed(5)
    L = keras.layers
    inp = keras.Input((16, 16, 3))
    h = L.Conv2D(8, 3, padding="same", name="stem")(inp)
    h = L.DepthwiseConv2D(3, padding="same", name="dw1")(h)
    h = L.BatchNormalization(name="bn1")(h)
    h = L.ReLU(name="relu1")(h)
    h = L.Conv2D(8, 1, name="pw1")(h)
    h = L.DepthwiseConv2D(3, strides=2, padding="same", depth_multiplier=2, name="dw2")(h)
    h = L.SeparableConv2D(12, 3, padding="same", activation="relu", name="sep1")(h)
    h = L.SeparableConv2D(12, 5, strides=2, padding="same", dilation_rate=1, name="sep2")(h)
    h = L.GlobalAveragePooling2D(name="gap")(h)
    out = L.Dense(CLASSES, name="out")(h)
    return keras.Model(inp, out), dict(
        optimizer=keras.optimizers.SGD(0.05),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))


@pytest.mark.parametrize("strategy,mp,spatial", CASES, ids=lambda c: str(c))
def test_mobilenet_blocks_train_like_one_process(grid_of, strategy, mp, spatial):
    grid = grid_of(mp)
    x = rng("dw-x").standard_normal((N, 16, 16, 3)).astype(np.float32)
    y = rng("dw-y").integers(0, CLASSES, N)

    def compute():         # two epochs, then the third of the resumed cases
        reference, kwargs = _model()
        reference.compile(**kwargs)
        first = reference.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
        weights = reference.get_weights()
        third = reference.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
        return (first.history["loss"], weights, third.history["loss"],
                reference.get_weights())
    want, weights, want_resumed, weights_resumed = reference_once(compute, x, y, BATCH)
    source, kwargs = _model()
    options = {"spatial": spatial} if spatial else {}
    model = tfhybrid.transform(source, strategy, fallback="replicate", **options)
    model.compile(optimizer=tfhybrid.DistributedOptimizer(kwargs.pop("optimizer")), **kwargs)
    if strategy in ("s", "ds"):     # every depthwise/separable layer runs on blocks
        kinds = {r.name: r.kind for r in tfhybrid.describe(model, print_fn=None).rows}
        assert all(kinds[n].startswith("spatial") for n in ("dw1", "dw2", "sep1", "sep2")), kinds
    blocks, index = (grid.size, grid.rank) if strategy == "d" else (grid.data_size,
                                                                     grid.data_rank)
    got = model.fit(x[index::blocks], y[index::blocks], batch_size=BATCH // blocks, epochs=2,
                    shuffle=False, verbose=0)
    np.testing.assert_allclose(got.history["loss"], want, rtol=1e-5)
    assert_weights_like(tfhybrid.gather(model), weights)
    if strategy in ("s", "ds"):     # checkpoint, resume as d, one more epoch each
        path = os.path.join(job_dir(), f"dw_{strategy}_{grid.size}.keras")
        tfhybrid.save(model, path, epoch=2)
        resumed = tfhybrid.load(path, strategy="d")
        rows = slice(grid.rank, None, grid.size)
        got = resumed.fit(x[rows], y[rows], batch_size=BATCH // grid.size, epochs=1,
                          shuffle=False, verbose=0)
        np.testing.assert_allclose(got.history["loss"], want_resumed, rtol=1e-5)
        assert_weights_like(tfhybrid.gather(resumed), weights_resumed)


def _padded_model():
    """Keras applications' stride-2 steps: ZeroPadding2D(correct_pad) + a 'valid'
    convolution (the padded 17 rows would not split over 2 or 4 ranks)."""
    keras.utils.set_random_seed(6)
    L = keras.layers
    inp = keras.Input((16, 16, 3))
    h = L.ZeroPadding2D(((0, 1), (0, 1)), name="stem_pad")(inp)
    h = L.Conv2D(8, 3, strides=2, name="stem")(h)                  # 8x8
    h = L.ReLU(6.0, name="relu6")(h)
    h = L.ZeroPadding2D(((0, 1), (0, 1)), name="dw_pad")(h)
    h = L.DepthwiseConv2D(3, strides=2, name="dw")(h)             # 4x4
    h = L.ZeroPadding2D(1, name="sep_pad")(h)                      # (1, 1): 'same' at stride 1
    h = L.SeparableConv2D(8, 3, name="sep")(h)
    h = L.ZeroPadding2D(((1, 1), (1, 1)), name="plain_pad")(h)     # not 'same': border_padding
    h = L.Conv2D(8, 3, strides=2, name="conv")(h)                  # 6 -> 2
    h = L.GlobalAveragePooling2D(name="gap")(h)
    out = L.Dense(CLASSES, name="out")(h)
    return keras.Model(inp, out), dict(
        optimizer=keras.optimizers.SGD(0.05),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))


def test_same_padding_steps_fold_into_their_convolution(grid_of):
    grid = grid_of(2)
    x = rng("fold-x").standard_normal((N, 16, 16, 3)).astype(np.float32)
    y = rng("fold-y").integers(0, CLASSES, N)

    def compute():
        reference, kwargs = _padded_model()
        reference.compile(**kwargs)
        history = reference.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
        return history.history["loss"], reference.get_weights(), reference.predict(x, verbose=0)
    want, weights, predicted = reference_once(compute, x, y, BATCH)
    source, kwargs = _padded_model()
    model = tfhybrid.transform(source, "s" if grid.data_size == 1 else "ds")
    model.compile(optimizer=tfhybrid.DistributedOptimizer(kwargs.pop("optimizer")), **kwargs)
    kinds = {r.name: r.kind for r in tfhybrid.describe(model, print_fn=None).rows}
    assert [kinds[n] for n in ("stem_pad", "dw_pad", "sep_pad", "plain_pad")] == ["fold"] * 4, \
        kinds
    assert all(kinds[n].startswith("spatial") for n in ("stem", "dw", "sep", "conv")), kinds
    assert model.get_layer("conv").border_padding == ((1, 1), (1, 1))
    rows = slice(grid.data_rank, None, grid.data_size)
    got = model.fit(x[rows], y[rows], batch_size=BATCH // grid.data_size, epochs=2,
                    shuffle=False, verbose=0)
    np.testing.assert_allclose(got.history["loss"], want, rtol=1e-5)
    assert_weights_like(tfhybrid.gather(model), weights)
    if grid.data_size == 1:     # every rank predicts the whole batch
        np.testing.assert_allclose(model.predict(x, verbose=0), predicted, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("cls,make", [
    (SpatialDepthwiseConv2D, lambda: keras.layers.DepthwiseConv2D(3, padding="same",
                                                                  depth_multiplier=2)),
    (SpatialDepthwiseConv2D, lambda: keras.layers.DepthwiseConv2D(5, strides=2, padding="same",
                                                                  use_bias=False)),
    (SpatialDepthwiseConv2D, lambda: keras.layers.DepthwiseConv2D(3, dilation_rate=2,
                                                                  padding="same")),
    (SpatialSeparableConv2D, lambda: keras.layers.SeparableConv2D(4, 3, padding="same")),
    (SpatialSeparableConv2D, lambda: keras.layers.SeparableConv2D(4, 2, strides=2,
                                                                  padding="valid")),
    (SpatialSeparableConv2D, lambda: keras.layers.SeparableConv2D(4, 5, strides=2,
                                                                  padding="same")),
], ids=["dw3", "dw5s2", "dw3d2", "sep3", "sep2s2valid", "sep5s2"])
@pytest.mark.parametrize("traced", [False, True], ids=["eager", "traced"])
def test_layer_equals_keras_block_by_block(grid_of, cls, make, traced):
    grid = grid_of(world_size())
    k, r = grid.model_size, grid.model_rank
    x = tf.constant(rng("dw-layer").standard_normal((2, 8 * k, 12, 3))
                    .astype(np.float32))
    base = make()
    base(x)
    layer = cls.from_layer(base, split="height")
    rows = x.shape[1] // k

    def run(t):
        with tf.GradientTape() as tape:
            tape.watch(t)
            out = layer(t)
            loss = tf.reduce_sum(out * out)
        return out, tape.gradient(loss, [t] + layer.trainable_weights)

    run = tf.function(run) if traced else run
    out, grads = run(x[:, r * rows:(r + 1) * rows])
    with tf.GradientTape() as tape:
        tape.watch(x)
        full = base(x)
        loss = tf.reduce_sum(full * full)
    want = tape.gradient(loss, [x] + base.trainable_weights)
    out_rows = full.shape[1] // k
    np.testing.assert_allclose(out.numpy(), full[:, r * out_rows:(r + 1) * out_rows].numpy(),
                               rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(grads[0].numpy(), want[0][:, r * rows:(r + 1) * rows].numpy(),
                               rtol=1e-5, atol=1e-5)
    for mine, whole in zip(grads[1:], want[1:]):     # partial sums over the blocks
        summed = tfhybrid.comm.backend.allreduce(mine, tuple(grid.model_group_ranks(
            grid.data_rank)), f"dwtest.{cls.__name__}.{base.name}.{traced}")
        np.testing.assert_allclose(summed.numpy(), whole.numpy(), rtol=1e-4, atol=1e-5)
