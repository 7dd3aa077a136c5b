"""SyncBatchNormalization against keras.layers.BatchNormalization on the full batch.

Each rank holds its own rows; the reference normalizes the rows of every
rank reached through ``groups`` at once. Outputs, gradients w.r.t. input,
gamma and beta (summed over the ranks, whose losses add up to the
reference loss), moving statistics and inference output must match.
"""
import keras
import numpy as np
import pytest
import tensorflow as tf

from tfhybrid.comm import backend, resolve_group
from tfhybrid.layers import SyncBatchNormalization
from tfhybrid.layout import layout_of

from conftest import model_parallel_values, randn
from layers_testing import FWD, GRAD, rank_path

MPS = model_parallel_values()
GROUPS = [("data",), ("model",), ("world",), ("data", "model")]


@pytest.fixture(params=MPS, ids=lambda m: f"mp{m}")
def grid(request, grid_of):
    return grid_of(request.param)


def reached(groups):
    """Sorted global ranks whose rows are normalized together with this rank's."""
    ranks = {backend.rank()}
    for name in groups:
        ranks = {m + r - resolve_group(name).ranks[resolve_group(name).index]
                 for r in ranks for m in resolve_group(name).ranks}
    return sorted(ranks)


def sum_over(value, groups, name):
    for g in map(resolve_group, groups):
        if g.size > 1:
            value = backend.allreduce(tf.constant(value), g.ranks, f"{name}.{g.name}").numpy()
    return value


def bn_pair(shape, **kwargs):
    ref = keras.layers.BatchNormalization(momentum=0.9, **kwargs)
    ref.build(shape)
    weights = [randn(w.shape, "bn", i) for i, w in enumerate(ref.weights)]
    weights[-1] = np.abs(weights[-1]) + 0.5                   # moving variance > 0
    ref.set_weights(weights)
    return ref


