"""Training from TFRecord files that each rank reads only its share of.

    python record_files.py d:4 df:4 d:2                          # one plain process
    horovodrun -np 4 --gloo python record_files.py d:4 df:4 d:2  # strategy:files ...

Each case ``strategy:files`` writes 128 rows as ``files`` TFRecord files of
``tf.train.Example``s in a temporary folder and trains from them, as a user
writes it. Under ``horovodrun``: ``tfhybrid.data.shard(files,
reader=tf.data.TFRecordDataset, model=, batch_size=16, map_fn=parse)`` for
``fit`` (with the same files as ``validation_data``) and ``evaluate``
(``df``: ``model_parallel=2``). Without ``horovodrun``: the unmodified model
in plain Keras, no tfhybrid at all, reading the files side by side as
``data.shard``'s documented order says (``16 / files`` records of each file
per global batch: ``Dataset.from_tensor_slices(files).interleave(
TFRecordDataset, cycle_length=files, block_length=16 // files)``). The
reader counts the raw records it yields and ``parse`` the rows it decodes.

Every rank prints ``RESULT {json}``: the case, its rank, the data-parallel
blocks, raw records read and rows decoded per pass over the data; rank 0
(and the plain process) also fit's History, ``evaluate``'s numbers and the
trained weights.
"""
import json
import os
import sys
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import numpy as np
import tensorflow as tf

FEATURES, CLASSES, ROWS = 12, 4, 128
BATCH, EPOCHS = 16, 2        # 8 steps per epoch
PASSES = 2 * EPOCHS + 1      # fit's epochs, their validations, evaluate


def make_model():
    keras.utils.set_random_seed(3)
    inputs = keras.Input((FEATURES,), name="rows")
    x = keras.layers.Dense(16, activation="relu", name="fc1")(inputs)
    x = keras.layers.Dense(8, activation="relu", name="fc2")(x)
    return keras.Model(inputs, keras.layers.Dense(CLASSES, name="out")(x), name="records")


def write_records(folder, n_files):
    """ROWS rows as n_files TFRecord files of equal length, in order."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((ROWS, FEATURES)).astype(np.float32)
    y = (np.argmax(x[:, :CLASSES], axis=1) + (x[:, 5] > 1.0)).astype(np.int64) % CLASSES
    paths = []
    for i, rows in enumerate(np.array_split(np.arange(ROWS), n_files)):
        path = os.path.join(folder, f"train-{i:03d}-of-{n_files:03d}.tfrecord")
        with tf.io.TFRecordWriter(path) as writer:
            for r in rows:
                writer.write(tf.train.Example(features=tf.train.Features(feature={
                    "x": tf.train.Feature(float_list=tf.train.FloatList(value=x[r])),
                    "y": tf.train.Feature(int64_list=tf.train.Int64List(value=[y[r]])),
                })).SerializeToString())
        paths.append(path)
    return paths


def main(strategy, n_files, launched):
    files = write_records(tempfile.mkdtemp(), n_files)
    counts = {"read": 0, "decoded": 0}

    def counter(key):
        def bump(record):
            counts[key] += 1
            return record
        return lambda record: tf.ensure_shape(tf.py_function(bump, [record], record.dtype),
                                              record.shape)

    def reader(names):                 # TFRecordDataset, counting the records it yields
        return tf.data.TFRecordDataset(names).map(counter("read"))

    def parse(record):
        example = tf.io.parse_single_example(counter("decoded")(record), {
            "x": tf.io.FixedLenFeature([FEATURES], tf.float32),
            "y": tf.io.FixedLenFeature([], tf.int64)})
        return example["x"], example["y"]

    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    model = make_model()
    if not launched:
        rank, size, blocks = 0, 1, 1

        def data():
            return (tf.data.Dataset.from_tensor_slices(files)
                    .interleave(reader, cycle_length=n_files, block_length=BATCH // n_files)
                    .map(parse).batch(BATCH, drop_remainder=True)
                    .apply(tf.data.experimental.assert_cardinality(ROWS // BATCH)))
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss=loss, metrics=["accuracy"])
        history = model.fit(data(), validation_data=data(), epochs=EPOCHS, verbose=0)
        scores = model.evaluate(data(), verbose=0, return_dict=True)
        weights = model.get_weights()
    else:
        import tfhybrid

        grid = tfhybrid.init(model_parallel=2 if strategy == "df" else 1)
        rank, size = grid.rank, grid.size
        pmodel = tfhybrid.transform(model, strategy=strategy)
        pmodel.compile(optimizer=tfhybrid.DistributedOptimizer(keras.optimizers.SGD(0.1)),
                       loss=loss, metrics=["accuracy"])
        blocks = tfhybrid.data.batch_split(pmodel)[0]

        def data():
            return tfhybrid.data.shard(files, reader=reader,
                                       model=pmodel, batch_size=BATCH, map_fn=parse)
        train, valid, test = data(), data(), data()
        counts.update(read=0, decoded=0)
        history = pmodel.fit(train, validation_data=valid, epochs=EPOCHS, verbose=0,
                             callbacks=tfhybrid.callbacks.standard())
        scores = pmodel.evaluate(test, verbose=0, return_dict=True)
        weights = tfhybrid.gather(pmodel).get_weights()
    out = {"strategy": strategy, "files": n_files, "rank": rank, "size": size,
           "blocks": blocks, "records_total": ROWS,
           "records_read_per_pass": counts["read"] / PASSES,
           "rows_decoded_per_pass": counts["decoded"] / PASSES}
    if rank == 0:
        out.update({
            "history": {k: [float(v) for v in vs] for k, vs in history.history.items()},
            "evaluate": {k: float(v) for k, v in scores.items()},
            "weights": [w.ravel().astype(float).tolist() for w in weights],
            "weight_checksum": float(sum(np.sum(np.abs(w), dtype=np.float64) for w in weights))})
    print("RESULT " + json.dumps(out, sort_keys=True), flush=True)
    if launched:
        tfhybrid.shutdown()


if __name__ == "__main__":
    launched = any(k in os.environ for k in ("HOROVOD_RANK", "OMPI_COMM_WORLD_RANK"))
    for case in sys.argv[1:] or ["d:4"]:
        strategy, n_files = case.split(":")
        main(strategy, int(n_files), launched)
