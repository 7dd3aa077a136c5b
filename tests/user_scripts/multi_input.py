"""A model with two inputs, as a user writes it.

    python multi_input.py OUT                        # one plain Keras process
    horovodrun -np 2 --gloo python multi_input.py OUT

A vector input and a small (4, 3) table, flattened and concatenated, then
FC layers; inputs given as a dict keyed by input name. Under horovodrun the
model is transformed with ``gmp`` (SplitBrain: the FC layers split in model
groups of 2, ``ccr_threshold=0`` so every FC layer is split, the batch split
over every rank). Every rank prints ``RESULT {json}`` with the history
(train and validation) and ``evaluate``; rank 0 (or the plain process) writes
``OUT/weights.npz``.
"""

import keras
import numpy as np
import tensorflow as tf

from script_report import DIST, full_model, report

if DIST:
    import tfhybrid

BATCH, EPOCHS = 16, 2


def make_model():
    keras.utils.set_random_seed(3)
    vec = keras.Input((6,), name="vec")
    table = keras.Input((4, 3), name="table")
    flat = keras.layers.Flatten(name="flat")(table)
    h = keras.layers.Concatenate(name="join")([vec, flat])
    h = keras.layers.Dense(16, activation="relu", name="fc1")(h)
    h = keras.layers.Dense(8, activation="relu", name="fc2")(h)
    return keras.Model({"vec": vec, "table": table}, keras.layers.Dense(4, name="out")(h),
                       name="two_inputs")


def data(rows, seed):
    rng = np.random.default_rng(seed)
    vec = rng.standard_normal((rows, 6)).astype("float32")
    table = rng.standard_normal((rows, 4, 3)).astype("float32")
    y = np.argmax(vec[:, :3] + table[:, 0, :], axis=1).astype("int64")
    return tf.data.Dataset.from_tensor_slices(
        ({"vec": vec, "table": table}, y)).batch(BATCH, drop_remainder=True)


if DIST:
    tfhybrid.init(model_parallel=2)
model = make_model()
optimizer = keras.optimizers.SGD(0.1)
if DIST:
    model = tfhybrid.transform(model, strategy="gmp", ccr_threshold=0)
    optimizer = tfhybrid.DistributedOptimizer(optimizer)
model.compile(optimizer=optimizer,
              loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
              metrics=["accuracy", keras.metrics.SparseTopKCategoricalAccuracy(2, name="top2")])
train, val = data(96, 0), data(32, 1)
if DIST:
    train, val = (tfhybrid.data.shard(d, model=model) for d in (train, val))
history = model.fit(train, validation_data=val, epochs=EPOCHS, verbose=0,
                    callbacks=tfhybrid.callbacks.standard() if DIST else None)
scores = model.evaluate(val, verbose=0, return_dict=True)
report(full_model(model), history=history, scores=scores)
