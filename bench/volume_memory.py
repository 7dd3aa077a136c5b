"""Peak resident memory per rank training a 3-D model on a large volume, 1/2/4 ranks under s.

Gholami et al. and ParaDL: a sample that does not fit one device is split
spatially. For each world size ``p`` the driver launches
``p`` workers (``horovodrun -np p --gloo`` for p > 1, a plain process for
p = 1) that write nothing but read their blocks of the synthetic volumes
with ``tfhybrid.data.volumes`` (one memory-mapped ``.npy``) and train a few
steps: the unmodified model at p = 1, ``tfhybrid.transform(model, "s")``
(depth split) at p > 1. Each rank reports its peak resident set
(``ru_maxrss``), its resident set just before ``fit`` (TensorFlow, the
model, the graph: what does not scale with the volume) and the growth
during ``fit``. Printed beside them:

* ``describe``: ``tfhybrid.describe(model).param_bytes`` (this rank's
  parameters; under ``s`` all are replicated);
* ``oracle``: ``tfhybrid.oracle.predict(model, "s"|"serial", p, B,
  machine).memory_bytes`` (ParaDL Table 3's activations + parameters per
  rank, times the machine's gamma);
* ``ideal = peak(1)/p + replicated params`` and ``ratio = peak(p)/ideal``
  (whole resident set); ``fit ratio``, the same on the growth during
  ``fit`` (``growth(1)/p + params``), which leaves out the fixed runtime
  each process carries: the target (about 1) is the fit ratio.

Models: ``--model unet`` (default: the 3-D U-Net of
``tests/parallel/unet_models.py``, depth 2, BatchNormalization; every layer
on blocks under ``s``) or ``--model cosmoflow`` (a CosmoFlow-like encoder:
Conv3D and MaxPooling3D stacks, then Dense, 4 regression targets).

Reading the table (one row per p, its worst rank; ``runtime`` is the
resident set before ``fit``; ``vol`` subtracts each rank's growth training
the same model on small volumes, see ``--baseline``): a ``fit ratio`` or
``vol ratio`` near 1 means the memory that grows with the volume scales as
single/p. What a rank holds beyond single/p is its halo rows (a middle rank
receives two per convolution) and Horovod's fusion buffer (``--fusion_mb``;
the buffer is allocated during ``fit`` at p > 1 only, so it counts in the
growth); the allocator columns (``--tensors``) add its rounding and
fragmentation, which move with the order ops run in. Each rank of ``s`` also
grows by a fixed amount during ``fit`` whatever the volume (the traced step
of a spatial model has many more ops than the original's), while
``growth(1)/p`` spreads p = 1's smaller fixed growth over the ranks: the
``fit ratio`` charges that to p > 1, the ``vol ratio`` does not, and it
weighs less as the volume grows.

Halo pieces are what ``tfhybrid.layers.spatial.core.block_conv`` (a ``same``
convolution of the block plus thin convolutions of the received halo pieces,
added in place) keeps small: only the received rows are kept from forward to
backward, not the thin ``valid``-convolution input they are framed into; the
frame of zeros is a ``tf.pad`` fused into the convolution, because
``tf.zeros`` of static shape are folded by Grappler into constants that a
traced function holds for its lifetime (one per frame, forward and
backward); the backward pads again; and the anchor that keeps a rank's
alltoall in the graph sits on a thin output rather than copying a piece per
convolution. ``--trace``'s allocator events per op show where any excess
comes from.

The oracle's ParaDL Table 3 estimate (gamma of the calibrated machine, fitted
on the calibration CNN) is several times the growth this bench reports: it
counts every layer's input and output twice, which TensorFlow does not keep.

``python bench/record.py -- COMMAND`` adds a run's table to
docs/benchmarks.md.

``--tensors`` runs TensorFlow's BFC allocator on CPU
(``TF_CPU_ALLOCATOR_USE_BFC=true``) and prints each p's worst peak of its
tensor memory during ``fit`` (no malloc arenas or runtime; the resident-set
columns then stop scaling, as that allocator keeps the regions it grew, so
read only its lines). ``--trace`` adds one step under TensorFlow's profiler
and prints the peak of the bytes its tensors requested (the allocator's
per-op events summed at their requested sizes: no rounding or fragmentation).

Usage (the whole run needs about 5 GB of memory)::

    .venv/bin/python bench/volume_memory.py                 # p = 1, 2, 4
    .venv/bin/python bench/volume_memory.py --size 64 --nps 1 4 --steps 1
    .venv/bin/python bench/volume_memory.py --trace --fusion_mb 1 --baseline 0

A worker can run under a memory limit (``--limit_mb``: ``RLIMIT_DATA``, the
private writable memory a process may map; see
``tests/integration/test_volume_memory_limit.py``): it then reports whether
training finished or ran out of memory.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
PY = sys.executable
HOROVODRUN = os.path.join(os.path.dirname(PY), "horovodrun")
MB = 2 ** 20


def _args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", choices=("unet", "cosmoflow"), default="unet")
    ap.add_argument("--size", type=int, default=None,
                    help="volume edge D = H = W (default: 96 unet, 128 cosmoflow)")
    ap.add_argument("--channels", type=int, default=None, help="default: 1 unet, 2 cosmoflow")
    ap.add_argument("--filters", type=int, default=None,
                    help="filters of the full-size convs (default: 8 unet, 12 cosmoflow)")
    ap.add_argument("--batch", type=int, default=None, help="global batch (default: 3 unet, "
                    "4 cosmoflow)")
    ap.add_argument("--samples", type=int, default=0, help="samples on disk (default 2 batches)")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--nps", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--machine", default=None, help="oracle machine JSON (default cpu_box)")
    ap.add_argument("--limit_mb", type=int, default=0, help="RLIMIT_DATA per process (MiB)")
    ap.add_argument("--fusion_mb", type=float, default=0,
                    help="Horovod's tensor-fusion buffer (tfhybrid.Config("
                    "fusion_threshold_bytes)); 0: Horovod's default, 128 MiB")
    ap.add_argument("--data_dir", default=None, help="where the .npy volumes are written")
    ap.add_argument("--baseline", type=int, default=16,
                    help="also train the same model on volumes of this edge at each p, to "
                    "measure what fit adds that does not scale with the volume (tracing, "
                    "Horovod's buffers); 0: skip")
    ap.add_argument("--tensors", action="store_true",
                    help="also report each rank's peak of TensorFlow tensor memory during "
                    "fit (TF_CPU_ALLOCATOR_USE_BFC=true: the allocator's statistics; no "
                    "malloc arenas or runtime; Horovod's fusion buffer counts: use "
                    "--fusion_mb 1)")
    ap.add_argument("--trace", action="store_true",
                    help="also trace one more step with TensorFlow's profiler (implies "
                    "--tensors) and report the peak of the bytes its tensors requested "
                    "(live allocations summed at their requested sizes: no allocator "
                    "rounding or fragmentation)")
    ap.add_argument("--json", default=None, help="write the rows to this JSON file")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)   # output directory
    args = ap.parse_args(argv)
    if args.trace:
        args.tensors = True
    defaults = {"unet": (96, 1, 8, 3), "cosmoflow": (128, 2, 12, 4)}[args.model]
    for name, value in zip(("size", "channels", "filters", "batch"), defaults):
        if getattr(args, name) is None:
            setattr(args, name, value)
    return args


# -- the models ----------------------------------------------------------------------

def cosmoflow_like(size, channels, filters, targets=4):
    """Two Conv3D at full size, then Conv3D + MaxPooling3D stacks down to 4^3, Dense."""
    import keras

    keras.utils.set_random_seed(0)
    i = keras.Input((size, size, size, channels))
    x = keras.layers.Conv3D(filters, 3, padding="same", activation="relu", name="conv1")(i)
    x = keras.layers.Conv3D(filters, 3, padding="same", activation="relu", name="conv2")(x)
    x = keras.layers.MaxPooling3D(2, name="pool1")(x)
    n, k = size // 2, 2
    while n > 4:
        x = keras.layers.Conv3D(filters, 3, padding="same", activation="relu",
                                name=f"conv{k + 1}")(x)
        x = keras.layers.MaxPooling3D(2, name=f"pool{k}")(x)
        n, k = n // 2, k + 1
    x = keras.layers.Flatten(name="flat")(x)
    x = keras.layers.Dense(32, activation="relu", name="fc1")(x)
    return keras.Model(i, keras.layers.Dense(targets, name="targets")(x), name="cosmoflow_like")


def unet(size, channels, filters, classes=3):
    """The 3-D U-Net of tests/parallel/unet_models.py, depth 2, BatchNormalization."""
    sys.path.insert(0, os.path.join(ROOT, "tests", "parallel"))
    from unet_models import unet3d

    return unet3d((size, size, size, channels), classes=classes, filters=filters, depth=2)


def build(args):
    if args.model == "unet":
        return unet(args.size, args.channels, args.filters)
    return cosmoflow_like(args.size, args.channels, args.filters)


def write_data(args, directory):
    """x.npy (N, S, S, S, C) float32 and y.npy, written in chunks (little driver memory)."""
    import numpy as np

    n = args.samples or 2 * args.batch
    shape = (n,) + (args.size,) * 3 + (args.channels,)
    x = np.lib.format.open_memmap(os.path.join(directory, "x.npy"), "w+", np.float32, shape)
    rng = np.random.default_rng(0)
    for i in range(n):
        x[i] = rng.standard_normal(shape[1:], dtype=np.float32)
    x.flush()
    del x
    if args.model == "unet":
        y = rng.integers(0, 3, (n,) + (args.size,) * 3).astype(np.int32)
    else:
        y = rng.standard_normal((n, 4)).astype(np.float32)
    np.save(os.path.join(directory, "y.npy"), y)
    return n


# -- one rank ----------------------------------------------------------------------

def _rss_mb():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def _current_rss_mb():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / MB


def _vm_data_mb():
    """This process's private writable memory (``VmData``, what RLIMIT_DATA bounds)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmData:"):
                return int(line.split()[1]) / 1024.0
    return 0.0


