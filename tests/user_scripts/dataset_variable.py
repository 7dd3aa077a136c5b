"""Input pipelines whose ``map`` updates a ``tf.Variable``, and a metric whose
state is created at its first update.

    python dataset_variable.py plain                              # the one-process reference
    horovodrun -np 2 --gloo python dataset_variable.py shard rows batch

What a user writes: a ``counter = tf.Variable(0)`` counting the records with
``counter.assign_add(1)`` inside ``dataset.map(...)``, and a metric that
creates its state (``keras.Variable`` of a value) on its first
``update_state``, when the number of classes is known. TensorFlow initialises
such a state inside the traced train step (its initial value is created
there, after the batch was read) rather than lifting it out of the step.

Each form trains the same global batches of ``BATCH`` rows with ``fit`` for
``EPOCHS`` epochs and then evaluates them once:

- ``plain``: the unmodified model in plain Keras, ``ds.map(count).batch(B)``;
- ``shard``: ``tfhybrid.data.shard`` of that batched dataset (batched form:
  every rank reads and maps every row);
- ``rows``: ``tfhybrid.data.shard(rows, batch_size=B, map_fn=count)``
  (scaling form: each rank maps only the rows of its block);
- ``batch``: ``ds.map(count).batch(B)`` passed to ``fit`` of the
  transformed model as it is (every rank feeds the whole global batch).

Each rank prints ``RESULT {json}`` with fit's History, the evaluation, the
trained weights' sums, the counter's final value and the rows this rank's
pipeline mapped (``expected_count``): every number but the count must equal
the plain run's.
"""
import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import numpy as np
import tensorflow as tf

FEATURES, CLASSES, ROWS = 6, 3, 64
BATCH, EPOCHS = 16, 2      # 4 training steps per epoch


class MeanTopLogit(keras.metrics.Metric):
    """Mean over rows of the largest logit; its state is made at the first update
    (its length follows the predictions' classes)."""

    def __init__(self, name="mean_top_logit", **kwargs):
        super().__init__(name=name, **kwargs)
        self.per_class = None

    def update_state(self, y_true, y_pred, sample_weight=None):
        if self.per_class is None:       # [sum of top logits per predicted class, rows]
            self.per_class = keras.Variable(np.zeros(int(y_pred.shape[-1]) + 1, np.float32),
                                            trainable=False, name="per_class")
        top = tf.reduce_max(y_pred, axis=-1)
        sums = tf.math.unsorted_segment_sum(top, tf.argmax(y_pred, axis=-1),
                                            int(y_pred.shape[-1]))
        rows = tf.cast(tf.shape(y_pred)[0:1], tf.float32)
        self.per_class.assign_add(tf.concat([sums, rows], 0))

    def result(self):
        if self.per_class is None:
            return tf.constant(0.0)
        return tf.reduce_sum(self.per_class[:-1]) / tf.maximum(self.per_class[-1], 1.0)

    def reset_state(self):
        if self.per_class is not None:
            self.per_class.assign(tf.zeros_like(self.per_class))


def make_model():
    keras.utils.set_random_seed(3)
    inputs = keras.Input((FEATURES,), name="rows")
    x = keras.layers.Dense(8, activation="relu", name="fc1")(inputs)
    return keras.Model(inputs, keras.layers.Dense(CLASSES, name="out")(x), name="ds_variable")


def compile_args(optimizer):
    return dict(optimizer=optimizer, metrics=["accuracy", MeanTopLogit()],
                loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))


def main(form):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((ROWS, FEATURES)).astype(np.float32)
    y = (np.argmax(x[:, :CLASSES], axis=1)).astype(np.int64)
    counter = tf.Variable(0, dtype=tf.int64, trainable=False, name="records_read")

    def count(a, b):
        counter.assign_add(1)
        return a, b

    rows = tf.data.Dataset.from_tensor_slices((x, y))
    batched = rows.map(count).batch(BATCH)
    passes = EPOCHS + 1                                  # fit's epochs, then evaluate
    model = make_model()
    if form == "plain":
        rank, size = 0, 1
        model.compile(**compile_args(keras.optimizers.SGD(0.1)))
        history = model.fit(batched, epochs=EPOCHS, verbose=0)
        evaluation = model.evaluate(batched, verbose=0, return_dict=True)
        weights = model.get_weights()
        expected = passes * ROWS
    else:
        import tfhybrid

        grid = tfhybrid.init()
        rank, size = grid.rank, grid.size
        pmodel = tfhybrid.transform(model, strategy="d")
        pmodel.compile(**compile_args(tfhybrid.DistributedOptimizer(keras.optimizers.SGD(0.1))))
        if form == "shard":
            train = tfhybrid.data.shard(batched, model=pmodel)
            expected = passes * ROWS                     # every rank maps every row
        elif form == "rows":
            train = tfhybrid.data.shard(rows, model=pmodel, batch_size=BATCH, map_fn=count)
            expected = passes * ROWS // size             # each rank maps its block's rows
        elif form == "batch":
            train = batched
            expected = passes * ROWS
        else:
            raise SystemExit(f"unknown form {form!r}: plain, shard, rows or batch")
        history = pmodel.fit(train, epochs=EPOCHS, verbose=0)
        evaluation = pmodel.evaluate(train, verbose=0, return_dict=True)
        weights = tfhybrid.gather(pmodel).get_weights()
    print("RESULT " + json.dumps({
        "form": form, "rank": rank, "size": size,
        "history": {k: [float(v) for v in vs] for k, vs in history.history.items()},
        "evaluate": {k: float(v) for k, v in evaluation.items()},
        "weight_sums": [float(np.sum(w, dtype=np.float64)) for w in weights],
        "weight_abs_sums": [float(np.sum(np.abs(w), dtype=np.float64)) for w in weights],
        "count": int(counter.numpy()), "expected_count": int(expected),
    }, sort_keys=True), flush=True)
    if form != "plain":
        tfhybrid.shutdown()


if __name__ == "__main__":
    for name in sys.argv[1:] or ["shard"]:   # each form on its own grid (init .. shutdown)
        main(name)
