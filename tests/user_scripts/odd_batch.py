"""Global batches of an odd number of rows.

    python odd_batch.py plain                               # the one-process reference
    horovodrun -np 2 --gloo python odd_batch.py d gmp       # strategies one after another
    horovodrun -np 4 --gloo python odd_batch.py df

The script writes what a user writes: 60 rows, ``from_tensor_slices(...)
.batch(15)`` (no ``drop_remainder``), ``data.shard``, ``fit`` with
``validation_data`` and ``evaluate``. Under d and df every row must be
trained (blocks of 8 and 7 rows): History, evaluate and the weights equal the
plain run's. Under gmp (model groups gather equal blocks) ``data.shard`` must
refuse with an error naming the batch size, the ranks and the fix. Each
strategy prints ``RESULT {json}`` on rank 0.
"""
import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import numpy as np
import tensorflow as tf

ROWS, BATCH, EPOCHS = 60, 15, 2


def make_model(name):
    keras.utils.set_random_seed(9)
    inputs = keras.Input((6,), name=f"{name}_in")
    x = keras.layers.Dense(8, activation="tanh", name=f"{name}_fc1")(inputs)
    x = keras.layers.Dense(8, activation="tanh", name=f"{name}_fc2")(x)
    return keras.Model(inputs, keras.layers.Dense(4, name=f"{name}_out")(x), name=name)


def report(strategy, rank, history=None, scores=None, weights=None, error=None):
    if rank != 0:
        return
    print("RESULT " + json.dumps({
        "strategy": strategy, "error": error,
        "history": history and {k: [float(v) for v in vs] for k, vs in history.items()},
        "evaluate": scores and {k: float(v) for k, v in scores.items()},
        "weight_sums": weights and [float(np.sum(w, dtype=np.float64)) for w in weights],
        "weight_abs_sums": weights and [float(np.sum(np.abs(w), dtype=np.float64))
                                        for w in weights],
    }, sort_keys=True), flush=True)


def main(strategies):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((ROWS, 6)).astype(np.float32)
    y = (x[:, 0] + x[:, 1] > 0).astype(np.int64) + (x[:, 2] > 0.7).astype(np.int64)
    train = tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH)
    valid = tf.data.Dataset.from_tensor_slices((x[:45], y[:45])).batch(BATCH)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    if strategies == ["plain"]:
        model = make_model("odd")
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss=loss, metrics=["accuracy"])
        history = model.fit(train, validation_data=valid, epochs=EPOCHS, verbose=0)
        scores = model.evaluate(train, verbose=0, return_dict=True)
        report("plain", 0, history.history, scores, model.get_weights())
        return
    import tfhybrid

    for strategy in strategies:
        grid = tfhybrid.init(model_parallel=2 if strategy in ("df", "gmp") else 1)
        pmodel = tfhybrid.transform(make_model("odd"), strategy=strategy,
                                    **({"ccr_threshold": 0} if strategy == "gmp" else {}))
        pmodel.compile(optimizer=tfhybrid.DistributedOptimizer(keras.optimizers.SGD(0.1)),
                       loss=loss, metrics=["accuracy"])
        try:
            history = pmodel.fit(tfhybrid.data.shard(train, model=pmodel),
                                 validation_data=tfhybrid.data.shard(valid, model=pmodel),
                                 epochs=EPOCHS, callbacks=tfhybrid.callbacks.standard(),
                                 verbose=0)
        except ValueError as err:
            report(strategy, grid.rank, error=str(err))
            tfhybrid.shutdown()
            continue
        scores = pmodel.evaluate(tfhybrid.data.shard(train, model=pmodel), verbose=0,
                                 return_dict=True)
        report(strategy, grid.rank, history.history, scores,
               tfhybrid.gather(pmodel).get_weights())
        tfhybrid.shutdown()


if __name__ == "__main__":
    main(sys.argv[1:] or ["d"])
