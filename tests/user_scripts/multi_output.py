"""A model with two heads (classification and regression), as a user writes it.

    python multi_output.py OUT                        # one plain Keras process
    horovodrun -np 2 --gloo python multi_output.py OUT

Two losses given as a dict with ``loss_weights``, per-output metrics, labels
as a dict keyed by output name, validation data. The same model is trained
under ``d`` (data parallel over every rank) and under ``df`` (data groups x
filter groups of 2: the trunk and both heads split). Every rank prints one
``RESULT {json}`` per strategy with every key of the history (total loss,
each output's loss and metric, their validation twins) and of ``evaluate``;
rank 0 (or the plain process) writes ``OUT/weights_<strategy>.npz``.
"""

import keras
import numpy as np
import tensorflow as tf

from script_report import DIST, full_model, report

if DIST:
    import tfhybrid

BATCH, EPOCHS = 16, 2


def make_model():
    keras.utils.set_random_seed(2)
    inputs = keras.Input((10,), name="x")
    h = keras.layers.Dense(16, activation="relu", name="trunk1")(inputs)
    h = keras.layers.Dense(16, activation="tanh", name="trunk2")(h)
    kind = keras.layers.Dense(4, name="kind")(h)
    size = keras.layers.Dense(2, name="size")(h)
    return keras.Model(inputs, {"kind": kind, "size": size}, name="two_heads")


def data(rows, seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, 10)).astype("float32")
    kind = np.argmax(x[:, :4], axis=1).astype("int64")
    size = np.stack([x[:, 4] * x[:, 5], x[:, 6] - x[:, 7]], axis=1).astype("float32")
    return tf.data.Dataset.from_tensor_slices(
        (x, {"kind": kind, "size": size})).batch(BATCH, drop_remainder=True)


def run(strategy):
    model = make_model()
    optimizer = keras.optimizers.SGD(0.05)
    if DIST:
        model = tfhybrid.transform(model, strategy=strategy)
        optimizer = tfhybrid.DistributedOptimizer(optimizer)
    model.compile(optimizer=optimizer,
                  loss={"kind": keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                        "size": "mse"},
                  loss_weights={"kind": 1.0, "size": 0.5},
                  metrics={"kind": ["accuracy"], "size": ["mae"]})
    train, val = data(96, 0), data(32, 1)
    if DIST:
        train, val = (tfhybrid.data.shard(d, model=model) for d in (train, val))
    history = model.fit(train, validation_data=val, epochs=EPOCHS, verbose=0,
                        callbacks=tfhybrid.callbacks.standard() if DIST else None)
    scores = model.evaluate(val, verbose=0, return_dict=True)
    report(full_model(model), f"weights_{strategy}.npz", history, scores, strategy=strategy)


if DIST:
    tfhybrid.init(model_parallel=2)
for strategy in ("d", "df"):
    run(strategy)
