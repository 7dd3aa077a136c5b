"""Unusual batch sizes, as a user writes them.

    python batch_sizes.py OUT [STRATEGY]                        # one plain Keras process
    horovodrun -np 2 --gloo python batch_sizes.py OUT d
    horovodrun -np 4 --gloo python batch_sizes.py OUT df        # model_parallel=2

Three cases on 40 rows, one after another:

- ``batch6``: ``dataset.batch(6)`` without ``drop_remainder`` (6 batches
  of 6, a last one of 4), sharded: a global batch of 6 splits into blocks of
  3 (``d`` at 2 ranks, ``df`` 2x2 at 4 ranks) and the last batch of 4 into
  blocks of 2, so every row is trained as in one process;
- ``arrays6``: ``fit(x, y, batch_size=6)`` on the whole arrays on every rank
  (tfhybrid finds identical rows on every rank and counts each once);
- ``batch7``: ``dataset.batch(7, drop_remainder=True)``: a global batch of 7
  does not split into 2 equal data-parallel blocks; ``data.shard`` either
  refuses it (a ``ValueError`` naming the batch) or every row trains as in
  one process, never other rows.

Every rank prints one ``RESULT {json}`` per case (history, ``evaluate`` and
tfhybrid's warnings, or the error); rank 0 (or the plain process) writes ``OUT/weights_<case>.npz``.
"""
import json
import os
import sys
import warnings

import keras
import numpy as np
import tensorflow as tf

OUT = sys.argv[1] if len(sys.argv) > 1 else "."
STRATEGY = sys.argv[2] if len(sys.argv) > 2 else "d"
DIST = int(os.environ.get("HOROVOD_SIZE", "1")) > 1    # under horovodrun; else plain Keras
if DIST:
    import tfhybrid

ROWS, EPOCHS = 40, 2


def make_model():
    keras.utils.set_random_seed(7)
    inputs = keras.Input((6,), name="x")
    h = keras.layers.Dense(8, activation="tanh", name="fc1")(inputs)
    return keras.Model(inputs, keras.layers.Dense(2, name="out")(h), name="batches")


rng = np.random.default_rng(0)
x = rng.standard_normal((ROWS, 6)).astype("float32")
y = np.stack([x[:, 0] - x[:, 1], x[:, 2] * x[:, 3]], axis=1).astype("float32")


def report(case, **fields):
    print("RESULT " + json.dumps({"rank": tfhybrid.rank() if DIST else 0, "case": case,
                                  **fields}), flush=True)


def compiled():
    model = make_model()
    optimizer = keras.optimizers.SGD(0.05)
    if DIST:
        model = tfhybrid.transform(model, strategy=STRATEGY)
        optimizer = tfhybrid.DistributedOptimizer(optimizer)
    model.compile(optimizer=optimizer, loss="mse", metrics=["mae"])
    return model


def finish(case, model, history, scores, caught):
    full = tfhybrid.gather(model) if DIST else model
    report(case, history={k: [float(v) for v in vs] for k, vs in history.history.items()},
           evaluate={k: float(v) for k, v in scores.items()},
           warnings=sorted({str(w.message)[:200] for w in caught
                            if "tfhybrid" in str(w.message)}))
    if not DIST or tfhybrid.is_root():
        np.savez(os.path.join(OUT, f"weights_{case}.npz"),
                 **{w.path: w.numpy() for w in full.weights})


if DIST:
    tfhybrid.init(model_parallel=2 if STRATEGY == "df" else 1)
callbacks = tfhybrid.callbacks.standard() if DIST else None

# batch6: a dataset batched by 6, last batch partial
model = compiled()
data = tf.data.Dataset.from_tensor_slices((x, y)).batch(6)
if DIST:
    data = tfhybrid.data.shard(data, model=model)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    history = model.fit(data, epochs=EPOCHS, verbose=0, callbacks=callbacks)
    scores = model.evaluate(data, verbose=0, return_dict=True)
finish("batch6", model, history, scores, caught)

# arrays6: whole arrays on every rank, batch_size=6
model = compiled()
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    history = model.fit(x, y, batch_size=6, epochs=EPOCHS, shuffle=False, verbose=0,
                        callbacks=callbacks)
    scores = model.evaluate(x, y, batch_size=6, verbose=0, return_dict=True)
finish("arrays6", model, history, scores, caught)

# batch7: a global batch of 7 rows does not split into equal blocks
model = compiled()
data = tf.data.Dataset.from_tensor_slices((x, y)).batch(7, drop_remainder=True)
try:
    if DIST:
        data = tfhybrid.data.shard(data, model=model)
except ValueError as err:
    report("batch7", error=str(err))
else:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        history = model.fit(data, epochs=EPOCHS, verbose=0, callbacks=callbacks)
        scores = model.evaluate(data, verbose=0, return_dict=True)
    finish("batch7", model, history, scores, caught)
