"""User script: the ways ranks silently disagree, as users write them.

    horovodrun -np 4 python guard_cases.py good          # model groups of 2
    horovodrun -np 2 python guard_cases.py per_rank_shuffle
    horovodrun -np 2 python guard_cases.py perturbed
    horovodrun -np 2 python guard_cases.py late_rows     # guard_every_steps=4
    horovodrun -np 2 python guard_cases.py drift         # d; weights apart after step 1
    horovodrun -np 2 python guard_cases.py late_drift    # after step 5, every 4 steps

``good``: a plain Keras optimizer (wrapped by compile, with a warning; the
weights after 3 steps equal single-process training), an unseeded
``dataset.shuffle()`` built after init and ``fit(shuffle=True)`` on sharded
arrays (the guards check every step and must stay quiet), and data.shard of
a dataset of single samples (refused, or batched with batch_size=).
The other cases must raise tfhybrid.guards.ConsistencyError on every rank.
"""
import argparse
import json
import os
import warnings

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import keras
import numpy as np
import tensorflow as tf

import tfhybrid

B = 16


def make_model():
    inputs = keras.Input((6, 6, 1))
    x = keras.layers.Conv2D(4, 3, padding="same", activation="relu", name="conv")(inputs)
    x = keras.layers.Flatten(name="flat")(x)
    x = keras.layers.Dense(8, activation="relu", name="fc1")(x)
    return keras.Model(inputs, keras.layers.Dense(4, name="fc2")(x))


def data(n):
    x = np.random.default_rng(1).standard_normal((n, 6, 6, 1)).astype("float32")
    y = np.random.default_rng(2).integers(0, 4, n)
    return x, y


def loss():
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def good(grid):
    out = {"rank": grid.rank}
    x, y = data(B * 3)
    keras.utils.set_random_seed(0)
    ref = make_model()
    ref.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9), loss=loss())
    for s in range(3):
        ref.train_on_batch(x[s * B:(s + 1) * B], y[s * B:(s + 1) * B])
    keras.utils.set_random_seed(0)
    model = tfhybrid.transform(make_model(), "df")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9), loss=loss())
    out["wrapped"] = type(model.optimizer).__name__
    out["warned"] = any("wrapped in tfhybrid.DistributedOptimizer" in str(w.message)
                        for w in caught)
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(B, drop_remainder=True)
    model.fit(tfhybrid.data.shard(ds, model=model), epochs=1, verbose=0, shuffle=False)
    full = tfhybrid.gather(model)
    out["plain_optimizer_rel"] = max(
        float(np.max(np.abs(a.numpy() - b.numpy())) / (np.max(np.abs(b.numpy())) + 1e-12))
        for a, b in zip(full.trainable_variables, ref.trainable_variables))
    # An unseeded shuffle built after init, and fit(shuffle=True) on sharded arrays:
    # the guards compare every step's batch across each model group.
    x, y = data(B * 6)
    shuffled = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(len(x)).batch(B, drop_remainder=True)
    h = model.fit(tfhybrid.data.shard(shuffled, model=model), epochs=2, verbose=0)
    out["unseeded_shuffle_epochs"] = len(h.epoch)
    xs, ys = tfhybrid.data.shard((x, y), batch_size=B, model=model)
    h = model.fit(xs, ys, batch_size=tfhybrid.data.local_batch_size(B, model), epochs=2,
                  verbose=0)   # shuffle=True is Keras' default
    out["array_shuffle_epochs"] = len(h.epoch)
    # A dataset of single samples: refused without batch_size, batched with it.
    samples = tf.data.Dataset.from_tensor_slices((x, y))
    try:
        tfhybrid.data.shard(samples, model=model)
        out["unbatched_error"] = None
    except ValueError as err:
        out["unbatched_error"] = str(err)
    local = next(iter(tfhybrid.data.shard(samples, model=model, batch_size=B)))
    out["unbatched_local_rows"] = int(local[0].shape[0])
    print("RESULT " + json.dumps(out), flush=True)


def per_rank_shuffle(grid):
    x, y = data(B * 4)
    model = tfhybrid.transform(make_model(), "df")
    model.compile(optimizer=tfhybrid.DistributedOptimizer(keras.optimizers.SGD(0.1)), loss=loss())
    ds = (tf.data.Dataset.from_tensor_slices((x, y)).shuffle(len(x), seed=grid.rank)
          .batch(B, drop_remainder=True))
    model.fit(tfhybrid.data.shard(ds, model=model), epochs=1, verbose=0,
              callbacks=tfhybrid.callbacks.standard())


