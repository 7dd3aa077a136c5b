"""Train with tfhybrid, save the gathered model, continue in a plain Keras process.

    python resume_plain.py OUT all                              # one process, 3 epochs
    horovodrun -np 2 --gloo python resume_plain.py OUT first    # 2 epochs under df
    python resume_plain.py OUT then                             # plain Keras: 1 more epoch

``first`` trains 2 epochs under ``df`` (``init(model_parallel=2)``) and
saves ``tfhybrid.gather(model).save(OUT/model.keras)`` on every rank (an
uncompiled plain Keras model). ``then`` runs without tfhybrid (it does not
import it): ``keras.saving.load_model``, compile with the same SGD (no
optimizer state to carry), and one more epoch on the same batches. ``all``
is the reference: one plain process training 3 epochs. Each prints
``RESULT {json}``: the phase, the history and ``evaluate``; the last phase
(``then`` or ``all``) writes ``OUT/weights.npz``.
"""
import json
import os
import sys

import keras
import numpy as np
import tensorflow as tf

OUT, PHASE = sys.argv[1], sys.argv[2]
DIST = int(os.environ.get("HOROVOD_SIZE", "1")) > 1    # under horovodrun; else plain Keras
if DIST:
    import tfhybrid

BATCH = 16
PATH = os.path.join(OUT, "model.keras")


def make_model():
    keras.utils.set_random_seed(9)
    inputs = keras.Input((10,), name="x")
    h = keras.layers.Dense(16, activation="relu", name="fc1")(inputs)
    h = keras.layers.Dense(8, activation="relu", name="fc2")(h)
    return keras.Model(inputs, keras.layers.Dense(4, name="out")(h), name="resumed")


def data(rows, seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, 10)).astype("float32")
    y = np.argmax(x[:, :4] - x[:, 4:8], axis=1).astype("int64")
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH, drop_remainder=True)


def compile_plain(model):
    model.compile(optimizer=keras.optimizers.SGD(0.1),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])


def report(history, scores):
    print("RESULT " + json.dumps({
        "rank": tfhybrid.rank() if DIST else 0, "phase": PHASE,
        "tfhybrid_imported": "tfhybrid" in sys.modules,
        "history": {k: [float(v) for v in vs] for k, vs in history.history.items()},
        "evaluate": {k: float(v) for k, v in scores.items()}}), flush=True)


train, val = data(96, 0), data(32, 1)
if PHASE == "first":
    tfhybrid.init(model_parallel=2)
    model = tfhybrid.transform(make_model(), strategy="df")
    model.compile(optimizer=tfhybrid.DistributedOptimizer(keras.optimizers.SGD(0.1)),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    history = model.fit(tfhybrid.data.shard(train, model=model), epochs=2, verbose=0,
                        callbacks=tfhybrid.callbacks.standard())
    scores = model.evaluate(tfhybrid.data.shard(val, model=model), verbose=0, return_dict=True)
    tfhybrid.gather(model).save(PATH)
    report(history, scores)
else:
    if PHASE == "then":
        model = keras.saving.load_model(PATH)
        epochs = 1
    else:
        model = make_model()
        epochs = 3
    compile_plain(model)
    history = model.fit(train, epochs=epochs, verbose=0)
    scores = model.evaluate(val, verbose=0, return_dict=True)
    report(history, scores)
    np.savez(os.path.join(OUT, "weights.npz"), **{w.path: w.numpy() for w in model.weights})
