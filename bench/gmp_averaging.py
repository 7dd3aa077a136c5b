"""gmp with SplitBrain's periodic model averaging (``average_every=N``, §4):
bytes per step and what N costs in accuracy, against single-process training.

``horovodrun -np 2 --gloo .venv/bin/python bench/gmp_averaging.py`` (and
``-np 4``): a small CNN (conv 8 -> pool -> conv 8 -> Dense 64 -> Dense 32 ->
Dense 10 softmax, 12x12x3 inputs) on a learnable synthetic task (labels of a
fixed random teacher network), two model groups (``mp = world / 2``,
``ccr_threshold=0``: every Dense layer in the model-parallel part), SGD,
global batch ``--batch``, ``--steps`` steps, for N = 1 (exact), 4 and 16
with ``averaging="p2p"`` and ``"ps"``. Per configuration:

* bytes per step per rank: every collective of one traced train step is
  recorded (``comm.backend.recording_collectives``; each name once:
  ``tf.cond`` traces the averaging branch twice; the eager guard and setup
  collectives of ``fit`` are not counted) with its shapes (batch dimensions
  filled with the local batch); the bytes a rank sends are those of the
  standard algorithms (ring allreduce 2(k-1)/k n; allgather (k-1) n_own;
  alltoall: rows sent to the others, tfhybrid's reduce-scatter and rooted
  reduce; broadcast: (k-1) n from the group's first rank, flat), averaged
  over the world; ``max KB``: the busiest rank's total (the parameter
  server under "ps"). Averaging collectives (named ``*.average*``) count
  1/N per step. Columns: gradient exchange + activations (``step``),
  averaging per step (``avg``), total;
* after training: the loss and accuracy of rank 0's gathered model (model
  group 0's copy) on a held-out set, and its relative distance to the
  single-process weights, ||w - w_ref|| / ||w_ref - w_0|| over all weights.
"""
from __future__ import annotations

import argparse
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import numpy as np
import tensorflow as tf

import tfhybrid
from tfhybrid.comm import backend

SHAPE, CLASSES = (12, 12, 3), 10


def cnn(seed=0):
    keras.utils.set_random_seed(seed)
    i = keras.Input(SHAPE)
    x = keras.layers.Conv2D(8, 3, padding="same", activation="relu", name="conv1")(i)
    x = keras.layers.MaxPooling2D(name="pool")(x)
    x = keras.layers.Conv2D(8, 3, padding="same", activation="relu", name="conv2")(x)
    x = keras.layers.Flatten(name="flat")(x)
    x = keras.layers.Dense(64, activation="relu", name="fc1")(x)
    x = keras.layers.Dense(32, activation="relu", name="fc2")(x)
    x = keras.layers.Dense(CLASSES, activation="softmax", name="out")(x)
    return keras.Model(i, x, name="cnn")


