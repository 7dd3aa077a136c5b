"""More encoder-decoders under s/ds: a 3-D V-Net with PReLU, a UNet++ and a net
of normalisations, each wholly on blocks and equal to one process.

Run under ``horovodrun -np 2`` and ``-np 4``. ``PReLU`` (V-Net's
activation, one slope per channel with ``shared_axes=[1, 2, 3]``) has a
spatial rule: without one the region would end at the first PReLU and the
V-Net would run replicated from its first layer on (equal to one process,
but no layer split). Each
case: the layers that must run on blocks do (the output stays split), and
fit History and the gathered weights equal one process on the whole batches.
A PReLU with a slope per position (Keras' default) still gathers.
"""
import keras
import numpy as np
import pytest
import tensorflow as tf

import tfhybrid
from tfhybrid.transformer import gather

from conftest import reference_once, world_size
from spatial_fit import fit_like_one_process

N = world_size()
L = keras.layers
CLASSES = 3


def vnet():
    """V-Net style: 5^3 convolutions, PReLU per channel, residual Adds, a strided
    convolution down and a transposed one up, a Concatenate skip."""
    i = keras.Input((8, 8, 8, 1))
    x = L.PReLU(shared_axes=[1, 2, 3], name="a0")(L.Conv3D(4, 5, padding="same", name="c0")(i))
    s0 = L.Add(name="res0")([x, L.Conv3D(4, 1, name="proj0")(i)])
    d = L.PReLU(shared_axes=[1, 2, 3], name="a1")(L.Conv3D(8, 2, strides=2, name="down")(s0))
    d = L.Conv3D(8, 3, padding="same", activation="relu", name="c1")(d)
    u = L.Conv3DTranspose(4, 2, strides=2, name="up")(d)
    x = L.Conv3D(4, 3, padding="same", activation="relu", name="c2")(L.Concatenate()([u, s0]))
    return keras.Model(i, L.Conv3D(CLASSES, 1, activation="softmax", name="head")(x))


def unet_plus_plus():
    """UNet++: nested skips, a three-input Concatenate."""
    def conv(t, f, name):
        return L.Conv2D(f, 3, padding="same", activation="relu", name=name)(t)
    i = keras.Input((16, 16, 1))
    x00 = conv(i, 4, "x00")
    x10 = conv(L.MaxPooling2D(2)(x00), 8, "x10")
    x01 = conv(L.Concatenate()([x00, L.UpSampling2D()(x10)]), 4, "x01")
    x20 = conv(L.MaxPooling2D(2)(x10), 8, "x20")
    x11 = conv(L.Concatenate()([x10, L.UpSampling2D()(x20)]), 8, "x11")
    x02 = conv(L.Concatenate()([x00, x01, L.UpSampling2D()(x11)]), 4, "x02")
    return keras.Model(i, L.Conv2D(CLASSES, 1, activation="softmax", name="head")(x02))


def normalisations():
    """Instance norm (GroupNormalization(groups=-1)), LayerNormalization per
    voxel, swish/ELU, average pooling, a 3x3 stride-2 'same' transposed conv."""
    i = keras.Input((16, 16, 2))
    x = L.Conv2D(4, 3, padding="same", name="c0")(i)
    x = L.Activation("swish")(L.GroupNormalization(groups=-1, name="inorm")(x))
    x = L.Conv2D(8, 3, padding="same", name="c1")(L.AveragePooling2D(2)(x))
    x = L.ReLU()(L.LayerNormalization(name="lnorm")(x))
    x = L.Conv2DTranspose(4, 3, strides=2, padding="same", name="up")(x)
    x = L.Conv2D(4, 3, padding="same", activation="elu", name="c2")(x)
    return keras.Model(i, L.Conv2D(CLASSES, 1, activation="softmax", name="head")(x))


def _cases():
    cases = [("vnet", "s", N), ("unet_plus_plus", "s", N), ("normalisations", "s", N)]
    if N >= 4:
        cases += [("vnet", "ds", 2), ("normalisations", "ds", 2)]
    return cases


