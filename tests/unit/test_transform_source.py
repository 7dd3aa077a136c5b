"""What gather needs, recorded and checked by transform.

Models with Lambda layers (Python lambdas using globals, named functions),
unregistered custom layers and custom activation functions are ones Keras
alone cannot rebuild in ``gather`` (Keras' safe mode, classes and functions
it cannot locate). In the process that built the model they transform and
gather to the same function; what cannot be rebuilt is refused at
transform time (see test_bad_input_catalogue.py).
"""
import keras
import numpy as np
import pytest

import tfhybrid

SCALE = np.float32(3.0)


def double(t):
    return t * 2


def my_activation(t):
    return keras.ops.relu(t) - 0.5


class AddOne(keras.layers.Layer):   # not registered
    def call(self, x):
        return x + 1


class Scale(keras.layers.Layer):    # not registered, with an argument
    def __init__(self, k=2.0, **kwargs):
        super().__init__(**kwargs)
        self.k = k

    def get_config(self):
        return {**super().get_config(), "k": self.k}

    def call(self, x):
        return x * self.k


def _model(layer):
    i = keras.Input((6,))
    x = keras.layers.Dense(8, name="fc1")(i)
    x = layer(x)
    return keras.Model(i, keras.layers.Dense(4, name="out")(x), name="m")


CASES = {
    "lambda-with-globals": lambda: keras.layers.Lambda(lambda t: keras.ops.relu(t) * SCALE,
                                                       name="lam"),
    "lambda-named-function": lambda: keras.layers.Lambda(double, name="dbl"),
    "lambda-with-output-shape": lambda: keras.layers.Lambda(lambda t: t[:, :4],
                                                            output_shape=lambda s: s[:-1] + (4,),
                                                            name="crop"),
    "custom-layer": lambda: AddOne(name="add1"),
    "custom-layer-with-argument": lambda: Scale(3.0, name="scale"),
    "custom-activation": lambda: keras.layers.Dense(8, activation=my_activation, name="act"),
    "nested-model-with-lambda": lambda: keras.Sequential(
        [keras.Input((8,)), keras.layers.Lambda(lambda t: t * SCALE, name="inner_lam")],
        name="inner"),
}


@pytest.mark.parametrize("make", CASES.values(), ids=list(CASES))
def test_gather_rebuilds_what_keras_alone_could_not(make):
    model = _model(make())
    x = np.random.default_rng(0).standard_normal((3, 6)).astype("float32")
    pmodel = tfhybrid.transform(model, "d")
    np.testing.assert_allclose(pmodel(x), model(x), rtol=1e-6)
    full = tfhybrid.gather(pmodel)
    np.testing.assert_allclose(full(x), model(x), rtol=1e-6)
    assert not any(type(layer).__module__.startswith("tfhybrid") for layer in full.layers)


def test_lambda_model_transforms_to_a_sharded_strategy():
    model = _model(keras.layers.Lambda(lambda t: keras.ops.tanh(t) * SCALE, name="lam"))
    x = np.ones((2, 6), "float32")
    full = tfhybrid.gather(tfhybrid.transform(model, "f", fallback="replicate"))
    np.testing.assert_allclose(full(x), model(x), rtol=1e-6)
