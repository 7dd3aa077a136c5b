"""Every parallel layer family speaks the same language: each layer
with a Keras counterpart has ``from_layer``/``to_layer`` that round-trip its
config, and ``group=`` takes a name or a ``tfhybrid.process_grid.Group`` in
every family (world of one process)."""
import os

import keras
import numpy as np
import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tfhybrid
from tfhybrid import layers as L

COUNTERPARTS = [
    (L.SpatialMaxPooling2D, keras.layers.MaxPooling2D(3, strides=2, padding="same"), (8, 8, 2)),
    (L.SpatialAveragePooling2D, keras.layers.AveragePooling2D(2), (8, 8, 2)),
    (L.SpatialMaxPooling3D, keras.layers.MaxPooling3D(2), (4, 4, 4, 2)),
    (L.SpatialAveragePooling3D, keras.layers.AveragePooling3D(2, padding="same"), (4, 4, 4, 2)),
    (L.SpatialZeroPadding2D, keras.layers.ZeroPadding2D(((1, 2), (0, 1))), (8, 8, 2)),
    (L.SpatialZeroPadding3D, keras.layers.ZeroPadding3D(1), (4, 4, 4, 2)),
    (L.SpatialCropping2D, keras.layers.Cropping2D(((1, 0), (2, 1))), (8, 8, 2)),
    (L.SpatialCropping3D, keras.layers.Cropping3D(1), (4, 4, 4, 2)),
    (L.SpatialConv2D, keras.layers.Conv2D(3, 3, padding="same"), (8, 8, 2)),
    (L.SpatialConv3D, keras.layers.Conv3D(3, 3, padding="same"), (4, 4, 4, 2)),
    (L.SpatialConv2DTranspose, keras.layers.Conv2DTranspose(3, 3, strides=2, padding="same"),
     (4, 4, 2)),
    (L.SpatialConv3DTranspose, keras.layers.Conv3DTranspose(3, 2, strides=2), (2, 2, 2, 2)),
    (L.FilterParallelDense, keras.layers.Dense(4), (6,)),
    (L.ChannelParallelDense, keras.layers.Dense(4), (6,)),
    (L.FilterParallelConv2D, keras.layers.Conv2D(4, 3), (8, 8, 2)),
    (L.ChannelParallelConv2D, keras.layers.Conv2D(4, 3), (8, 8, 2)),
    (L.FilterParallelConv3D, keras.layers.Conv3D(4, (3, 1, 2), strides=(1, 2, 1)), (4, 6, 6, 2)),
    (L.ChannelParallelConv3D, keras.layers.Conv3D(4, 3, padding="same"), (4, 4, 4, 2)),
    (L.SyncBatchNormalization, keras.layers.BatchNormalization(), (8, 8, 2)),
]


@pytest.fixture(autouse=True)
def world_of_one():
    tfhybrid.init()
    yield


@pytest.mark.parametrize("cls,layer,shape", COUNTERPARTS, ids=lambda v: getattr(v, "__name__", ""))
def test_from_layer_to_layer_round_trip(cls, layer, shape):
    x = np.random.default_rng(0).standard_normal((2,) + shape).astype(np.float32)
    want = np.asarray(layer(x))
    parallel = cls.from_layer(layer)
    np.testing.assert_allclose(np.asarray(parallel(x)), want, rtol=1e-5, atol=1e-6)
    plain = parallel.to_layer()
    assert type(plain) is type(layer)
    keep = {k: v for k, v in layer.get_config().items() if k not in ("name", "dtype")}
    got = {k: v for k, v in plain.get_config().items() if k in keep}
    assert got == keep
    np.testing.assert_allclose(np.asarray(plain(x)), want, rtol=1e-5, atol=1e-6)


def test_from_layer_refuses_the_wrong_keras_class():
    with pytest.raises(TypeError, match=r"SpatialMaxPooling2D.from_layer: .*keras.layers.MaxPool"):
        L.SpatialMaxPooling2D.from_layer(keras.layers.AveragePooling2D(2))


GROUP_TAKERS = [
    lambda g: L.SpatialMaxPooling2D(2, group=g),
    lambda g: L.SpatialConv2D(2, 3, group=g, kernel_initializer="ones"),
    lambda g: L.SpatialZeroPadding2D(1, group=g),
    lambda g: L.SpatialScatter(group=g),
    lambda g: L.FilterParallelDense(4, group=g, kernel_initializer="ones"),
    lambda g: L.ChannelParallelConv2D(4, 3, group=g, kernel_initializer="ones"),
    lambda g: L.ModuloLayer(group=g),
    lambda g: L.ShardLayer(group=g),
]


@pytest.mark.parametrize("make", GROUP_TAKERS)
def test_group_takes_a_name_or_a_group(make):
    by_name, by_group = make("model"), make(tfhybrid.grid().group("model"))
    x = np.ones((2, 4, 4, 2), np.float32)
    if isinstance(by_name, (L.FilterParallelDense,)):
        x = np.ones((2, 6), np.float32)
    np.testing.assert_allclose(np.asarray(by_group(x)), np.asarray(by_name(x)))
    clone = type(by_group).from_config(by_group.get_config())
    np.testing.assert_allclose(np.asarray(clone(x)).shape, np.asarray(by_name(x)).shape)


def test_spatial_group_must_be_a_grid_axis():
    odd = tfhybrid.process_grid.Group("mine", (0,), 0)
    with pytest.raises(ValueError, match=r"split over a whole axis of the process grid"):
        L.SpatialMaxPooling2D(2, group=odd)(np.ones((1, 4, 4, 1), np.float32))
