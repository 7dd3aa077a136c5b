"""``class_weight`` and ``sample_weight``, as a user writes them.

    python class_sample_weights.py OUT                        # one plain Keras process
    horovodrun -np 2 --gloo python class_sample_weights.py OUT

Imbalanced classes. Three cases, one after another:

- ``class_weight``: ``fit(dataset, class_weight={0: 0.5, 1: 2.0, 2: 4.0})``
  under ``d``;
- ``sample_weight``: a dataset of ``(x, y, sample_weight)`` batches under
  ``df`` (``init(model_parallel=2)``), with ``weighted_metrics``, validation
  and ``evaluate`` on weighted data too;
- ``arrays``: ``fit(x, y, sample_weight=w)`` on numpy arrays sharded by
  ``tfhybrid.data.shard((x, y, w), batch_size=16, model=model)`` under ``d``.

Every rank prints one ``RESULT {json}`` per case with the history and
``evaluate``; rank 0 (or the plain process) writes ``OUT/weights_<case>.npz``.
"""

import keras
import numpy as np
import tensorflow as tf

from script_report import DIST, full_model, report

if DIST:
    import tfhybrid

BATCH, EPOCHS, ROWS = 16, 2, 96


def make_model():
    keras.utils.set_random_seed(10)
    inputs = keras.Input((8,), name="x")
    h = keras.layers.Dense(16, activation="relu", name="fc1")(inputs)
    return keras.Model(inputs, keras.layers.Dense(4, name="out")(h), name="weighted")


def arrays(rows, seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, 8)).astype("float32")
    score = x[:, 0] + 0.5 * x[:, 1]
    y = np.where(score < 0.6, 0, np.where(score < 1.5, 1, 2)).astype("int64")   # imbalanced
    w = rng.uniform(0.2, 3.0, rows).astype("float32")
    return x, y, w


def batches(*columns):
    return tf.data.Dataset.from_tensor_slices(columns).batch(BATCH, drop_remainder=True)


def run(case, strategy):
    model = make_model()
    optimizer = keras.optimizers.SGD(0.1)
    if DIST:
        model = tfhybrid.transform(model, strategy=strategy)
        optimizer = tfhybrid.DistributedOptimizer(optimizer)
    model.compile(optimizer=optimizer,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"], weighted_metrics=["accuracy"])
    x, y, w = arrays(ROWS, 0)
    vx, vy, vw = arrays(32, 1)
    callbacks = tfhybrid.callbacks.standard() if DIST else None
    shard = (lambda d: tfhybrid.data.shard(d, model=model)) if DIST else (lambda d: d)
    if case == "class_weight":
        history = model.fit(shard(batches(x, y)), class_weight={0: 0.5, 1: 2.0, 2: 4.0},
                            epochs=EPOCHS, verbose=0, callbacks=callbacks)
        scores = model.evaluate(shard(batches(vx, vy)), verbose=0, return_dict=True)
    elif case == "sample_weight":
        history = model.fit(shard(batches(x, y, w)), validation_data=shard(batches(vx, vy, vw)),
                            epochs=EPOCHS, verbose=0, callbacks=callbacks)
        scores = model.evaluate(shard(batches(vx, vy, vw)), verbose=0, return_dict=True)
    else:
        batch = BATCH
        if DIST:
            x, y, w = tfhybrid.data.shard((x, y, w), batch_size=BATCH, model=model)
            batch = BATCH // tfhybrid.data.batch_split(model)[0]
        history = model.fit(x, y, sample_weight=w, batch_size=batch, shuffle=False,
                            epochs=EPOCHS, verbose=0, callbacks=callbacks)
        scores = model.evaluate(shard(batches(vx, vy, vw)), verbose=0, return_dict=True)
    report(full_model(model), f"weights_{case}.npz", history, scores, case=case)


if DIST:
    tfhybrid.init(model_parallel=2)
run("class_weight", "d")
run("sample_weight", "df")
run("arrays", "d")
