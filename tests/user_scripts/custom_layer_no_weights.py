"""An unregistered custom layer without weights in a model under ``df``.

    python custom_layer_no_weights.py OUT                        # one plain Keras process
    horovodrun -np 2 --gloo python custom_layer_no_weights.py OUT

``ScaledSwish`` is a ``keras.layers.Layer`` subclass written in the script
(no ``Lambda``, not registered as serializable) with a constructor argument
kept by ``get_config``; it sits between two Dense layers that ``df`` splits.
The script trains 3 epochs, evaluates, and gathers the model (which rebuilds
it from the class in this process). Every rank prints ``RESULT {json}``
with the history, ``evaluate`` and the gathered model's custom layer's
config; rank 0 (or the plain process) writes ``OUT/weights.npz``.
"""

import keras
import numpy as np
import tensorflow as tf

from script_report import DIST, full_model, report

if DIST:
    import tfhybrid

BATCH, EPOCHS = 16, 3


class ScaledSwish(keras.layers.Layer):
    """x * sigmoid(beta * x): element-wise, no weights."""

    def __init__(self, beta=1.5, **kwargs):
        super().__init__(**kwargs)
        self.beta = beta

    def call(self, x):
        return x * keras.ops.sigmoid(self.beta * x)

    def get_config(self):
        return {**super().get_config(), "beta": self.beta}


def make_model():
    keras.utils.set_random_seed(4)
    inputs = keras.Input((8,), name="x")
    h = keras.layers.Dense(16, name="fc1")(inputs)
    h = ScaledSwish(beta=1.5, name="swish")(h)
    h = keras.layers.Dense(8, activation="relu", name="fc2")(h)
    return keras.Model(inputs, keras.layers.Dense(4, name="out")(h), name="custom_act")


def data(rows, seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, 8)).astype("float32")
    y = np.argmax(x[:, :3] * x[:, 3:6], axis=1).astype("int64")
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH, drop_remainder=True)


if DIST:
    tfhybrid.init(model_parallel=2)
model = make_model()
optimizer = keras.optimizers.SGD(0.1)
if DIST:
    model = tfhybrid.transform(model, strategy="df")
    optimizer = tfhybrid.DistributedOptimizer(optimizer)
model.compile(optimizer=optimizer,
              loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
              metrics=["accuracy"])
train, val = data(96, 0), data(32, 1)
if DIST:
    train, val = (tfhybrid.data.shard(d, model=model) for d in (train, val))
history = model.fit(train, epochs=EPOCHS, verbose=0,
                    callbacks=tfhybrid.callbacks.standard() if DIST else None)
scores = model.evaluate(val, verbose=0, return_dict=True)
full = full_model(model)
swish = full.get_layer("swish")
report(full, history=history, scores=scores,
       gathered_layer=[type(swish).__name__, swish.beta])
