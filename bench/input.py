"""Input scaling of ``tfhybrid.data.shard``: rows decoded per rank and input time per step.

Run it plainly; it launches itself under ``horovodrun -np 1, 2, 4 --gloo``::

    .venv/bin/python bench/input.py            # BENCH_NP="1 2 4" BENCH_ROUNDS=5

An image pipeline with a real decode: ``ROWS`` 64x64x3 images stored as PNG
bytes (``tf.io.encode_png``), decoded with ``tf.io.decode_png`` and scaled to
float32, global batch ``BATCH`` (64), data parallel over every rank. Two
contenders, interleaved round by round on the same ranks:

* ``batched``: the batched form, ``shard(rows.map(decode).batch(64))``:
  every rank decodes the whole global batch and keeps its rows;
* ``scaling``: the scaling form, ``shard(rows, batch_size=64, map_fn=decode)``:
  every rank decodes only its own rows.

Per contender: rows decoded per rank per step (counted in a separate pass
with a counting ``map_fn``, so the timed pass has no Python in it), the
ratio to the target ``global batch / data-parallel size``, and the input time
per step (median over rounds of ``STEPS`` local batches pulled from a fresh
iterator, slowest rank). Results: a table on stdout and
``bench/results/input.json``.
"""
from __future__ import annotations

import json
import os
import pathlib
import statistics
import subprocess
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

RESULTS = pathlib.Path(__file__).parent / "results" / "input.json"
BATCH, STEPS, ROWS = 64, 8, 64 * 8
ROUNDS = int(os.environ.get("BENCH_ROUNDS", 5))
SIDE = 64


def worker():
    import numpy as np
    import tensorflow as tf

    import tfhybrid
    from tfhybrid.comm import backend

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tfhybrid.init()
    grid = tfhybrid.grid()
    images = np.random.default_rng(0).integers(0, 256, (ROWS, SIDE, SIDE, 3), dtype=np.uint8)
    png = [tf.io.encode_png(im).numpy() for im in images]
    labels = np.arange(ROWS, dtype=np.int32)
    rows = tf.data.Dataset.from_tensor_slices((png, labels))

    def decode(b, y):
        return tf.cast(tf.io.decode_png(b, channels=3), tf.float32) / 255.0, y

    def counting(counter):
        def bump(y):
            counter[0] += 1
            return y

        def fn(b, y):
            x, y = decode(b, y)
            return x, tf.py_function(bump, [y], tf.int32)
        return fn

    def make(kind, fn):
        if kind == "batched":
            return tfhybrid.data.shard(rows.map(fn, num_parallel_calls=tf.data.AUTOTUNE,
                                                deterministic=True)
                                       .batch(BATCH, drop_remainder=True))
        return tfhybrid.data.shard(rows, batch_size=BATCH, map_fn=fn)

    import warnings
    warnings.simplefilter("ignore")        # the batched contender is the warned-about form
    kinds = ("batched", "scaling")
    decoded = {}
    for kind in kinds:
        counter = [0]
        steps = sum(1 for _ in make(kind, counting(counter)))
        decoded[kind] = counter[0] / steps
    pipelines = {kind: make(kind, decode) for kind in kinds}
    times = {kind: [] for kind in kinds}
    world = tuple(range(grid.size))
    for kind in kinds:                       # warm-up
        for _ in pipelines[kind]:
            pass
    for _ in range(ROUNDS):
        for kind in kinds:
            backend.barrier(world)
            start = time.perf_counter()
            n = 0
            for x, _ in pipelines[kind]:
                n += 1
            x.numpy()
            times[kind].append((time.perf_counter() - start) / n)
    med = np.array([[statistics.median(times[k]) for k in kinds],
                    [decoded[k] for k in kinds]], np.float64)
    every = backend.allgather(tf.constant(med[None]), world, "bench.input").numpy() \
        if grid.size > 1 else med[None]
    if tfhybrid.is_root():
        out = {"ranks": grid.size, "data_parallel": grid.data_size, "global_batch": BATCH,
               "target_rows_per_rank": BATCH / grid.data_size}
        for j, kind in enumerate(kinds):
            out[kind] = {"ms_per_step": round(1e3 * float(every[:, 0, j].max()), 3),
                         "rows_decoded_per_rank_per_step": float(every[:, 1, j].max()),
                         "decoded_over_target": round(float(every[:, 1, j].max())
                                                      / (BATCH / grid.data_size), 3)}
        print("RESULT " + json.dumps(out), flush=True)


def driver():
    root = pathlib.Path(__file__).resolve().parent.parent
    venv = root / ".venv" / "bin"
    python = str(venv / "python") if (venv / "python").exists() else sys.executable
    horovodrun = str(venv / "horovodrun") if (venv / "horovodrun").exists() else "horovodrun"
    env = dict(os.environ, TF_NUM_INTRAOP_THREADS="1", OMP_NUM_THREADS="1",
               TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=str(root))
    results = []
    for p in [int(v) for v in os.environ.get("BENCH_NP", "1 2 4").split()]:
        cmd = [horovodrun, "-np", str(p), "--gloo", python, __file__, "--worker"]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900,
                              check=False)
        line = next((ln for ln in proc.stdout.splitlines() if "RESULT " in ln), None)
        if line is None:
            sys.exit(f"np {p} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        results.append(json.loads(line.split("RESULT ", 1)[1]))
    lines = ["| ranks | target rows/rank | batched: rows decoded/rank | batched ms/step | "
             "scaling: rows decoded/rank | decoded/target | scaling ms/step | "
             "scaling/batched time |", "|---|---|---|---|---|---|---|---|"]
    for r in results:
        b, s = r["batched"], r["scaling"]
        lines.append(f"| {r['ranks']} | {r['target_rows_per_rank']:g} | "
                     f"{b['rows_decoded_per_rank_per_step']:g} | {b['ms_per_step']:.2f} | "
                     f"{s['rows_decoded_per_rank_per_step']:g} | "
                     f"{s['decoded_over_target']:.3f} | {s['ms_per_step']:.2f} | "
                     f"{s['ms_per_step'] / b['ms_per_step']:.2f} |")
    print(f"global batch {BATCH}, {SIDE}x{SIDE}x3 PNG rows, {STEPS} steps, median of "
          f"{ROUNDS} interleaved rounds, slowest rank")
    print("\n".join(lines))
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({"rows": results, "rounds": ROUNDS,
                                   "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())},
                                  indent=2) + "\n")


if __name__ == "__main__":
    worker() if "--worker" in sys.argv else driver()
