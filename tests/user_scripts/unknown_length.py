"""Input pipelines whose length TensorFlow does not know.

    python unknown_length.py plain                          # the one-process reference
    horovodrun -np 2 --gloo python unknown_length.py d df   # strategies one after another

The script writes what a user writes: its rows as TFRecord files in a
temporary folder, read back with ``TFRecordDataset`` + ``map(parse)`` +
``batch`` (cardinality unknown), a validation set cut with ``filter``
(cardinality unknown), ``data.shard`` of both, ``fit`` with
``validation_data`` and ``evaluate`` of each. ``plain`` runs the unmodified
model in plain Keras on the same global batches (no tfhybrid at all; the
length of each dataset told with ``assert_cardinality``, see below). Rank 0
prints ``RESULT {json}`` with fit's History (loss, accuracy, val_loss,
val_accuracy per epoch), both evaluations and the trained weights' sums:
every number must equal the plain run's.
"""
import json
import os
import sys
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import numpy as np
import tensorflow as tf

FEATURES, CLASSES, ROWS, FILES = 12, 4, 128, 4
BATCH, EPOCHS = 32, 3      # 4 training steps per epoch


def make_model():
    keras.utils.set_random_seed(3)
    inputs = keras.Input((FEATURES,), name="rows")
    x = keras.layers.Dense(16, activation="relu", name="fc1")(inputs)
    x = keras.layers.Dense(8, activation="relu", name="fc2")(x)
    return keras.Model(inputs, keras.layers.Dense(CLASSES, name="out")(x), name="unknown_len")


def write_records(folder, x, y):
    """The rows as FILES TFRecord files of tf.train.Examples, in order."""
    paths = []
    for i, rows in enumerate(np.array_split(np.arange(len(x)), FILES)):
        path = os.path.join(folder, f"part-{i}.tfrecord")
        with tf.io.TFRecordWriter(path) as writer:
            for r in rows:
                writer.write(tf.train.Example(features=tf.train.Features(feature={
                    "x": tf.train.Feature(float_list=tf.train.FloatList(value=x[r])),
                    "y": tf.train.Feature(int64_list=tf.train.Int64List(value=[y[r]])),
                })).SerializeToString())
        paths.append(path)
    return paths


def parse(record):
    example = tf.io.parse_single_example(record, {
        "x": tf.io.FixedLenFeature([FEATURES], tf.float32),
        "y": tf.io.FixedLenFeature([], tf.int64)})
    return example["x"], example["y"]


def main(strategy, files=None):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((ROWS, FEATURES)).astype(np.float32)
    y = (np.argmax(x[:, :CLASSES], axis=1) + (x[:, 5] > 1.0)).astype(np.int64) % CLASSES
    files = files or write_records(tempfile.mkdtemp(), x, y)
    train = tf.data.TFRecordDataset(files).map(parse).batch(BATCH, drop_remainder=True)
    # validation: the rows whose feature 7 is below 0.6 (about 93 of 128), batches of 16
    valid = (tf.data.Dataset.from_tensor_slices((x, y)).filter(lambda a, b: a[7] < 0.6)
             .batch(16, drop_remainder=True))
    assert int(train.cardinality()) == int(valid.cardinality()) == -2     # unknown

    model = make_model()
    if strategy == "plain":
        # Plain Keras (3.15.1, TF 2.18.1) itself miscounts a dataset of unknown
        # length: the call that meets the end of the data still adds one batch's
        # rows to the metrics' counts, so its numbers are n/(n+1) of the true ones.
        # The reference reads the same files and batches with their length told.
        rank, size = 0, 1
        train = train.apply(tf.data.experimental.assert_cardinality(ROWS // BATCH))
        valid = valid.apply(tf.data.experimental.assert_cardinality(
            int(np.sum(x[:, 7] < 0.6)) // 16))
        model.compile(optimizer=keras.optimizers.SGD(0.1), metrics=["accuracy"],
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        history = model.fit(train, validation_data=valid, epochs=EPOCHS, verbose=0)
        ev_train = model.evaluate(train, verbose=0, return_dict=True)
        ev_valid = model.evaluate(valid, verbose=0, return_dict=True)
        weights = model.get_weights()
    else:
        import tfhybrid

        grid = tfhybrid.init(model_parallel=2 if strategy == "df" else 1)
        rank, size = grid.rank, grid.size
        pmodel = tfhybrid.transform(model, strategy=strategy)
        pmodel.compile(optimizer=tfhybrid.DistributedOptimizer(keras.optimizers.SGD(0.1)),
                       loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                       metrics=["accuracy"])
        history = pmodel.fit(tfhybrid.data.shard(train, model=pmodel),
                             validation_data=tfhybrid.data.shard(valid, model=pmodel),
                             epochs=EPOCHS, callbacks=tfhybrid.callbacks.standard(), verbose=0)
        ev_train = pmodel.evaluate(tfhybrid.data.shard(train, model=pmodel), verbose=0,
                                   return_dict=True)
        ev_valid = pmodel.evaluate(tfhybrid.data.shard(valid, model=pmodel), verbose=0,
                                   return_dict=True)
        weights = tfhybrid.gather(pmodel).get_weights()
    print("RESULT " + json.dumps({
        "strategy": strategy, "rank": rank, "size": size,
        "history": {k: [float(v) for v in vs] for k, vs in history.history.items()},
        "evaluate_train": {k: float(v) for k, v in ev_train.items()},
        "evaluate_valid": {k: float(v) for k, v in ev_valid.items()},
        "weight_sums": [float(np.sum(w, dtype=np.float64)) for w in weights],
        "weight_abs_sums": [float(np.sum(np.abs(w), dtype=np.float64)) for w in weights],
    }, sort_keys=True), flush=True)
    if strategy != "plain":
        tfhybrid.shutdown()
    return files


if __name__ == "__main__":
    written = None
    for name in sys.argv[1:] or ["d"]:      # each strategy on its own grid (init .. shutdown)
        written = main(name, written)
