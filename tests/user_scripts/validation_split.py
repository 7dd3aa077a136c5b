"""``fit(x, y, validation_split=0.25)`` on numpy arrays, as a user writes it.

    python validation_split.py OUT                        # one plain Keras process
    horovodrun -np 2 --gloo python validation_split.py OUT

Two forms under ``d``:

- ``whole``: every rank passes the whole arrays (Keras holds out the last
  quarter of the rows and shuffles the rest each epoch with the script's
  seed), as in one process;
- ``sharded``: ``tfhybrid.data.shard((x, y), batch_size=16, model=model)``
  gives each rank its block of every global batch, ``fit`` gets
  ``batch_size=16 // blocks`` and ``shuffle=False``; 8 global batches, so
  the last quarter of every rank's rows are the blocks of the last 2 global
  batches: the same validation rows as one process's split.

Every rank prints one ``RESULT {json}`` per form with the history (loss,
accuracy, val_loss, val_accuracy per epoch); rank 0 (or the plain process)
writes ``OUT/weights_<form>.npz``.
"""
import warnings

import keras
import numpy as np

from script_report import DIST, full_model, report

if DIST:
    import tfhybrid

BATCH, EPOCHS, ROWS = 16, 3, 128


def make_model():
    keras.utils.set_random_seed(8)
    inputs = keras.Input((8,), name="x")
    h = keras.layers.Dense(16, activation="relu", name="fc1")(inputs)
    return keras.Model(inputs, keras.layers.Dense(3, name="out")(h), name="split")


rng = np.random.default_rng(0)
x = rng.standard_normal((ROWS, 8)).astype("float32")
y = np.argmax(x[:, :3] + 0.3 * x[:, 3:6], axis=1).astype("int64")


def run(form):
    model = make_model()
    optimizer = keras.optimizers.SGD(0.1)
    if DIST:
        model = tfhybrid.transform(model, strategy="d")
        optimizer = tfhybrid.DistributedOptimizer(optimizer)
    model.compile(optimizer=optimizer,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    callbacks = tfhybrid.callbacks.standard() if DIST else None
    keras.utils.set_random_seed(80)            # the order fit shuffles the rows in
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if form == "whole":
            history = model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, validation_split=0.25,
                                verbose=0, callbacks=callbacks)
        else:
            xs, ys, batch = x, y, BATCH
            if DIST:
                xs, ys = tfhybrid.data.shard((x, y), batch_size=BATCH, model=model)
                batch = BATCH // tfhybrid.data.batch_split(model)[0]
            history = model.fit(xs, ys, batch_size=batch, epochs=EPOCHS, validation_split=0.25,
                                shuffle=False, verbose=0, callbacks=callbacks)
    report(full_model(model), f"weights_{form}.npz", history, form=form,
           warnings=sorted({str(w.message)[:200] for w in caught
                            if "tfhybrid" in str(w.message)}))


if DIST:
    tfhybrid.init()
for form in ("whole", "sharded"):
    run(form)
