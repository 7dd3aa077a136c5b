"""User script: checkpoint into a directory that does not exist yet, then use
the checkpoint without tfhybrid.

    horovodrun -np 2 python checkpoint_new_dir.py --phase train --ckpt OUT/newdir/e{epoch:03d}.keras
    python checkpoint_new_dir.py --phase load --ckpt OUT/newdir/e002.keras

``train`` fits a small MLP (``df``, 2-way model parallel) for 2 epochs with
``tfhybrid.callbacks.Checkpoint(template)`` and prints ``RESULT`` with what
``evaluate`` reports and the files written. ``load`` is a plain Keras
process (no ``tfhybrid`` import): it loads the last checkpoint with
``keras.saving.load_model``, evaluates it on the same rows, trains the same
model the same way with plain Keras and prints both, and the largest
relative difference of the loaded weights from the plain run's.
"""
import argparse
import json
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import keras
import numpy as np
import tensorflow as tf

BATCH, ROWS, EPOCHS = 16, 64, 2


def make_model():
    inputs = keras.Input((12,))
    x = keras.layers.Dense(16, activation="relu", name="fc1")(inputs)
    x = keras.layers.Dense(8, activation="relu", name="fc2")(x)
    return keras.Model(inputs, keras.layers.Dense(4, activation="softmax", name="out")(x))


def data():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((ROWS, 12)).astype("float32")
    y = rng.integers(0, 4, ROWS)
    return x, y


def compile_args():
    return dict(loss="sparse_categorical_crossentropy", metrics=["accuracy"])


def train(ckpt):
    import tfhybrid

    tfhybrid.init(model_parallel=2)
    keras.utils.set_random_seed(0)
    model = tfhybrid.transform(make_model(), strategy="df")
    model.compile(optimizer=tfhybrid.DistributedOptimizer(keras.optimizers.SGD(0.1)),
                  **compile_args())
    x, y = data()
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH)
    steps = keras.callbacks.LambdaCallback(
        on_train_batch_end=lambda batch, logs: print("TRAINED A STEP", flush=True))
    model.fit(tfhybrid.data.shard(ds, model=model), epochs=EPOCHS, verbose=0,
              callbacks=tfhybrid.callbacks.standard()
              + [tfhybrid.callbacks.Checkpoint(ckpt), steps])
    scores = model.evaluate(tfhybrid.data.shard(ds, model=model), verbose=0, return_dict=True)
    directory = os.path.dirname(ckpt)
    print("RESULT " + json.dumps({"rank": tfhybrid.rank(), "evaluate": scores,
                                  "files": sorted(os.listdir(directory))}))


def load(ckpt):
    x, y = data()
    loaded = keras.saving.load_model(ckpt)
    loaded.compile(**compile_args())
    scores = loaded.evaluate(x, y, batch_size=BATCH, verbose=0, return_dict=True)
    keras.utils.set_random_seed(0)
    plain = make_model()
    plain.compile(optimizer=keras.optimizers.SGD(0.1), **compile_args())
    plain.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0)
    reference = plain.evaluate(x, y, batch_size=BATCH, verbose=0, return_dict=True)
    rel = max(float(np.max(np.abs(a - b)) / (np.max(np.abs(b)) + 1e-12))
              for a, b in zip(loaded.get_weights(), plain.get_weights()))
    print("RESULT " + json.dumps({"evaluate": scores, "plain_evaluate": reference,
                                  "weights_rel": rel, "tfhybrid_imported":
                                  "tfhybrid" in __import__("sys").modules}))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--phase", choices=["train", "load"], required=True)
    ap.add_argument("--ckpt", required=True)
    args = ap.parse_args()
    train(args.ckpt) if args.phase == "train" else load(args.ckpt)


if __name__ == "__main__":
    main()
