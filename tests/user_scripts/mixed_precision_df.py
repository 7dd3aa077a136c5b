"""Mixed precision under ``df``, as a user writes it.

    python mixed_precision_df.py OUT                        # one plain Keras process
    horovodrun -np 2 --gloo python mixed_precision_df.py OUT

The script sets ``keras.mixed_precision.set_global_policy("mixed_float16")``
before building an MLP whose last layer computes in float32, trains it
3 epochs with SGD (Keras wraps it in its dynamic loss scaling; tfhybrid's
compile puts the scaling inside the DistributedOptimizer), validates and
evaluates. Under horovodrun it runs ``init(model_parallel=2)`` and
``transform(model, "df")``. Every rank prints ``RESULT {json}`` with the
history, the evaluation and the loss scale; rank 0 (or the plain process)
writes the trained weights to ``OUT/weights.npz``.
"""

import keras
import numpy as np
import tensorflow as tf

from script_report import DIST, full_model, report

if DIST:
    import tfhybrid

BATCH, EPOCHS = 16, 3


def make_model():
    keras.utils.set_random_seed(1)
    inputs = keras.Input((12,), name="features")
    x = keras.layers.Dense(32, activation="relu", name="fc1")(inputs)
    x = keras.layers.Dense(16, activation="relu", name="fc2")(x)
    outputs = keras.layers.Dense(4, dtype="float32", name="logits")(x)   # float32 head
    return keras.Model(inputs, outputs, name="mixed")


def data(rows, seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, 12)).astype("float32")
    y = np.argmax(x[:, :4] + 0.5 * x[:, 4:8], axis=1).astype("int64")
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH, drop_remainder=True)


keras.mixed_precision.set_global_policy("mixed_float16")
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
history = model.fit(train, validation_data=val, epochs=EPOCHS, verbose=0,
                    callbacks=tfhybrid.callbacks.standard() if DIST else None)
scores = model.evaluate(val, verbose=0, return_dict=True)
opt = model.optimizer          # LossScaleOptimizer, or DistributedOptimizer(LossScaleOptimizer)
while not hasattr(opt, "dynamic_scale") and hasattr(opt, "inner_optimizer"):
    opt = opt.inner_optimizer
scale = getattr(opt, "dynamic_scale", None)
report(full_model(model), history=history, scores=scores,
       policy=keras.mixed_precision.global_policy().name,
       compute_dtype=model.get_layer("fc1").compute_dtype,
       loss_scale=None if scale is None else float(scale.numpy()))
