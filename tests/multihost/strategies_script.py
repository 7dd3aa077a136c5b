"""A small CNN trained under several strategies in one launch, for the
multi-host tests (tests/multihost/test_across_hosts.py).

    python strategies_script.py OUT d df              # one plain Keras process
    horovodrun --gloo -np 4 -H h1:2,h2:2 --network-interface eth0 \\
        python strategies_script.py OUT d df

Each strategy trains the same model from the same initial weights on the same
global batches (2 epochs of 4 steps); every rank prints ``RESULT {json}`` with
its host, and rank 0 (or the plain process) writes the gathered plain model's
weights to ``OUT/weights_<strategy>.npz``, compared by the test with the
plain process's.
"""
import json
import os
import socket
import sys

import keras
import numpy as np
import tensorflow as tf

OUT = sys.argv[1]
STRATEGIES = sys.argv[2:] or ["d", "df"]
DIST = int(os.environ.get("HOROVOD_SIZE", "1")) > 1    # under horovodrun; else plain Keras
if DIST:
    import tfhybrid

BATCH, EPOCHS, ROWS = 16, 2, 64


def make_model():
    keras.utils.set_random_seed(3)
    inputs = keras.Input((8, 8, 2), name="image")
    x = keras.layers.Conv2D(8, 3, padding="same", activation="relu", name="conv1")(inputs)
    x = keras.layers.Conv2D(8, 3, padding="same", activation="relu", name="conv2")(x)
    x = keras.layers.MaxPooling2D(2, name="pool")(x)
    x = keras.layers.Flatten(name="flatten")(x)
    x = keras.layers.Dense(16, activation="relu", name="fc1")(x)
    outputs = keras.layers.Dense(4, name="fc2")(x)
    return keras.Model(inputs, outputs, name="small_cnn")


def data():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((ROWS, 8, 8, 2)).astype("float32")
    y = (np.argmax(x.reshape(ROWS, -1)[:, :4], axis=1)).astype("int64")
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH, drop_remainder=True)


def run(strategy):
    model = make_model()
    optimizer = keras.optimizers.SGD(0.05, momentum=0.9)
    train = data()
    if DIST:
        model = tfhybrid.transform(model, strategy=strategy)
        optimizer = tfhybrid.DistributedOptimizer(optimizer)
        train = tfhybrid.data.shard(train, model=model)
    model.compile(optimizer=optimizer,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    history = model.fit(train, epochs=EPOCHS, verbose=0, shuffle=False,
                        callbacks=tfhybrid.callbacks.standard() if DIST else None)
    full = tfhybrid.gather(model) if DIST else model
    print("RESULT " + json.dumps({
        "rank": tfhybrid.rank() if DIST else 0, "host": socket.gethostname(),
        "strategy": strategy, "loss": [float(v) for v in history.history["loss"]]}), flush=True)
    if not DIST or tfhybrid.is_root():
        np.savez(os.path.join(OUT, f"weights_{strategy}.npz"),
                 **{w.path: w.numpy() for w in full.weights})


if DIST:
    tfhybrid.init(model_parallel=2)
for name in STRATEGIES:
    run(name)