def perturbed(grid):
    x, y = data(B * 4)
    model = tfhybrid.transform(make_model(), "df")
    if grid.rank == 1:      # e.g. load_weights on some ranks only, after transform
        w = model.get_layer("fc2").bias
        w.assign(w + 1.0)
    model.compile(optimizer=tfhybrid.DistributedOptimizer(keras.optimizers.SGD(0.1)), loss=loss())
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(B, drop_remainder=True)
    model.fit(tfhybrid.data.shard(ds, model=model), epochs=1, verbose=0)   # no broadcast


def late_rows(grid):
    """Ranks feed different rows at step 4 only, with guard_every_steps=4:
    the steps between the guarded ones skip the batch checksum, step 4's must
    run again and catch it."""
    x, y = data(B * 5)
    if grid.rank == 1:      # e.g. a per-rank augmentation kicking in late
        x[3 * B:4 * B] = x[3 * B:4 * B][::-1].copy()
    model = tfhybrid.transform(make_model(), "df")
    model.compile(optimizer=tfhybrid.DistributedOptimizer(keras.optimizers.SGD(0.1)), loss=loss())
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(B, drop_remainder=True)
    model.fit(tfhybrid.data.shard(ds, model=model), epochs=1, verbose=0,
              callbacks=tfhybrid.callbacks.standard())


class _Nudge(keras.callbacks.Callback):
    """On rank 1 only, nudge a replicated weight after step ``after``: the
    replicas drift apart, as a rank-local ``set_weights`` in a callback does."""

    def __init__(self, rank, after):
        super().__init__()
        self.rank, self.after = rank, after

    def on_train_batch_end(self, batch, logs=None):
        if self.rank == 1 and batch + 1 == self.after:
            w = self.model.get_layer("fc2").bias
            w.assign(w + 1e-3)


def drift(grid, after=1):
    """Data parallelism (``d``); rank 1 changes a weight after step ``after``:
    the weight check (inside the traced step at step 2 and every
    guard_every_steps steps) must name the weight and the step."""
    x, y = data(B * 9)
    model = tfhybrid.transform(make_model(), "d")
    model.compile(optimizer=tfhybrid.DistributedOptimizer(keras.optimizers.SGD(0.1)), loss=loss())
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(B, drop_remainder=True)
    model.fit(tfhybrid.data.shard(ds, model=model), epochs=1, verbose=0,
              callbacks=tfhybrid.callbacks.standard() + [_Nudge(grid.rank, after)])


def late_drift(grid):
    """As ``drift``, after step 5 with guard_every_steps=4: steps 6 and 7 gather
    nothing, step 8's traced step must gather the weights again."""
    drift(grid, after=5)


def pydataset_shuffle(grid):
    """The Keras tutorial's PyDataset, reshuffled with the unseeded np.random
    (tfhybrid.init seeds TensorFlow only): each rank of a model group reads
    other rows."""
    x, y = data(B * 4)
    np.random.seed(None)        # as a script that never seeds numpy

    class Batches(keras.utils.PyDataset):
        def __init__(self):
            super().__init__()
            self.order = np.arange(len(x))

        def __len__(self):
            return len(x) // B

        def __getitem__(self, i):
            rows = self.order[i * B:(i + 1) * B]
            return x[rows], y[rows]

        def on_epoch_end(self):
            np.random.shuffle(self.order)

    model = tfhybrid.transform(make_model(), "df")
    model.compile(optimizer=tfhybrid.DistributedOptimizer(keras.optimizers.SGD(0.1)), loss=loss())
    model.fit(Batches(), epochs=2, verbose=0)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("case", choices=["good", "per_rank_shuffle", "perturbed", "late_rows",
                                         "pydataset_shuffle", "drift", "late_drift"])
    args = ap.parse_args()
    every = 4 if args.case in ("late_rows", "late_drift") else 1
    grid = tfhybrid.init(model_parallel=1 if "drift" in args.case else 2,
                         config=tfhybrid.Config(guard_every_steps=every))
    globals()[args.case](grid)


if __name__ == "__main__":
    main()