@pytest.mark.parametrize("name, strategy, mp", _cases(), ids=str)
def test_encoder_decoder_on_blocks_equals_one_process(name, strategy, mp):
    tfhybrid.shutdown()
    tfhybrid.init(model_parallel=mp)
    build = globals()[name]

    def make():
        keras.utils.set_random_seed(1)
        return build()

    source = make()
    r = np.random.default_rng(0)
    x = r.standard_normal((8,) + source.input_shape[1:]).astype(np.float32)
    y = r.integers(0, CLASSES, (8,) + source.output_shape[1:-1]).astype(np.int32)
    model = tfhybrid.transform(source, strategy)
    assert model._tfhybrid_split_outputs == (True,)
    on_blocks = {"vnet": ("a0", "a1"), "unet_plus_plus": ("x02",),
                 "normalisations": ("inorm", "lnorm", "up")}[name]
    for layer in on_blocks:          # PReLU/LayerNormalization: their weights partial
        assert getattr(model.get_layer(layer), "_tfhybrid_on_blocks", False), layer
    fit_like_one_process(model, make, x, y, lr=0.2, epochs=2, key=(name,))
    tfhybrid.shutdown()


def test_prelu_with_a_slope_per_position_gathers():
    tfhybrid.shutdown()
    tfhybrid.init(model_parallel=N)
    i = keras.Input((8, 8, 1))
    x = L.PReLU(name="act")(L.Conv2D(4, 3, padding="same", name="c0")(i))
    model = tfhybrid.transform(keras.Model(i, L.Conv2D(2, 3, padding="same")(x)), "s",
                               fallback="replicate")
    assert not any(getattr(model, "_tfhybrid_split_outputs", ()))
    assert not getattr(model.get_layer("act"), "_tfhybrid_on_blocks", False)
    tfhybrid.shutdown()


def deep_supervision():
    """A 3-D U-Net with a half-resolution side output (dict outputs: Keras orders
    them by name, so the half-resolution 'aux' comes first)."""
    i = keras.Input((8, 8, 8, 1))
    e0 = L.Conv3D(4, 3, padding="same", activation="relu", name="e0")(i)
    e1 = L.Conv3D(8, 3, padding="same", activation="relu", name="e1")(L.MaxPooling3D(2)(e0))
    aux = L.Conv3D(1, 1, activation="sigmoid", name="aux")(e1)
    x = L.Concatenate()([e0, L.UpSampling3D(2)(e1)])
    x = L.Conv3D(4, 3, padding="same", activation="relu", name="d0")(x)
    return keras.Model(i, {"main": L.Conv3D(1, 1, activation="sigmoid", name="main")(x),
                           "aux": aux})


@pytest.mark.parametrize("feed", ["shard", "numpy"])
def test_deep_supervision_outputs_of_two_resolutions(feed):
    """Labels of each split output are cut by that output's own block: the
    full-resolution labels' block has the half-resolution output's whole size,
    and were cut twice (a shape error in the loss) when 'aux' came first; labels
    of whole volumes fed to fit(x, y) were not cut for 'aux'."""
    tfhybrid.shutdown()
    tfhybrid.init(model_parallel=N)
    r = np.random.default_rng(2)
    x = r.standard_normal((8, 8, 8, 8, 1)).astype(np.float32)
    y = (r.random((8, 8, 8, 8, 1)) > 0.6).astype(np.float32)
    labels = {"main": y, "aux": y[:, ::2, ::2, ::2]}

    def compile_(model, optimizer):
        model.compile(optimizer=optimizer, loss={"main": keras.losses.Dice(),
                                                 "aux": keras.losses.BinaryCrossentropy()},
                      loss_weights={"main": 1.0, "aux": 0.4})

    def compute():
        keras.utils.set_random_seed(1)
        reference = deep_supervision()
        compile_(reference, keras.optimizers.SGD(0.5))
        want = reference.fit(x, labels, batch_size=4, epochs=2, shuffle=False, verbose=0).history
        return want, reference.get_weights(), [v.path for v in reference.weights]
    want, weights, paths = reference_once(compute, x, y)
    keras.utils.set_random_seed(1)
    model = tfhybrid.transform(deep_supervision(), "s")
    assert model._tfhybrid_split_outputs == (True, True)
    compile_(model, tfhybrid.DistributedOptimizer(keras.optimizers.SGD(0.5)))
    if feed == "shard":
        data = tfhybrid.data.shard(tf.data.Dataset.from_tensor_slices((x, labels)), model=model,
                                   batch_size=4)
        got = model.fit(data, epochs=2, verbose=0, callbacks=tfhybrid.callbacks.standard())
    else:
        got = model.fit(x, labels, batch_size=4, epochs=2, shuffle=False, verbose=0,
                        callbacks=tfhybrid.callbacks.standard())
    for key in want:
        np.testing.assert_allclose(got.history[key], want[key], rtol=2e-5, err_msg=key)
    for a, b, path in zip(gather(model).get_weights(), weights, paths):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6, err_msg=path)
    tfhybrid.shutdown()
