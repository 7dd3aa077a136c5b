"""A small CNN trained under several strategies in one launch, for the
multi-host tests (tests/multihost/test_across_hosts.py).

    python strategies_script.py OUT d df              # one plain Keras process
    horovodrun --gloo -np 4 -H h1:2,h2:2 --network-interface eth0 \\
        python strategies_script.py OUT d df

Each strategy (default: all of ``d f c s df ds gmp p ls``) trains the same
model from the same initial weights on the same global batches (2 epochs of 4
steps) and evaluates it on the training set; every rank prints ``RESULT
{json}`` with its host, the loss history and the evaluated loss, and rank 0 (or the plain process) writes the gathered plain model's
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

# strategy:model_parallel. At 2 hosts x 2 ranks the model groups of 2 live inside
# a host (consecutive ranks) and those of 4 (f, c, s: the whole world) span both.
ALL = ["d:1", "f:4", "c:4", "s:4", "df:2", "ds:2", "gmp:2", "p:2", "ls:2"]
DIST = int(os.environ.get("HOROVOD_SIZE", "1")) > 1    # under horovodrun; else plain Keras
if DIST:
    import tfhybrid

BATCH, EPOCHS, ROWS = 16, 2, 64


def make_model():
    keras.utils.set_random_seed(3)
    inputs = keras.Input((8, 8, 4), name="image")
    x = keras.layers.Conv2D(8, 3, padding="same", activation="relu", name="conv1")(inputs)
    x = keras.layers.Conv2D(8, 3, padding="same", activation="relu", name="conv2")(x)
    x = keras.layers.MaxPooling2D(2, name="pool")(x)
    x = keras.layers.Flatten(name="flatten")(x)
    x = keras.layers.Dense(16, activation="relu", name="fc1")(x)
    outputs = keras.layers.Dense(4, name="fc2")(x)
    return keras.Model(inputs, outputs, name="small_cnn")


def data(rows=ROWS):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((rows, 8, 8, 4)).astype("float32")
    y = (np.argmax(x.reshape(rows, -1)[:, :4], axis=1)).astype("int64")
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH, drop_remainder=True)


def run(strategy, out):
    model = make_model()
    optimizer = keras.optimizers.SGD(0.05, momentum=0.9)
    train = data()
    if DIST:
        model = tfhybrid.transform(model, strategy=strategy)
        optimizer = tfhybrid.DistributedOptimizer(optimizer)
        train = tfhybrid.data.shard(train, model=model)
        described = tfhybrid.describe(model, batch_size=BATCH, print_fn=None)
        if tfhybrid.is_root():
            print(f"DESCRIBE {strategy} {described.text.splitlines()[-1]}", flush=True)
    model.compile(optimizer=optimizer,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    history = model.fit(train, epochs=EPOCHS, verbose=0, shuffle=False,
                        callbacks=tfhybrid.callbacks.standard() if DIST else None)
    test = tfhybrid.data.shard(data(), model=model) if DIST else data()
    evaluated = model.evaluate(test, verbose=0, return_dict=True)
    full = tfhybrid.gather(model) if DIST else model
    print("RESULT " + json.dumps({
        "rank": tfhybrid.rank() if DIST else 0, "host": socket.gethostname(),
        "strategy": strategy, "loss": [float(v) for v in history.history["loss"]],
        "evaluate": float(evaluated["loss"])}), flush=True)
    if not DIST or tfhybrid.is_root():
        np.savez(os.path.join(out, f"weights_{strategy}.npz"),
                 **{w.path: w.numpy() for w in full.weights})


def main():
    out, specs = sys.argv[1], sys.argv[2:] or ALL
    for spec in specs:
        name, _, mp = spec.partition(":")
        if DIST:
            mp = min(int(mp or 1), int(os.environ["HOROVOD_SIZE"]))
            if not tfhybrid.is_initialized():
                tfhybrid.init(model_parallel=mp)
            elif tfhybrid.grid().model_size != mp:
                tfhybrid.runtime.reform(mp)
            if tfhybrid.is_root():    # where the model groups live (tested across hosts)
                print(f"PLACEMENT {name} {tfhybrid.runtime.placement()}", flush=True)
        run(name, out)


if __name__ == "__main__":
    main()
