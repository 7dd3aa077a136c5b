"""``ReduceLROnPlateau`` and ``EarlyStopping`` driven by validation metrics.

    python plateau_early_stop.py OUT                        # one plain Keras process
    horovodrun -np 2 --gloo python plateau_early_stop.py OUT

A small noisy problem that overfits under ``df`` (``init(model_parallel=2)``):
``ReduceLROnPlateau(monitor="val_loss", factor=0.5, patience=1, min_delta=0.01)``
halves the learning rate when the validation loss improves by less than 0.01 and
``EarlyStopping(monitor="val_accuracy", patience=2, restore_best_weights=True)``
ends training, up to 12 epochs. Every rank prints ``RESULT {json}``: the
history (with the learning rate per epoch), the epoch training stopped at,
the final learning rate and ``evaluate`` of the restored weights; rank 0 (or
the plain process) writes ``OUT/weights.npz``.
"""

import keras
import numpy as np
import tensorflow as tf

from script_report import DIST, full_model, report

if DIST:
    import tfhybrid

BATCH, EPOCHS = 16, 12


def make_model():
    keras.utils.set_random_seed(11)
    inputs = keras.Input((8,), name="x")
    h = keras.layers.Dense(32, activation="relu", name="fc1")(inputs)
    h = keras.layers.Dense(16, activation="relu", name="fc2")(h)
    return keras.Model(inputs, keras.layers.Dense(2, name="out")(h), name="plateau")


def data(rows, seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, 8)).astype("float32")
    y = ((x[:, 0] + rng.standard_normal(rows)) > 0).astype("int64")      # noisy labels
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH, drop_remainder=True)


if DIST:
    tfhybrid.init(model_parallel=2)
model = make_model()
optimizer = keras.optimizers.SGD(0.3)
if DIST:
    model = tfhybrid.transform(model, strategy="df")
    optimizer = tfhybrid.DistributedOptimizer(optimizer)
model.compile(optimizer=optimizer,
              loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
              metrics=["accuracy"])
train, val = data(48, 0), data(32, 1)
if DIST:
    train, val = (tfhybrid.data.shard(d, model=model) for d in (train, val))
stop = keras.callbacks.EarlyStopping(monitor="val_accuracy", patience=2,
                                     restore_best_weights=True)
plateau = keras.callbacks.ReduceLROnPlateau(monitor="val_loss", factor=0.5, patience=1,
                                            min_delta=0.01)
callbacks = [plateau, stop]
if DIST:
    callbacks = tfhybrid.callbacks.standard() + callbacks
history = model.fit(train, validation_data=val, epochs=EPOCHS, verbose=0, callbacks=callbacks)
scores = model.evaluate(val, verbose=0, return_dict=True)
report(full_model(model), history=history, scores=scores,
       stopped_epoch=int(stop.stopped_epoch), best_epoch=int(stop.best_epoch),
       epochs_run=len(history.history["loss"]),
       final_learning_rate=float(keras.ops.convert_to_numpy(model.optimizer.learning_rate)))
