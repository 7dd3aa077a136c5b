"""Single-process checks of the model-parallel layers (groups of one rank).

Construction, argument validation and error messages, config and
``.keras`` round trips, ``from_layer``/``to_layer``, and equality with the
Keras layers they replace when the group has one rank. The multi-rank
behaviour is tested under horovodrun in tests/parallel/test_layers_*.py.
"""
import json

import keras
import numpy as np
import pytest

from tfhybrid.process_grid import Group
from tfhybrid.layers import (ChannelParallelConv2D, ChannelParallelConv3D, ChannelParallelDense,
                             FilterParallelConv2D, FilterParallelConv3D, FilterParallelDense,
                             ModuloInverseLayer, ModuloLayer, ShardLayer, SyncBatchNormalization)
from tfhybrid.layout import layout_of

RNG = np.random.default_rng(0)
ALL = [FilterParallelDense, ChannelParallelDense, FilterParallelConv2D, ChannelParallelConv2D,
       FilterParallelConv3D, ChannelParallelConv3D, ShardLayer, ModuloLayer, ModuloInverseLayer,
       SyncBatchNormalization]


def built(layer, shape):
    layer.build(shape)
    layer.set_weights([RNG.standard_normal(w.shape).astype("float32") for w in layer.weights])
    return layer


@pytest.mark.parametrize("cls", ALL)
def test_registered_and_not_jit(cls):
    assert isinstance(cls.supports_jit, property)   # instances always report False (NoXLA)
    name = keras.saving.get_registered_name(cls)
    assert name == f"tfhybrid>{cls.__name__}"


@pytest.mark.parametrize("cls,source,shape", [
    (FilterParallelDense, keras.layers.Dense(6, activation="relu"), (None, 4)),
    (ChannelParallelDense, keras.layers.Dense(6, use_bias=False), (None, 4)),
    (FilterParallelConv2D, keras.layers.Conv2D(6, 3, strides=2, padding="same"),
     (None, 7, 7, 4)),
    (ChannelParallelConv2D, keras.layers.Conv2D(6, (3, 1), dilation_rate=2, activation="tanh"),
     (None, 7, 7, 4)),
    (FilterParallelConv3D, keras.layers.Conv3D(6, 3, strides=(2, 1, 1), padding="same"),
     (None, 5, 6, 6, 4)),
    (ChannelParallelConv3D, keras.layers.Conv3D(6, (3, 1, 2), dilation_rate=(1, 2, 1),
                                                activation="tanh"), (None, 5, 7, 6, 4)),
])
def test_one_rank_group_equals_keras_layer(cls, source, shape):
    source = built(source, shape)
    layer = cls.from_layer(source)
    x = RNG.standard_normal((2,) + shape[1:]).astype("float32")
    np.testing.assert_allclose(layer(x), source(x), rtol=1e-6, atol=1e-6)
    assert layer.compute_output_shape((2,) + shape[1:]) == tuple(source(x).shape)
    plain = layer.to_layer()
    assert type(plain) is type(source) and plain.get_config() == source.get_config()
    clone = cls.from_config(layer.get_config())
    assert clone.get_config() == layer.get_config()


def test_group_object_is_serialized():
    g = Group("h", (0,), 0)
    layer = FilterParallelDense(4, group=g)
    config = layer.get_config()
    assert config["group"] == {"name": "h", "ranks": [0], "index": 0}
    assert FilterParallelDense.from_config(config).group == g
    layer.build((None, 3))
    assert layout_of(layer.kernel).group == g


def _json(config):
    return json.loads(json.dumps(config))