def _poll_vm_data(peak, period=0.005):
    """Track the peak VmData (the kernel keeps no high-water mark of it) in a thread."""
    import threading
    import time

    def loop():
        while True:
            peak[0] = max(peak[0], _vm_data_mb())
            time.sleep(period)

    threading.Thread(target=loop, daemon=True, name="vm_data_peak").start()


def worker(args):
    if args.limit_mb:
        limit = args.limit_mb * MB
        resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))
    vm_peak = [0.0]
    _poll_vm_data(vm_peak)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import keras
    import tensorflow as tf

    import tfhybrid

    size = int(os.environ.get("HOROVOD_SIZE", "1") or 1)
    tf.config.threading.set_intra_op_parallelism_threads(
        int(os.environ.get("TF_NUM_INTRAOP_THREADS", 1)))
    tf.config.threading.set_inter_op_parallelism_threads(
        int(os.environ.get("TF_NUM_INTEROP_THREADS", 2)))
    config = None
    if args.fusion_mb:
        config = tfhybrid.Config(fusion_threshold_bytes=int(args.fusion_mb * MB))
    grid = tfhybrid.init(model_parallel=size, config=config)
    original = build(args)
    model = tfhybrid.transform(original, "s") if size > 1 else original
    loss = "mse" if args.model == "cosmoflow" else "sparse_categorical_crossentropy"
    optimizer = keras.optimizers.SGD(1e-3)
    model.compile(optimizer=tfhybrid.DistributedOptimizer(optimizer) if size > 1 else optimizer,
                  loss=loss, jit_compile=False)
    data = os.path.join(args.data_dir, "x.npy"), os.path.join(args.data_dir, "y.npy")
    ds = tfhybrid.data.volumes(*data, batch_size=args.batch, model=model if size > 1 else None)
    machine = args.machine or os.path.join(ROOT, "tfhybrid", "oracle", "machines",
                                           "cpu_box.json")
    strategy = "s" if size > 1 else "serial"
    pred = tfhybrid.oracle.predict(original, strategy, size, args.batch, machine)
    params = sum(int(v.numpy().nbytes) for v in model.trainable_variables)
    described = None
    if size > 1:
        described = tfhybrid.describe(model, batch_size=args.batch, print_fn=None).param_bytes
    before, now = _rss_mb(), _current_rss_mb()
    row = {"p": size, "rank": grid.rank, "block": list(ds.element_spec[0].shape),
           "before_mb": before, "rss_before_fit_mb": now, "param_mb": params / MB,
           "describe_param_mb": None if described is None else described / MB,
           "oracle_mb": pred.memory_bytes / MB, "limit_mb": args.limit_mb}
    row["vm_data_before_fit_mb"] = _vm_data_mb()
    path = os.path.join(args.worker, f"rank{grid.rank}.json")
    with open(path, "w") as f:       # ok=None: reached fit (overwritten when it returns)
        json.dump(dict(row, ok=None, peak_mb=_rss_mb(), growth_mb=0.0,
                       vm_data_peak_mb=vm_peak[0]), f)
    tensors = os.environ.get("TF_CPU_ALLOCATOR_USE_BFC") == "true"
    if tensors:
        tf.config.experimental.reset_memory_stats("CPU:0")
    try:
        model.fit(ds, epochs=1, steps_per_epoch=args.steps, verbose=0)
        row["ok"] = True
        if tensors:
            row["tensor_peak_mb"] = tf.config.experimental.get_memory_info("CPU:0")["peak"] / MB
        if tensors and args.trace:
            row["step_requested_peak_mb"] = traced_step_peak(model, ds) / MB
    except (tf.errors.OpError, MemoryError) as err:     # OOM, oneDNN "could not create"
        row["ok"], row["error"] = False, f"{type(err).__name__}: {str(err)[:200]}"
    row["peak_mb"] = _rss_mb()
    row["vm_data_peak_mb"] = max(vm_peak[0], _vm_data_mb())
    row["growth_mb"] = row["peak_mb"] - max(before, now)
    with open(path, "w") as f:
        json.dump(row, f)
    if not row["ok"]:
        sys.stdout.flush()
        os._exit(3)      # peers may wait in a collective: leave at once


