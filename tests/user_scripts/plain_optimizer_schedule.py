"""A plain Keras optimizer with a ``LearningRateSchedule``, compiled after ``transform``.

    python plain_optimizer_schedule.py OUT                        # one plain Keras process
    horovodrun -np 2 --gloo python plain_optimizer_schedule.py OUT

The script forgets ``tfhybrid.DistributedOptimizer``: it compiles the
``df`` model (``init(model_parallel=2)``) with
``keras.optimizers.SGD(ExponentialDecay(0.2, decay_steps=3, decay_rate=0.5),
momentum=0.5)``. tfhybrid's ``compile`` wraps it in a DistributedOptimizer,
with a warning on rank 0 only. The schedule must step once per global batch
as in one process. Every rank prints ``RESULT {json}``: the history, the
optimizer's iterations and current learning rate, and the tfhybrid warnings
it caught; rank 0 (or the plain process) writes ``OUT/weights.npz``.
"""
import warnings

import keras
import numpy as np
import tensorflow as tf

from script_report import DIST, full_model, report

if DIST:
    import tfhybrid

BATCH, EPOCHS = 16, 3


def make_model():
    keras.utils.set_random_seed(13)
    inputs = keras.Input((8,), name="x")
    h = keras.layers.Dense(16, activation="relu", name="fc1")(inputs)
    h = keras.layers.Dense(8, activation="relu", name="fc2")(h)
    return keras.Model(inputs, keras.layers.Dense(4, name="out")(h), name="scheduled")


def data(rows, seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, 8)).astype("float32")
    y = np.argmax(x[:, :3] * 2 - x[:, 3:6], axis=1).astype("int64")
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH, drop_remainder=True)


if DIST:
    tfhybrid.init(model_parallel=2)
model = make_model()
if DIST:
    model = tfhybrid.transform(model, strategy="df")
schedule = keras.optimizers.schedules.ExponentialDecay(0.2, decay_steps=3, decay_rate=0.5)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    model.compile(optimizer=keras.optimizers.SGD(schedule, momentum=0.5),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
train, val = data(96, 0), data(32, 1)
if DIST:
    train, val = (tfhybrid.data.shard(d, model=model) for d in (train, val))
history = model.fit(train, validation_data=val, epochs=EPOCHS, verbose=0,
                    callbacks=tfhybrid.callbacks.standard() if DIST else None)
scores = model.evaluate(val, verbose=0, return_dict=True)
opt = model.optimizer
report(full_model(model), history=history, scores=scores,
       optimizer=type(opt).__name__, iterations=int(opt.iterations.numpy()),
       learning_rate=float(schedule(opt.iterations).numpy()),
       warnings=sorted({str(w.message)[:300] for w in caught
                        if "DistributedOptimizer" in str(w.message)}))
