"""Halo overhead of SpatialConv2D/3D, with and without overlap, in one run.

Launch on every rank (the spatial group is the whole world)::

    .venv/bin/horovodrun -np 2 --gloo .venv/bin/python bench/spatial.py
    .venv/bin/horovodrun -np 4 --gloo .venv/bin/python bench/spatial.py

For each configuration, one training-like step (forward, then gradients
with respect to the input block and the weights, inside ``tf.function``) is
timed for three variants on the same block:

* ``local``: a plain Keras convolution of the block alone (``same``
  padding, no halo): the compute a spatial rank cannot avoid;
* ``halo``: ``SpatialConv2D``/``3D`` with ``overlap=False`` (exchange the
  halo, then one convolution of the extended block);
* ``overlap``: the same layer with ``overlap=True`` (interior convolution
  while the halo is in flight, then the boundary strips). The layers'
  default (``overlap=None``) overlaps only when a GPU is visible, because
  on CPU-only hosts, where the ranks share the cores, this variant is
  measured no faster (usually slower) than ``halo``.

Variants are interleaved round by round (the machine is noisy and shared)
and the median per-step time over rounds is reported, taking the slowest
rank (the one that sets the pace). The halo overhead ratio is
``halo / local`` (``overlap / local``). The partial weight-gradient
reduction is the optimizer's job and is not timed. Results: a markdown
table on stdout and ``bench/results/spatial.json`` (keyed by world size).
"""
from __future__ import annotations

import json
import os
import pathlib
import statistics
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tfhybrid  # noqa: E402
from tfhybrid.comm import backend  # noqa: E402
from tfhybrid.layers import SpatialConv2D, SpatialConv3D  # noqa: E402

ROUNDS, ITERS, WARMUP = int(os.environ.get("BENCH_ROUNDS", 7)), 3, 2
RESULTS = pathlib.Path(__file__).parent / "results" / "spatial.json"


def configs(k):
    """(name, spatial class, keras class, block shape, kernel, filters, split)."""
    out = [
        ("conv2d 3x3 h-split", SpatialConv2D, keras.layers.Conv2D, (4, 32, 64, 32), 3, 32,
         "height"),
        ("conv2d 5x5 h-split", SpatialConv2D, keras.layers.Conv2D, (4, 32, 64, 32), 5, 32,
         "height"),
        ("conv2d 3x3 small block", SpatialConv2D, keras.layers.Conv2D, (4, 8, 32, 16), 3, 16,
         "height"),
    ]
    if k == 4:
        out.append(("conv2d 3x3 2x2 grid", SpatialConv2D, keras.layers.Conv2D,
                    (4, 32, 32, 32), 3, 32, (2, 2)))
    out.append(("conv3d 3x3x3 d-split", SpatialConv3D, keras.layers.Conv3D,
                (2, 8, 16, 16, 8), 3, 8, "depth"))
    return out


def step_fn(layer):
    """A tf.function computing the layer's output and its input/weight gradients."""
    @tf.function
    def step(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            loss = tf.reduce_sum(tf.square(layer(x)))
        return tape.gradient(loss, [x] + layer.trainable_variables)
    return step


def variants(cfg):
    _, spatial_cls, keras_cls, block, kernel, filters, split = cfg
    local = keras_cls(filters, kernel, padding="same")
    local.build((None,) + block[1:])
    halo = spatial_cls.from_layer(local, split=split, overlap=False)
    overlap = spatial_cls.from_layer(local, split=split, overlap=True)
    return {"local": step_fn(local), "halo": step_fn(halo), "overlap": step_fn(overlap)}


def barrier():
    """All ranks start a timed block together (a one-element allreduce).

    ``backend.barrier`` calls ``hvd.barrier``, which horovod 0.28.1's
    TensorFlow module does not have.
    """
    if backend.size() > 1:
        backend.allreduce(tf.zeros([1]), tuple(range(backend.size())), "bench.barrier").numpy()


def timed(fn, x):
    barrier()
    start = time.perf_counter()
    for _ in range(ITERS):
        out = fn(x)
    _ = [t.numpy() for t in out]
    return (time.perf_counter() - start) / ITERS


def measure(cfg):
    """Median seconds per step of every variant (slowest rank)."""
    fns = variants(cfg)
    x = tf.constant(np.random.default_rng(0).standard_normal(cfg[3]).astype(np.float32))
    for fn in fns.values():
        for _ in range(WARMUP):
            fn(x)
    samples = {name: [] for name in fns}
    for _ in range(ROUNDS):
        for name, fn in fns.items():
            samples[name].append(timed(fn, x))
    medians = np.array([statistics.median(samples[n]) for n in fns], np.float64)
    world = tuple(range(backend.size()))
    slowest = backend.allgather(tf.constant(medians[None]), world, "bench.medians").numpy()
    return dict(zip(fns, slowest.max(axis=0).tolist()))


def row(cfg, times, k):
    name, _, _, block, kernel, filters, split = cfg
    return {"config": name, "ranks": k, "split": list(split) if isinstance(split, tuple)
            else split, "block": list(block), "kernel": kernel, "filters": filters,
            "ms": {n: round(t * 1e3, 3) for n, t in times.items()},
            "halo_ratio": round(times["halo"] / times["local"], 3),
            "overlap_ratio": round(times["overlap"] / times["local"], 3),
            "overlap_vs_halo": round(times["overlap"] / times["halo"], 3)}


def table(rows):
    lines = ["| config | ranks | block | local ms | halo ms | overlap ms | halo/local | "
             "overlap/local | overlap/halo |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ms = r["ms"]
        lines.append(f"| {r['config']} | {r['ranks']} | {'x'.join(map(str, r['block']))} | "
                     f"{ms['local']:.2f} | {ms['halo']:.2f} | {ms['overlap']:.2f} | "
                     f"{r['halo_ratio']:.2f} | {r['overlap_ratio']:.2f} | "
                     f"{r['overlap_vs_halo']:.2f} |")
    return "\n".join(lines)


def save(rows, k):
    data = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    data[f"np{k}"] = {"rounds": ROUNDS, "iters": ITERS, "unit": "ms per step (median of "
                      "rounds, slowest rank)", "rows": rows,
                      "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(data, indent=2) + "\n")


def main():
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(2)
    k = backend.launched_size()
    tfhybrid.init(model_parallel=k)
    rows = [row(cfg, measure(cfg), k) for cfg in configs(k)]
    if tfhybrid.is_root():
        print(table(rows), flush=True)
        save(rows, k)


if __name__ == "__main__":
    main()