def run(layer, x, u, mode, training=True):
    def step(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = layer(x, training=training)
            loss = tf.reduce_sum(y * u)
        gx, *gw = tape.gradient(loss, [x] + layer.trainable_weights)
        return y, gx, gw
    if mode == "function":
        step = tf.function(step)
    y, gx, gw = step(tf.constant(x))
    return y.numpy(), gx.numpy(), [g.numpy() for g in gw]


@pytest.mark.parametrize("mode", ["eager", "function"])
@pytest.mark.parametrize("groups", GROUPS, ids="-".join)
@pytest.mark.parametrize("shape", [(3, 4, 5, 6), (5, 6)], ids=["4d", "2d"])
def test_sync_bn_equals_full_batch_bn(grid, groups, shape, mode):
    ranks = reached(groups)
    xs = {r: randn(shape, "x", r) * 3 + 1 for r in ranks}
    us = {r: randn(shape, "u", r) for r in ranks}
    ref = bn_pair((None,) + shape[1:])
    layer = SyncBatchNormalization.from_layer(ref, groups=groups)
    y_ref, dx_ref, dw_ref = run(ref, np.concatenate([xs[r] for r in ranks]),
                                np.concatenate([us[r] for r in ranks]), "eager")
    me = ranks.index(backend.rank())
    y, dx, dw = run(layer, xs[backend.rank()], us[backend.rank()], mode)
    np.testing.assert_allclose(y, np.split(y_ref, len(ranks))[me], **FWD)
    np.testing.assert_allclose(dx, np.split(dx_ref, len(ranks))[me], **GRAD)
    for i, (g, want) in enumerate(zip(dw, dw_ref)):                # gamma, beta
        np.testing.assert_allclose(sum_over(g, groups, f"test.dw{i}"), want, **GRAD)
    np.testing.assert_allclose(layer.moving_mean.numpy(), ref.moving_mean.numpy(), **FWD)
    np.testing.assert_allclose(layer.moving_variance.numpy(), ref.moving_variance.numpy(),
                               **FWD)
    y_inf = layer(xs[backend.rank()], training=False).numpy()
    np.testing.assert_allclose(y_inf, ref(xs[backend.rank()], training=False).numpy(), **FWD)


def test_center_scale_off_and_axis(grid):
    shape = (4, 6, 5)
    ranks = reached(("world",))
    xs = {r: randn(shape, "xa", r) for r in ranks}
    us = {r: randn(shape, "ua", r) for r in ranks}
    ref = keras.layers.BatchNormalization(axis=1, center=False, scale=False, epsilon=1e-2)
    ref.build((None, 6, 5))
    layer = SyncBatchNormalization.from_layer(ref, groups="world")
    y_ref, dx_ref, _ = run(ref, np.concatenate([xs[r] for r in ranks]),
                           np.concatenate([us[r] for r in ranks]), "eager")
    y, dx, _ = run(layer, xs[backend.rank()], us[backend.rank()], "function")
    me = ranks.index(backend.rank())
    np.testing.assert_allclose(y, np.split(y_ref, len(ranks))[me], **FWD)
    np.testing.assert_allclose(dx, np.split(dx_ref, len(ranks))[me], **GRAD)


def test_spatial_group_tags_gamma_beta_partial(grid):
    layer = SyncBatchNormalization(groups=("data", "model"), spatial_group="model")
    layer.build((None, 4, 4, 3))
    assert layout_of(layer.gamma).kind == "partial" and layout_of(layer.gamma).group == "model"
    assert layout_of(layer.beta).kind == "partial"
    plain = SyncBatchNormalization()
    plain.build((None, 3))
    assert layout_of(plain.gamma).kind == "replicated"


def test_spatially_split_images(grid):
    """Model group = height blocks of the same images, data group = different images."""
    g = grid.group("model")
    full = randn((2 * grid.data_size, 4 * g.size, 3, 2), "img")
    u = randn(full.shape, "uimg")
    ref = bn_pair((None, None, 3, 2))
    layer = SyncBatchNormalization.from_layer(ref, groups=("data", "model"),
                                              spatial_group="model")
    y_ref, dx_ref, dw_ref = run(ref, full, u, "eager")

    def mine(a):
        return np.split(np.split(a, grid.data_size)[grid.data_rank], g.size, axis=1)[g.index]

    y, dx, dw = run(layer, mine(full), mine(u), "function")
    np.testing.assert_allclose(y, mine(y_ref), **FWD)
    np.testing.assert_allclose(dx, mine(dx_ref), **GRAD)
    for i, (gr, want) in enumerate(zip(dw, dw_ref)):
        np.testing.assert_allclose(sum_over(gr, ("world",), f"test.sdw{i}"), want, **GRAD)


def test_from_layer_to_layer_config_and_save(grid, tmp_path):
    ref = bn_pair((None, 5), epsilon=1e-2)
    layer = SyncBatchNormalization.from_layer(ref, groups=("data", "model"))
    assert layer.get_config() == SyncBatchNormalization.from_config(layer.get_config()).get_config()
    back = layer.to_layer()
    assert type(back) is keras.layers.BatchNormalization
    assert back.get_config() == ref.get_config()
    for a, b in zip(back.get_weights(), ref.get_weights()):
        np.testing.assert_array_equal(a, b)
    model = keras.Sequential([keras.Input((5,)), layer])
    path = rank_path(tmp_path, "syncbn")
    model.save(path)
    loaded = keras.models.load_model(path)
    assert type(loaded.layers[0]) is SyncBatchNormalization
    assert loaded.layers[0].groups == ("data", "model")
    x = randn((4, 5), "sx", backend.rank())
    np.testing.assert_allclose(loaded(x, training=True), model(x, training=True), **FWD)


def test_errors(grid):
    with pytest.raises(ValueError, match=r"synchronized=True"):
        SyncBatchNormalization(synchronized=True)
    with pytest.raises(ValueError, match=r"received groups=\(\)"):
        SyncBatchNormalization(groups=())
    with pytest.raises(ValueError, match=r"layer 'raw' is not built"):
        SyncBatchNormalization.from_layer(keras.layers.BatchNormalization(name="raw"))
    if grid.data_size > 1:
        layer = SyncBatchNormalization(groups=("world", "data"), name="twice")
        with pytest.raises(ValueError, match=r"'twice': groups world .* and data .* share ranks"):
            layer(np.ones((2, 3), np.float32), training=True)
