"""An unregistered custom layer with weights under ``df`` with ``fallback="replicate"``.

    python custom_layer_replicated.py OUT                        # one plain Keras process
    horovodrun -np 2 --gloo python custom_layer_replicated.py OUT
    horovodrun -np 4 --gloo python custom_layer_replicated.py OUT

``ScaleShift`` (a per-feature gain and bias, ``keras.layers.Layer`` subclass
written in the script, not registered) sits between Dense layers that ``df``
splits. ``transform`` cannot partition a layer it does not know, and refuses
it unless ``fallback="replicate"``, which keeps it whole on every rank of a
model group. The script first checks the refusal (under horovodrun), then
trains 3 epochs with SGD and evaluates. Every rank prints ``RESULT {json}``
with the history, ``evaluate`` and the refusal's message; rank 0 (or the
plain process) writes ``OUT/weights.npz`` (the custom layer's gain and bias
included).
"""

import keras
import numpy as np
import tensorflow as tf

from script_report import DIST, full_model, report

if DIST:
    import tfhybrid

BATCH, EPOCHS = 16, 3


class ScaleShift(keras.layers.Layer):
    """x * gain + bias, one gain and bias per feature."""

    def build(self, input_shape):
        self.gain = self.add_weight(shape=(input_shape[-1],), initializer="ones", name="gain")
        self.bias = self.add_weight(shape=(input_shape[-1],), initializer="zeros", name="bias")

    def call(self, x):
        return x * self.gain + self.bias


def make_model():
    keras.utils.set_random_seed(5)
    inputs = keras.Input((8,), name="x")
    h = keras.layers.Dense(16, activation="tanh", name="fc1")(inputs)
    h = ScaleShift(name="scale_shift")(h)
    h = keras.layers.Dense(8, activation="relu", name="fc2")(h)
    return keras.Model(inputs, keras.layers.Dense(4, name="out")(h), name="custom_weights")


def data(rows, seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, 8)).astype("float32")
    y = np.argmax(x[:, :3] - x[:, 5:8], axis=1).astype("int64")
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH, drop_remainder=True)


refusal = None
if DIST:
    tfhybrid.init(model_parallel=2)
model = make_model()
optimizer = keras.optimizers.SGD(0.2)
if DIST:
    try:
        tfhybrid.transform(model, strategy="df")
    except ValueError as err:
        refusal = str(err)
    model = tfhybrid.transform(model, strategy="df", fallback="replicate")
    optimizer = tfhybrid.DistributedOptimizer(optimizer)
model.compile(optimizer=optimizer,
              loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
              metrics=["accuracy"])
train, val = data(96, 0), data(32, 1)
if DIST:
    train, val = (tfhybrid.data.shard(d, model=model) for d in (train, val))
history = model.fit(train, validation_data=val, epochs=EPOCHS, verbose=0,
                    callbacks=tfhybrid.callbacks.standard() if DIST else None)
scores = model.evaluate(val, verbose=0, return_dict=True)
report(full_model(model), history=history, scores=scores, refusal=refusal)
