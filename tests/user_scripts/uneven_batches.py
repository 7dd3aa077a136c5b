"""A data set whose length is not a multiple of the global batch.

    horovodrun -np 2 --gloo python uneven_batches.py N [strategy]
    horovodrun -np 2 --gloo python uneven_batches.py N:strategy [N:strategy ...]

(the second form runs the cases one after another in the same processes, each
on its own grid, as a script that trains several models would).

The script writes what a user writes: ``Dataset.from_tensor_slices((x, y))
.batch(8)`` (no ``drop_remainder``) over N samples, ``data.shard``, ``fit``
and ``evaluate``. Every rank must run the same number of steps (no hang),
rank 0 warns about the rows it drops, and the result must equal
single-process training and evaluation of the unmodified model on the rows
kept: under d (and df) each global batch of ``r`` rows is cut into blocks of
``r // p_data`` rows or one row more, so every row is trained; under gmp
(model groups gather equal blocks) each rank keeps ``r // p_data`` rows (the
first ``p_data * (r // p_data)`` rows of the batch). A batch of fewer than
``p_data`` rows is skipped. Each rank prints ``RESULT {json}``.
"""
import json
import sys
import warnings

import keras
import numpy as np
import tensorflow as tf

import tfhybrid

BATCH, EPOCHS = 8, 2


def make_model():
    keras.utils.set_random_seed(5)
    inputs = keras.Input((4,))
    hidden = keras.layers.Dense(8, activation="tanh", name="fc1")(inputs)
    return keras.Model(inputs, keras.layers.Dense(2, name="fc2")(hidden), name="uneven")


def kept_rows(n, blocks, whole):
    """Indices of the rows data.shard keeps, in order: every row of each batch of
    at least ``blocks`` rows when ``whole`` (blocks may differ by a row), else the
    first ``blocks * (rows // blocks)`` rows of each batch."""
    keep = []
    for start in range(0, n, BATCH):
        rows = min(BATCH, n - start)
        if rows >= blocks:
            keep.extend(range(start, start + (rows if whole else blocks * (rows // blocks))))
    return np.asarray(keep)


def main(n, strategy):
    grid = tfhybrid.init(model_parallel=2 if strategy in ("df", "f", "gmp") else 1)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((n, 4)).astype("float32")
    y = rng.standard_normal((n, 2)).astype("float32")
    model = make_model()
    pmodel = tfhybrid.transform(model, strategy=strategy)
    pmodel.compile(optimizer=tfhybrid.DistributedOptimizer(keras.optimizers.SGD(0.1)),
                   loss="mse", metrics=["mae"])
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH)     # last batch partial
    steps = []
    count = keras.callbacks.LambdaCallback(on_train_batch_end=lambda b, logs: steps.append(b))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pmodel.fit(tfhybrid.data.shard(data, model=pmodel), epochs=EPOCHS, verbose=0,
                   shuffle=False, callbacks=tfhybrid.callbacks.standard() + [count])
        scores = pmodel.evaluate(tfhybrid.data.shard(data, model=pmodel), verbose=0,
                                 return_dict=True)
    full = tfhybrid.gather(pmodel)

    blocks = tfhybrid.data.batch_split(pmodel)[0]
    whole = strategy != "gmp"      # gmp's model groups gather equal blocks
    keep = kept_rows(n, blocks, whole)
    ref = make_model()
    ref.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", metrics=["mae"])
    # the kept rows in batches of 8: the same batches as the sharded run's global batches
    ref_data = tf.data.Dataset.from_tensor_slices((x[keep], y[keep])).batch(BATCH)
    batches = [b for b in (min(BATCH, n - s) for s in range(0, n, BATCH)) if b >= blocks]
    ref.fit(ref_data, epochs=EPOCHS, verbose=0, shuffle=False)
    ref_scores = ref.evaluate(ref_data, verbose=0, return_dict=True)
    diff = max(float(np.max(np.abs(a - b))) for a, b in zip(full.get_weights(), ref.get_weights()))
    said = [str(w.message) for w in caught if "tfhybrid.data.shard" in str(w.message)]
    print("RESULT " + json.dumps({
        "rank": grid.rank, "size": grid.size, "n": n, "strategy": strategy,
        "steps": len(steps), "expected_steps": EPOCHS * len(batches),
        "weights_max_abs_diff": diff,
        "loss": scores["loss"], "ref_loss": ref_scores["loss"],
        "mae": scores["mae"], "ref_mae": ref_scores["mae"],
        "warnings": said[:2], "n_warnings": len(said)}), flush=True)
    tfhybrid.shutdown()


def cases(argv):
    """[(N, strategy)] from ``N [strategy]`` or ``N:strategy ...``."""
    if len(argv) <= 2 and not any(":" in a for a in argv):
        return [(int(argv[0]), argv[1] if len(argv) > 1 else "d")]
    return [(int(n), strategy) for n, strategy in (a.split(":") for a in argv)]


if __name__ == "__main__":
    for n, strategy in cases(sys.argv[1:]):
        main(n, strategy)
