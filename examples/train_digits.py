"""tfhybrid demo: hybrid-parallel training of a small CNN on scikit-learn's digits.

Launch on 2 local processes (what `make demo` runs)::

    horovodrun -np 2 --gloo python examples/train_digits.py

The model is an ordinary Keras model; ``tfhybrid.transform`` rewrites it for
the chosen strategy (default ``df``: data groups x filter-parallel groups; on
2 processes with ``--model-parallel 2`` the fully-connected layers are split
across both ranks). The data set ships with scikit-learn, so the demo runs
offline.
"""
import argparse
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import tensorflow as tf
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import tfhybrid


def make_model():
    """An ordinary Keras CNN for 8x8 grey images."""
    inputs = keras.Input((8, 8, 1), name="image")
    x = keras.layers.Conv2D(32, 3, padding="same", activation="relu", name="conv1")(inputs)
    x = keras.layers.Conv2D(32, 3, padding="same", activation="relu", name="conv2")(x)
    x = keras.layers.MaxPooling2D(2, name="pool")(x)
    x = keras.layers.Flatten(name="flatten")(x)
    x = keras.layers.Dense(128, activation="relu", name="fc1")(x)
    outputs = keras.layers.Dense(10, name="fc2")(x)
    return keras.Model(inputs, outputs, name="digits_cnn")


def load_data(seed):
    digits = load_digits()
    x = (digits.images / 16.0).astype("float32")[..., None]
    y = digits.target.astype("int64")
    return train_test_split(x, y, test_size=0.2, random_state=seed, stratify=y)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--strategy", default="df", help="d, f, c, df, gmp, ... (default df)")
    ap.add_argument("--model-parallel", type=int, default=2, help="model-group size (default 2)")
    ap.add_argument("--epochs", type=int, default=15)
    ap.add_argument("--batch", type=int, default=32, help="global batch size")
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--save", help="save the gathered plain Keras model to this .keras file")
    args = ap.parse_args()

    grid = tfhybrid.init(model_parallel=args.model_parallel)
    keras.utils.set_random_seed(args.seed)
    x_train, x_test, y_train, y_test = load_data(args.seed)

    model = tfhybrid.transform(make_model(), strategy=args.strategy)
    if tfhybrid.is_root():
        print(f"tfhybrid demo: {grid.size} processes = {grid.data_size} data x "
              f"{grid.model_size} model, strategy {args.strategy!r}, global batch {args.batch}")
        tfhybrid.describe(model, batch_size=args.batch)

    # The scaling form of data.shard: single rows in, this rank's local batches
    # out (shuffled identically on every rank; only this rank's rows are read).
    rows = tf.data.Dataset.from_tensor_slices((x_train, y_train))
    train = tfhybrid.data.shard(rows, model=model, batch_size=args.batch,
                                shuffle=len(x_train), seed=args.seed)
    test_batch = args.batch
    n_test = len(x_test) - len(x_test) % test_batch
    test = tf.data.Dataset.from_tensor_slices((x_test[:n_test], y_test[:n_test])).batch(test_batch)

    model.compile(optimizer=tfhybrid.DistributedOptimizer(keras.optimizers.SGD(args.lr, momentum=0.9)),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    model.fit(train, epochs=args.epochs,
              callbacks=tfhybrid.callbacks.standard(), shuffle=False,
              verbose=2 if tfhybrid.is_root() else 0)
    results = tfhybrid.callbacks.average_logs(
        model.evaluate(tfhybrid.data.shard(test, model=model), verbose=0, return_dict=True))
    if tfhybrid.is_root():
        print(f"final test accuracy: {results['accuracy']:.4f} (loss {results['loss']:.4f}) "
              f"on {n_test} held-out digits")
    if args.save:
        full = tfhybrid.gather(model)          # collective: every rank
        if tfhybrid.is_root():
            full.save(args.save)
            print(f"saved the full model (loads without tfhybrid) to {args.save}")
    return 0 if results["accuracy"] > 0.9 else 1


if __name__ == "__main__":
    raise SystemExit(main())