def requested_peak(xplane_path):
    """The peak of the bytes live tensors requested, over the allocations a
    profiler trace (``*.xplane.pb``) records: the BFC allocator's
    MemoryAllocation / MemoryDeallocation events, each allocation counted at
    its requested size from its allocation to its deallocation (allocations
    made before the trace, e.g. weights and optimizer slots, are not counted)."""
    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    space = xplane_pb2.XSpace()
    with open(xplane_path, "rb") as f:
        space.ParseFromString(f.read())
    events = []
    for plane in space.planes:
        names, stats = plane.event_metadata, plane.stat_metadata
        for line in plane.lines:
            for ev in line.events:
                kind = names[ev.metadata_id].name
                if kind not in ("MemoryAllocation", "MemoryDeallocation"):
                    continue
                vals = {stats[x.metadata_id].name: x.int64_value or x.uint64_value
                        for x in ev.stats}
                events.append((line.timestamp_ns * 1000 + ev.offset_ps,
                               kind == "MemoryAllocation", vals.get("addr"),
                               vals.get("requested_bytes", 0)))
    live, now, peak = {}, 0, 0
    for _, alloc, addr, size in sorted(events, key=lambda e: e[0]):
        if alloc:
            now += size - live.get(addr, 0)
            live[addr] = size
        else:
            now -= live.pop(addr, 0)
        peak = max(peak, now)
    return peak


