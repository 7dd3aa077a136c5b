"""Every tfhybrid layer instance reports supports_jit=False (Horovod ops cannot run
in XLA), so Keras' jit_compile="auto" never compiles a transformed model with XLA."""
import keras
import pytest
from keras.src.trainers.trainer import model_supports_jit

import tfhybrid
from tfhybrid import layers as L

INSTANCES = [
    lambda: L.FilterParallelDense(4), lambda: L.ChannelParallelDense(4),
    lambda: L.FilterParallelConv2D(4, 3), lambda: L.ChannelParallelConv2D(4, 3),
    lambda: L.FilterParallelConv3D(4, 3), lambda: L.ChannelParallelConv3D(4, 3),
    lambda: L.ShardLayer(), lambda: L.ModuloLayer(), lambda: L.ModuloInverseLayer(),
    lambda: L.SyncBatchNormalization(), lambda: L.SpatialConv2D(4, 3),
    lambda: L.SpatialConv3D(4, 3), lambda: L.SpatialMaxPooling2D(),
    lambda: L.SpatialAveragePooling2D(), lambda: L.SpatialMaxPooling3D(),
    lambda: L.SpatialAveragePooling3D(), lambda: L.SpatialScatter(), lambda: L.SpatialGather(),
    lambda: L.SpatialZeroPadding2D(1), lambda: L.SpatialCropping2D(1),
    lambda: L.SpatialCropping3D(1), lambda: L.SpatialZeroPadding3D(1),
    lambda: L.SpatialConv2DTranspose(4, 2), lambda: L.SpatialConv3DTranspose(4, 2),
    lambda: L.SpatialGroupNormalization(groups=2), lambda: L.SpatialDepthwiseConv2D(3),
    lambda: L.SpatialSeparableConv2D(4, 3), lambda: L.SpatialUpSampling2D(2),
    lambda: L.SpatialGlobalAveragePooling2D(), lambda: L.SpatialGlobalAveragePooling3D(),
    lambda: L.SpatialGlobalMaxPooling2D(), lambda: L.SpatialGlobalMaxPooling3D(),
]


@pytest.mark.parametrize("make", INSTANCES, ids=lambda f: f.__code__.co_names[-1])
def test_instances_report_no_jit_even_after_assignment(make):
    layer = make()
    assert layer.supports_jit is False
    layer.supports_jit = True      # what keras.layers.Layer.__init__ does
    assert layer.supports_jit is False


def test_every_exported_layer_is_covered():
    exported = {n for n in dir(L) if isinstance(getattr(L, n), type)
                and issubclass(getattr(L, n), keras.layers.Layer)}
    covered = {type(make()).__name__ for make in INSTANCES}
    assert exported == covered


@pytest.mark.parametrize("strategy", ["f", "s"])
def test_transformed_model_does_not_support_jit(strategy):
    tfhybrid.shutdown()
    tfhybrid.init(model_parallel=1)
    model = keras.Sequential([keras.Input((8, 8, 3)), keras.layers.Conv2D(4, 3, padding="same"),
                              keras.layers.Flatten(), keras.layers.Dense(2)])
    assert model_supports_jit(model)
    assert not model_supports_jit(tfhybrid.transform(model, strategy))
    tfhybrid.shutdown()
