"""``model.predict`` on arrays and on datasets, as a user writes it.

    python predict_outputs.py OUT                        # one plain Keras process
    horovodrun -np 2 --gloo python predict_outputs.py OUT

After a short ``fit``, each strategy (``d``, then ``df`` with
``init(model_parallel=2)``) predicts, on every rank:

- ``arrays``: ``model.predict(x, batch_size=8)`` on the whole array;
- ``dataset``: ``model.predict(dataset.batch(8))`` (the whole, unsharded
  dataset, a last batch of 4 rows);
- ``sharded``: ``model.predict(tfhybrid.data.shard(dataset.batch(8),
  model=model))``: this rank's block of every batch (one process: all rows).

Every rank writes ``OUT/pred_<strategy>_rank<r>.npz``
and prints ``RESULT {json}`` with the shapes; the test compares every rank's
whole predictions with one process's, and the sharded ones with the rows of
one process's predictions that the rank's blocks hold.
"""
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

ROWS = 36


def make_model():
    keras.utils.set_random_seed(12)
    inputs = keras.Input((8,), name="x")
    h = keras.layers.Dense(16, activation="relu", name="fc1")(inputs)
    h = keras.layers.Dense(8, activation="relu", name="fc2")(h)
    return keras.Model(inputs, keras.layers.Dense(4, name="out")(h), name="predictor")


rng = np.random.default_rng(0)
x = rng.standard_normal((ROWS, 8)).astype("float32")
y = np.argmax(x[:, :4], axis=1).astype("int64")


def run(strategy):
    model = make_model()
    optimizer = keras.optimizers.SGD(0.1)
    if DIST:
        model = tfhybrid.transform(model, strategy=strategy)
        optimizer = tfhybrid.DistributedOptimizer(optimizer)
    model.compile(optimizer=optimizer,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    train = tf.data.Dataset.from_tensor_slices((x[:32], y[:32])).batch(8, drop_remainder=True)
    if DIST:
        train = tfhybrid.data.shard(train, model=model)
    model.fit(train, epochs=1, verbose=0,
              callbacks=tfhybrid.callbacks.standard() if DIST else None)
    rows = tf.data.Dataset.from_tensor_slices(x).batch(8)
    out = {"arrays": model.predict(x, batch_size=8, verbose=0),
           "dataset": model.predict(rows, verbose=0)}
    blocks, index = (tfhybrid.data.batch_split(model) if DIST else (1, 0))
    out["sharded"] = model.predict(tfhybrid.data.shard(rows, model=model) if DIST else rows,
                                   verbose=0)
    rank = tfhybrid.rank() if DIST else 0
    np.savez(os.path.join(OUT, f"pred_{strategy}_rank{rank}.npz"), **out)
    print("RESULT " + json.dumps({
        "rank": rank, "strategy": strategy, "blocks": int(blocks), "block": int(index),
        "shapes": {k: list(v.shape) for k, v in out.items()}}), flush=True)


if DIST:
    tfhybrid.init(model_parallel=2)
for strategy in ("d", "df"):
    run(strategy)