def traced_step_peak(model, ds):
    """One more training step under TensorFlow's profiler: the peak of the bytes
    its tensors requested (:func:`requested_peak`)."""
    import glob

    import tensorflow as tf

    logdir = tempfile.mkdtemp(prefix="vm_trace_")
    try:
        tf.profiler.experimental.start(logdir)
        try:
            model.fit(ds, epochs=1, steps_per_epoch=1, verbose=0)
        finally:
            tf.profiler.experimental.stop()
        paths = glob.glob(os.path.join(logdir, "**", "*.xplane.pb"), recursive=True)
        return requested_peak(paths[0]) if paths else float("nan")
    finally:
        shutil.rmtree(logdir, ignore_errors=True)


# -- the driver --------------------------------------------------------------------

def run(args, p, out_dir, timeout=1800):
    """Launch ``p`` workers; their per-rank rows (missing ranks: killed, e.g. by the OOM)."""
    cmd = [PY, os.path.abspath(__file__), "--worker", out_dir, "--data_dir", args.data_dir,
           "--model", args.model, "--size", str(args.size), "--channels", str(args.channels),
           "--filters", str(args.filters), "--batch", str(args.batch), "--steps",
           str(args.steps), "--limit_mb", str(args.limit_mb), "--fusion_mb", str(args.fusion_mb)]
    if getattr(args, "trace", False):
        cmd += ["--trace"]
    if args.machine:
        cmd += ["--machine", args.machine]
    if p > 1:
        cmd = [HOROVODRUN, "-np", str(p), "--gloo"] + cmd
    env = dict(os.environ, TF_NUM_INTRAOP_THREADS=os.environ.get("TF_NUM_INTRAOP_THREADS", "1"),
               TF_NUM_INTEROP_THREADS=os.environ.get("TF_NUM_INTEROP_THREADS", "2"),
               OMP_NUM_THREADS="1", TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=ROOT)
    if getattr(args, "tensors", False):
        env["TF_CPU_ALLOCATOR_USE_BFC"] = "true"
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)
    rows = []
    for r in range(p):
        path = os.path.join(out_dir, f"rank{r}.json")
        if os.path.exists(path):
            with open(path) as f:
                rows.append(json.load(f))
    return proc, rows