def task(n, seed):
    """Inputs and the labels a fixed random teacher network gives them."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n,) + SHAPE).astype(np.float32)
    teacher = cnn(seed=1234)
    return x, np.argmax(teacher.predict(x, verbose=0, batch_size=256), axis=-1).astype(np.int32)


def dataset(x, y, batch):
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(batch, drop_remainder=True)


def _rows(shape, local_batch):
    return [local_batch if d is None else int(d) for d in shape]


def sent_bytes(call, local_batch):
    """Bytes this rank sends for one recorded collective (standard algorithms,
    averaged over the group)."""
    op, name, ranks, inputs, splits = call
    k = len(ranks)
    if k <= 1:
        return 0.0
    sizes = [int(np.prod(_rows(t.shape, local_batch))) * t.dtype.size for t in inputs]
    n = float(sum(sizes))
    if op in ("allreduce", "grouped_allreduce"):
        return 2.0 * (k - 1) / k * n
    if op == "allgather":
        return (k - 1) * n
    if op == "broadcast":   # flat, from the group's first rank (the ps pull's root)
        return (k - 1) * n if backend.rank() == ranks[0] else 0.0
    if op == "alltoall":
        t = inputs[0]
        row = n / max(1, _rows(t.shape, local_batch)[0])
        me = ranks.index(backend.rank())
        if isinstance(splits, (list, tuple)):
            return row * sum(s for i, s in enumerate(splits) if i != me)
        return (k - 1) / k * n     # splits decided at run time: even blocks
    return n


def world_mean_max(value):
    """(mean, max) of ``value`` over the ranks."""
    values = backend.allgather(tf.constant([float(value)], tf.float64),
                               tuple(range(backend.size())), "bench.values").numpy()
    return float(np.mean(values)), float(np.max(values))


def run(every, averaging, args, data, grid):
    x, y = data
    pmodel = tfhybrid.transform(cnn(), "gmp", ccr_threshold=0, average_every=every,
                                averaging=averaging)
    opt = tfhybrid.DistributedOptimizer(keras.optimizers.SGD(args.lr))
    pmodel.compile(optimizer=opt, loss="sparse_categorical_crossentropy", jit_compile=False)
    local = args.batch // grid.size
    first = dataset(x[:args.batch], y[:args.batch], args.batch)
    with backend.recording_collectives() as calls:    # the one trace of the train step
        pmodel.fit(tfhybrid.data.shard(first, model=pmodel), epochs=1, shuffle=False,
                   verbose=0)
    rest = dataset(x[args.batch:], y[args.batch:], args.batch)
    pmodel.fit(tfhybrid.data.shard(rest, model=pmodel), epochs=1, shuffle=False, verbose=0)
    traced = {}   # by name: tf.cond traces the averaging branch twice (same names)
    for c in calls:
        if c[3] and all(tf.is_symbolic_tensor(t) for t in c[3]):
            traced.setdefault((c[0], c[1]), c)
    traced = list(traced.values())
    step = sum(sent_bytes(c, local) for c in traced if ".average" not in c[1])
    avg = sum(sent_bytes(c, local) for c in traced if ".average" in c[1]) / every
    return pmodel, world_mean_max(step)[0], world_mean_max(avg), world_mean_max(step + avg)[1]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--every", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--averaging", nargs="+", default=["p2p", "ps"])
    args = parser.parse_args()
    grid = tfhybrid.init(model_parallel=max(1, backend.launched_size() // 2))
    size, rank = grid.size, grid.rank
    data = task(args.steps * args.batch, seed=0)
    x_eval, y_eval = task(512, seed=1)

    ref = cnn()
    w0 = ref.get_weights()
    ref.compile(optimizer=keras.optimizers.SGD(args.lr), loss="sparse_categorical_crossentropy",
                metrics=["accuracy"], jit_compile=False)
    ref.fit(dataset(*data, args.batch), epochs=1, shuffle=False, verbose=0)
    ref_loss, ref_acc = ref.evaluate(x_eval, y_eval, verbose=0, batch_size=256)
    w_ref = ref.get_weights()
    moved = np.sqrt(sum(float(np.sum((a - b) ** 2)) for a, b in zip(w_ref, w0)))

    rows = []
    for every in args.every:
        for averaging in (args.averaging if every > 1 else args.averaging[:1]):
            pmodel, step, (avg, avg_max), busiest = run(every, averaging, args, data, grid)
            full = tfhybrid.gather(pmodel)
            full.compile(loss="sparse_categorical_crossentropy", metrics=["accuracy"],
                         jit_compile=False)
            loss, acc = full.evaluate(x_eval, y_eval, verbose=0, batch_size=256)
            dist = np.sqrt(sum(float(np.sum((a - b) ** 2))
                               for a, b in zip(full.get_weights(), w_ref))) / moved
            rows.append((every, averaging if every > 1 else "-", step, avg, busiest, loss, acc,
                         dist))
    if rank == 0:
        print(f"gmp periodic averaging: np {size}, mp {grid.model_size} "
              f"({grid.data_size} model groups), {args.steps} steps, global batch "
              f"{args.batch}, SGD lr {args.lr}; single process: loss {ref_loss:.4f} "
              f"acc {ref_acc:.3f}")
        print(f"{'N':>3} {'avg':>4} {'step KB':>9} {'avg KB':>8} {'total KB':>9} "
              f"{'vs N=1':>7} {'max KB':>8} {'loss':>7} {'acc':>6} {'dist':>8}")
        base = rows[0][2] + rows[0][3]
        for every, how, step, avg, busiest, loss, acc, dist in rows:
            total = step + avg
            print(f"{every:>3} {how:>4} {step / 1e3:>9.2f} {avg / 1e3:>8.2f} "
                  f"{total / 1e3:>9.2f} {total / base:>7.3f} {busiest / 1e3:>8.2f} "
                  f"{loss:>7.4f} {acc:>6.3f} {dist:>8.2e}")


if __name__ == "__main__":
    main()
