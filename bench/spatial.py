"""Halo overhead of SpatialConv2D/3D, with and without overlap, in one run.

Launch on every rank (the spatial group is the whole world)::

    .venv/bin/horovodrun -np 2 --gloo .venv/bin/python bench/spatial.py
    .venv/bin/horovodrun -np 4 --gloo .venv/bin/python bench/spatial.py

For each configuration, one training-like step (forward, then gradients
with respect to the input block and the weights, inside ``tf.function``) is
timed for three variants on the same block:

* ``local``: a plain Keras convolution of the block alone (``same``
  padding, no halo): the compute a spatial rank cannot avoid;
* ``halo_<method>``: ``SpatialConv2D``/``3D`` with ``overlap=False``
  (exchange the halo, then one convolution of the extended block), once per
  halo exchange method (``tfhybrid.comm.halo.HALO_METHODS``): ``axis`` (one
  alltoall per split axis in turn over the axis
  sub-group, corners forwarded), ``neighbour`` (one alltoall over the
  spatial group, splits empty except towards the ranks that need this
  rank's rows, corners sent directly), ``pairs`` (one 2-rank alltoall per
  neighbour pair, each on its own process set);
* ``overlap``: the same layer with ``overlap=True`` (interior convolution
  while the halo is in flight, then the boundary strips). The layers'
  default (``overlap=None``) overlaps only when a GPU is visible, because
  on CPU-only hosts, where the ranks share the cores, this variant is no
  faster (usually slower) than ``halo``.

Variants are interleaved round by round (the machine is noisy and shared)
and the median per-step time over rounds is reported, taking the slowest
rank (the one that sets the pace). The halo overhead ratio is
``halo / local`` (``overlap / local``), per method; ``neighbour/axis`` and
``pairs/axis`` compare the other methods with ``axis`` in the same run.
Bytes: the elements each method sends per forward exchange (recorded from
its splits when traced) over the analytic halo of the rank (the volume of
its halo-extended block minus the block, from the geometry), worst rank. The partial weight-gradient
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

import keras
import numpy as np
import tensorflow as tf

import tfhybrid
from tfhybrid.comm import backend, halo
from tfhybrid.layers import SpatialConv2D, SpatialConv3D

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


METHODS = ("axis", "neighbour", "pairs")   # tfhybrid.comm.halo.HALO_METHODS; "axis" = before


def variants(cfg):
    """``{name: (halo method or None, step function)}``: plain conv, the halo
    layer under every exchange method, and the overlapped layer (default method)."""
    _, spatial_cls, keras_cls, block, kernel, filters, split = cfg
    local = keras_cls(filters, kernel, padding="same")
    local.build((None,) + block[1:])
    out = {"local": (None, step_fn(local))}
    for method in METHODS:
        out[f"halo_{method}"] = (method, step_fn(spatial_cls.from_layer(local, split=split,
                                                                        overlap=False)))
    out["overlap"] = (None, step_fn(spatial_cls.from_layer(local, split=split, overlap=True)))
    return out


def analytic_halo_elements(cfg, k):
    """Elements of this rank's halo region per batch row (what its neighbours
    send it; with symmetric widths also what it sends): the volume of the
    halo-extended block minus the block, from the geometry alone."""
    _, _, _, block, kernel, filters, split = cfg
    nd = len(block) - 2
    from tfhybrid import spatial_geometry as sp
    shape = sp.grid_shape(split, nd, k)
    index = tfhybrid.grid().model_rank
    coords = []
    for s in reversed(shape):
        coords.append(index % s)
        index //= s
    coords = coords[::-1]
    ext = full = block[-1]
    w = kernel // 2
    for d in range(nd):
        n = block[1 + d]
        full *= n
        ext *= n + w * (shape[d] > 1 and coords[d] > 0) + w * (shape[d] > 1
                                                                 and coords[d] < shape[d] - 1)
    return ext - full


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


def measure(cfg, k):
    """Median seconds per step of every variant (slowest rank), and halo bytes
    sent per rank per forward exchange: measured per method (from the splits
    traced) over analytic (worst rank)."""
    variants_ = variants(cfg)
    x = tf.constant(np.random.default_rng(0).standard_normal(cfg[3]).astype(np.float32))
    sent = {}
    for name, (method, fn) in variants_.items():
        halo.set_halo_method(method)          # read when the step is traced (first call)
        halo.sent_log(clear=True)
        for _ in range(WARMUP):
            fn(x)
        if method:
            sent[method] = sum(e for _, e in halo.sent_log(clear=True))
    halo.set_halo_method(None)
    fns = {name: fn for name, (_, fn) in variants_.items()}
    samples = {name: [] for name in fns}
    for _ in range(ROUNDS):
        for name, fn in fns.items():
            samples[name].append(timed(fn, x))
    analytic = analytic_halo_elements(cfg, k)
    medians = np.array([statistics.median(samples[n]) for n in fns]
                       + [sent[m] / max(analytic, 1) for m in METHODS], np.float64)
    world = tuple(range(backend.size()))
    every = backend.allgather(tf.constant(medians[None]), world, "bench.medians").numpy()
    slowest = every.max(axis=0).tolist()
    times = dict(zip(fns, slowest[:len(fns)]))
    times["bytes_over_analytic"] = dict(zip(METHODS, [round(v, 3) for v in slowest[len(fns):]]))
    times["halo_bytes_per_rank"] = int(analytic * 4 * cfg[3][0])
    return times


def row(cfg, times, k):
    name, _, _, block, kernel, filters, split = cfg
    ratios = times.pop("bytes_over_analytic")
    halo_bytes = times.pop("halo_bytes_per_rank")
    out = {"config": name, "ranks": k, "split": list(split) if isinstance(split, tuple)
           else split, "block": list(block), "kernel": kernel, "filters": filters,
           "ms": {n: round(t * 1e3, 3) for n, t in times.items()},
           "overlap_ratio": round(times["overlap"] / times["local"], 3),
           "analytic_halo_bytes_per_rank": halo_bytes,
           "sent_over_analytic_bytes": ratios}
    for m in METHODS:
        out[f"halo_ratio_{m}"] = round(times[f"halo_{m}"] / times["local"], 3)
    out["halo_ratio"] = out[f"halo_ratio_{halo.halo_method()}"]
    return out


def table(rows):
    head = ("| config | ranks | block | local ms | " + " | ".join(
        f"halo/local {m}" for m in METHODS) + " | neighbour/axis | pairs/axis | overlap/local "
        "| analytic halo B/rank | " + " | ".join(f"sent/analytic {m}" for m in METHODS) + " |")
    lines = [head, "|" + "---|" * (8 + 2 * len(METHODS))]
    for r in rows:
        ms = r["ms"]
        lines.append(
            f"| {r['config']} | {r['ranks']} | {'x'.join(map(str, r['block']))} | "
            f"{ms['local']:.2f} | " + " | ".join(f"{r[f'halo_ratio_{m}']:.2f}" for m in METHODS)
            + f" | {ms['halo_neighbour'] / ms['halo_axis']:.2f} | "
            f"{ms['halo_pairs'] / ms['halo_axis']:.2f} | {r['overlap_ratio']:.2f} | "
            f"{r['analytic_halo_bytes_per_rank']} | "
            + " | ".join(f"{r['sent_over_analytic_bytes'][m]:.3f}" for m in METHODS) + " |")
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
    rows = [row(cfg, measure(cfg, k), k) for cfg in configs(k)]
    if tfhybrid.is_root():
        print(table(rows), flush=True)
        save(rows, k)


if __name__ == "__main__":
    main()