def _volume_growth(row, base):
    """Fit growth of ``row`` above the same rank's growth on the baseline volume."""
    same = [b for b in base or [] if b["rank"] == row["rank"] and b.get("ok")]
    return row["growth_mb"] - same[0]["growth_mb"] if same else None


def volume_ratios(rows_by_p, base_by_p):
    """Per world size: (worst rank's volume growth, volume ratio), where the volume
    growth is fit's growth minus the same rank's growth on the baseline volume
    and the ratio divides it by volume growth(1)/p + params; None without a
    baseline."""
    one, out = rows_by_p.get(1), {}
    if not (one and one[0].get("ok") and base_by_p):
        return out
    g1 = _volume_growth(one[0], base_by_p.get(1))
    for p, rows in rows_by_p.items():
        grown = [(_volume_growth(r, base_by_p.get(p)), r) for r in rows]
        grown = [(g, r) for g, r in grown if g is not None]
        if g1 is None or not grown or len(grown) < len(rows):
            continue
        g, r = max(grown, key=lambda t: t[0])
        out[p] = (g, g / (g1 / p + r["param_mb"]))
    return out


def _worst_per_p(rows_by_p, key):
    """Per world size whose every rank reported ``key``: the worst rank's value."""
    return {p: max(r[key] for r in rows) for p, rows in rows_by_p.items()
            if rows and all(key in r for r in rows)}


def summary(rows_by_p, fusion=0, base_by_p=None, baseline=0):
    """The printed table: per world size, the worst rank, beside the estimates."""
    one = rows_by_p.get(1)
    vol = volume_ratios(rows_by_p, base_by_p)
    lines = [f"{'p':>2} {'block (local batch, D, H, W, C)':<32}{'peak MB':>9}{'runtime':>9}"
             f"{'fit +MB':>9}"
             f"{'oracle MB':>10}{'describe MB':>12}{'ideal MB':>10}{'ratio':>7}"
             f"{'fit ratio':>10}{'vol +MB':>9}{'vol ratio':>10}  ok"]
    for p, rows in sorted(rows_by_p.items()):
        if not rows:
            lines.append(f"{p:>2} (no rank reported: killed)")
            continue
        worst = max(rows, key=lambda r: r["peak_mb"])
        ideal = ratio = fit_ratio = None
        if one and one[0].get("ok"):
            ideal = one[0]["peak_mb"] / p + worst["param_mb"]
            ratio = worst["peak_mb"] / ideal
            fit_ideal = one[0]["growth_mb"] / p + worst["param_mb"]
            fit_ratio = worst["growth_mb"] / fit_ideal
        desc = worst["describe_param_mb"]
        lines.append(
            f"{p:>2} {str(tuple(worst['block'])):<32}{worst['peak_mb']:>9.0f}"
            f"{worst['peak_mb'] - worst['growth_mb']:>9.0f}{worst['growth_mb']:>9.0f}{worst['oracle_mb']:>10.0f}"
            f"{'-' if desc is None else f'{desc:.2f}':>12}"
            f"{'-' if ideal is None else f'{ideal:.0f}':>10}"
            f"{'-' if ratio is None else f'{ratio:.2f}':>7}"
            f"{'-' if fit_ratio is None else f'{fit_ratio:.2f}':>10}"
            f"{f'{vol[p][0]:.0f}' if p in vol else '-':>9}"
            f"{f'{vol[p][1]:.2f}' if p in vol else '-':>10}"
            f"  {all(r.get('ok') for r in rows) and len(rows) == p}")
    lines += [
        "target (per-rank peak ~ single/p + replicated parameters) is the",
        "'fit ratio': growth(p) / (growth(1)/p + params), the memory training adds above the",
        "resident set before fit (activations, gradients, temporaries); the aim is ~1.0-1.2.",
        "'runtime' is that resident set before fit (TensorFlow, Horovod, the model, the",
        "graph): every process carries it and no partitioning removes it, so 'ratio' (the",
        "whole resident peak over peak(1)/p + params) cannot reach 1.",
        "Horovod's tensor-fusion buffer (128 MiB by default; --fusion_mb) is allocated",
        "during fit by p > 1 only and so counts in its growth"
        + (f" (here {fusion} MiB)." if fusion else ": compare --fusion_mb 1.")]
    tensors = _worst_per_p(rows_by_p, "tensor_peak_mb")
    if tensors and 1 in tensors:
        params = _worst_per_p(rows_by_p, "param_mb")
        lines += ["tensor memory (TensorFlow allocator's peak during fit, worst rank; "
                  "ideal = tensors(1)/p + params; under this allocator the resident-set "
                  "columns above do not scale):"]
        lines += [f"   p={p}: {t:.1f} MB, ideal {tensors[1] / p + params[p]:.1f} MB, "
                  f"ratio {t / (tensors[1] / p + params[p]):.2f}"
                  for p, t in sorted(tensors.items())]
    traced = _worst_per_p(rows_by_p, "step_requested_peak_mb")
    if traced and 1 in traced:
        lines += ["bytes a traced step's tensors requested, at their peak (profiler; no "
                  "allocator rounding or fragmentation; worst rank; ideal = step(1)/p):"]
        lines += [f"   p={p}: {t:.1f} MB, ideal {traced[1] / p:.1f} MB, "
                  f"ratio {t / (traced[1] / p):.2f}" for p, t in sorted(traced.items())]
    if vol:
        lines += [
            f"'vol +MB' is a rank's fit growth minus its growth training the same model on a "
            f"{baseline}^3 volume",
            "at the same p (what fit adds whatever the volume: the traced graph, Horovod's",
            "and Gloo's buffers), worst rank;",
            "'vol ratio' = vol(p) / (vol(1)/p + params): how the memory that grows with the",
            "volume scales with p."]
    return "\n".join(lines)


