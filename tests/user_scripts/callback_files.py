"""Callbacks that write files: CSVLogger, TensorBoard and a user's own, under ``d``.

    python callback_files.py OUT                        # one plain Keras process
    horovodrun -np 2 --gloo python callback_files.py OUT

The script passes ``keras.callbacks.CSVLogger(OUT/log.csv)`` and
``keras.callbacks.TensorBoard(OUT/tb)`` to ``fit`` on every rank (tfhybrid
runs them on rank 0 only), and, the Horovod way, its own callback that
appends each epoch's logs to ``OUT/epochs.jsonl`` on rank 0 only. After
``fit``, rank 0 (or the plain process) reads back the scalars TensorBoard
wrote and reports them with the history; the test compares the files'
numbers with one process's and counts the files and lines (each written
once, not once per rank).
"""
import glob
import json
import os
import sys

import keras
import numpy as np
import tensorflow as tf

OUT = sys.argv[1] if len(sys.argv) > 1 else "."
DIST = int(os.environ.get("HOROVOD_SIZE", "1")) > 1    # under horovodrun; else plain Keras
if DIST:
    import tfhybrid

BATCH, EPOCHS = 16, 3


class EpochLog(keras.callbacks.Callback):
    """Appends one JSON line per epoch: the epoch's logs."""

    def __init__(self, path):
        super().__init__()
        self.path = path

    def on_epoch_end(self, epoch, logs=None):
        with open(self.path, "a") as f:
            f.write(json.dumps({"epoch": epoch, **{k: float(v) for k, v in logs.items()}}) + "\n")


def make_model():
    keras.utils.set_random_seed(6)
    inputs = keras.Input((8,), name="x")
    h = keras.layers.Dense(16, activation="relu", name="fc1")(inputs)
    return keras.Model(inputs, keras.layers.Dense(3, name="out")(h), name="logged")


def data(rows, seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, 8)).astype("float32")
    y = np.argmax(x[:, :3], axis=1).astype("int64")
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH, drop_remainder=True)


def tensorboard_scalars(logdir):
    """{run: {tag: [value per epoch]}} from the event files under ``logdir``."""
    found = {}
    for path in sorted(glob.glob(os.path.join(logdir, "*", "events.out.tfevents.*"))):
        run = os.path.basename(os.path.dirname(path))
        for event in tf.compat.v1.train.summary_iterator(path):
            for value in event.summary.value:
                if value.tag.startswith("epoch_"):
                    found.setdefault(run, {}).setdefault(value.tag, []).append(
                        float(tf.make_ndarray(value.tensor)))
    return found


if DIST:
    tfhybrid.init()
model = make_model()
optimizer = keras.optimizers.SGD(0.1)
if DIST:
    model = tfhybrid.transform(model, strategy="d")
    optimizer = tfhybrid.DistributedOptimizer(optimizer)
model.compile(optimizer=optimizer,
              loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
              metrics=["accuracy"])
train, val = data(96, 0), data(32, 1)
if DIST:
    train, val = (tfhybrid.data.shard(d, model=model) for d in (train, val))
callbacks = [keras.callbacks.CSVLogger(os.path.join(OUT, "log.csv")),
             keras.callbacks.TensorBoard(os.path.join(OUT, "tb"))]
if DIST:
    callbacks = tfhybrid.callbacks.standard() + callbacks
if not DIST or tfhybrid.is_root():
    callbacks.append(EpochLog(os.path.join(OUT, "epochs.jsonl")))
history = model.fit(train, validation_data=val, epochs=EPOCHS, verbose=0, callbacks=callbacks)
root = not DIST or tfhybrid.is_root()
print("RESULT " + json.dumps({
    "rank": tfhybrid.rank() if DIST else 0,
    "history": {k: [float(v) for v in vs] for k, vs in history.history.items()},
    "tensorboard": tensorboard_scalars(os.path.join(OUT, "tb")) if root else None}), flush=True)