def test_save_load_model_with_every_layer(tmp_path):
    body = keras.Sequential([FilterParallelDense(8, input_layout="replicated_partial_grad",
                                                 output_layout="split"),
                             ChannelParallelDense(4, input_layout="split")])
    model = keras.Sequential([
        keras.Input((6, 6, 2)),
        FilterParallelConv2D(4, 3, output_layout="split"),
        ChannelParallelConv2D(4, 3, input_layout="split", activation="relu"),
        SyncBatchNormalization(groups=("data", "model")),
        keras.layers.Flatten(),
        ModuloLayer("BK"),
        FilterParallelDense(8, input_layout="replicated_partial_grad", output_layout="split"),
        ShardLayer(),
        ModuloInverseLayer(input_layout="replicated_partial_grad"),
        ModuloLayer("B/K", body=body),
    ])
    x = RNG.standard_normal((4, 6, 6, 2)).astype("float32")
    path = str(tmp_path / "all.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    assert [type(a) for a in loaded.layers] == [type(b) for b in model.layers]
    assert [_json(a.get_config()) for a in loaded.layers] == \
        [_json(b.get_config()) for b in model.layers]
    np.testing.assert_allclose(loaded(x), model(x), rtol=1e-6, atol=1e-6)


# -- error messages ---------------------------------------------------------------

@pytest.mark.parametrize("make,pattern", [
    (lambda: FilterParallelDense(0, name="d"), r"'d'.*`units`.*Received: units=0"),
    (lambda: ChannelParallelDense("8"), r"`units`.*Received: units='8'"),
    (lambda: FilterParallelConv2D(-1, 3), r"`filters`.*Received: filters=-1"),
    (lambda: FilterParallelConv2D(4, (3, 3, 3)), r"`kernel_size`.*\(3, 3, 3\)"),
    (lambda: FilterParallelDense(4, input_layout="split"),
     r"`input_layout`: input_layout='split'; expected one of"),
    (lambda: ChannelParallelDense(4, output_layout="split"),
     r"`output_layout`: output_layout='split'"),
    (lambda: FilterParallelConv2D(4, 3, activation="softmax", output_layout="split"),
     r"activation='softmax' mixes the channel axis"),
    (lambda: ChannelParallelConv2D(4, 3, activation="relu", output_layout="partial"),
     r"output_layout='partial' .* activation='relu'"),
    (lambda: ChannelParallelConv2D(4, 3, data_format="channels_first"),
     r"data_format='channels_first'"),
    (lambda: FilterParallelConv2D(4, 3, padding="causal"), r"padding='causal'"),
    (lambda: ModuloLayer("B/K", name="m"), r"'m': scheme='B/K' .*pass body="),
    (lambda: ModuloLayer("BK", output_layout="split"), r"`output_layout`: output_layout='split'"),
    (lambda: ShardLayer(axis="x"), r"`axis`.*Received: axis='x'"),
    (lambda: SyncBatchNormalization(synchronized=True), r"synchronized=True"),
    (lambda: SyncBatchNormalization(groups=()), r"groups=\(\)"),
])
def test_argument_errors(make, pattern):
    with pytest.raises(ValueError, match=pattern):
        make()


def test_from_layer_errors():
    with pytest.raises(ValueError, match=r"FilterParallelDense.from_layer: layer 'raw' is not "
                                         r"built.*Build it first"):
        FilterParallelDense.from_layer(keras.layers.Dense(4, name="raw"))
    with pytest.raises(TypeError, match=r"expects a keras.layers.Conv2D; received Dense 'dd'"):
        FilterParallelConv2D.from_layer(built(keras.layers.Dense(4, name="dd"), (None, 3)))
    with pytest.raises(ValueError, match=r"layer 'bn' is not built"):
        SyncBatchNormalization.from_layer(keras.layers.BatchNormalization(name="bn"))
    with pytest.raises(TypeError, match=r"expects a keras.layers.BatchNormalization"):
        SyncBatchNormalization.from_layer(keras.layers.Dense(3))


def test_b_over_k_needs_divisible_batch_even_for_one_rank_is_fine():
    layer = ModuloLayer("B/K", body=keras.layers.Dense(2))
    assert layer(np.ones((3, 4), "float32")).shape == (3, 2)