def _baseline(args):
    """Each p's rows training the same model on ``--baseline``-sized volumes."""
    small = argparse.Namespace(**dict(vars(args), size=args.baseline, limit_mb=0))
    small.data_dir = tempfile.mkdtemp(prefix="baseline_", dir=args.data_dir)
    write_data(small, small.data_dir)
    print(f"baseline: the same model on {args.baseline}^3 volumes (fit's growth that does "
          "not scale with the volume)", flush=True)
    out = {}
    for p in args.nps:
        proc, rows = run(small, p, tempfile.mkdtemp(prefix=f"base_p{p}_", dir=args.data_dir))
        out[p] = rows
        if proc.returncode and not rows:
            print(f"baseline p={p}: exit {proc.returncode}\n{proc.stderr[-2000:]}", flush=True)
        for r in sorted(rows, key=lambda r: r["rank"]):
            print(f"  baseline p={p} rank {r['rank']}: fit +{r['growth_mb']:.0f} MB, "
                  f"ok={r['ok']}", flush=True)
    return out


def main(argv=None):
    args = _args(argv)
    if args.worker:
        return worker(args)
    own = args.data_dir is None
    if own:
        args.data_dir = tempfile.mkdtemp(prefix="volume_memory_")
    try:
        n = write_data(args, args.data_dir)
        print(f"{args.model}: {n} volumes of {args.size}^3 x {args.channels} "
              f"({args.size ** 3 * args.channels * 4 / MB:.0f} MB each), global batch "
              f"{args.batch}, {args.steps} steps, s splits depth; limit "
              f"{args.limit_mb or 'none'} MB; Horovod fusion buffer "
              f"{args.fusion_mb or 'default (128)'} MiB", flush=True)
        results = {}
        for p in args.nps:
            out = tempfile.mkdtemp(prefix=f"vm_p{p}_", dir=args.data_dir)
            proc, rows = run(args, p, out)
            results[p] = rows
            if proc.returncode and not rows:
                print(f"p={p}: exit {proc.returncode}\n{proc.stderr[-2000:]}", flush=True)
            for r in sorted(rows, key=lambda r: r["rank"]):
                print(f"  p={p} rank {r['rank']}: peak {r['peak_mb']:.0f} MB, before fit "
                      f"{r['rss_before_fit_mb']:.0f} MB, VmData peak "
                      f"{r['vm_data_peak_mb']:.0f} MB, ok={r['ok']}"
                      + (f" ({r['error'][:80]})" if r["ok"] is False else "")
                      + (" (died during fit)" if r["ok"] is None else ""), flush=True)
        base = _baseline(args) if args.baseline else {}
        print(summary(results, args.fusion_mb, base, args.baseline))
        if args.json:
            with open(args.json, "w") as f:
                json.dump({str(p): rows for p, rows in results.items()}
                          | {f"baseline{p}": rows for p, rows in base.items()}, f, indent=1)
        return results
    finally:
        if own:
            shutil.rmtree(args.data_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
