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
  every rank decodes only its own rows (but reads every raw row);
* ``files``: the record-file form, the same rows as ``FILES`` TFRecord files
  of ``tf.train.Example``s, ``shard(files, reader=tf.data.TFRecordDataset,
  batch_size=64, map_fn=parse_and_decode)``: every rank reads only its share
  of the files and decodes only its rows.

Per contender: raw records read and rows decoded per rank per step (counted
in a separate pass, the raw records by a map on the source (rows) or on the
reader's output (files), the rows by a counting ``map_fn``, so the timed pass
has no Python in it), the ratios to the target ``global batch /
data-parallel size``, and the input time
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
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

RESULTS = pathlib.Path(__file__).parent / "results" / "input.json"
BATCH, STEPS, ROWS, FILES = 64, 8, 64 * 8, 8
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
    folder = tempfile.mkdtemp()
    files = []
    for i, part in enumerate(np.array_split(np.arange(ROWS), FILES)):
        files.append(os.path.join(folder, f"rows-{i}.tfrecord"))
        with tf.io.TFRecordWriter(files[-1]) as writer:
            for r in part:
                writer.write(tf.train.Example(features=tf.train.Features(feature={
                    "png": tf.train.Feature(bytes_list=tf.train.BytesList(value=[png[r]])),
                    "y": tf.train.Feature(int64_list=tf.train.Int64List(value=[r]))}))
                    .SerializeToString())
    read = tf.Variable(0, dtype=tf.int64)

    def parse(record):
        example = tf.io.parse_single_example(record, {
            "png": tf.io.FixedLenFeature([], tf.string), "y": tf.io.FixedLenFeature([], tf.int64)})
        return example["png"], tf.cast(example["y"], tf.int32)

    def counted(ds):
        return ds.map(lambda *e: (read.assign_add(1), e)[1] if len(e) > 1
                      else (read.assign_add(1), e[0])[1])

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

    def make(kind, fn, count=False):
        source = counted(rows) if count else rows
        if kind == "batched":
            return tfhybrid.data.shard(source.map(fn, num_parallel_calls=tf.data.AUTOTUNE,
                                                  deterministic=True)
                                       .batch(BATCH, drop_remainder=True))
        if kind == "files":
            reader = (lambda names: counted(tf.data.TFRecordDataset(names))) if count \
                else tf.data.TFRecordDataset
            return tfhybrid.data.shard(files, reader=reader, batch_size=BATCH,
                                       map_fn=lambda record: fn(*parse(record)))
        return tfhybrid.data.shard(source, batch_size=BATCH, map_fn=fn)

    import warnings
    warnings.simplefilter("ignore")        # the batched contender is the warned-about form
    kinds = ("batched", "scaling", "files")
    decoded, records = {}, {}
    for kind in kinds:
        counter = [0]
        pipeline = make(kind, counting(counter), count=True)
        read.assign(0)
        steps = sum(1 for _ in pipeline)
        decoded[kind] = counter[0] / steps
        records[kind] = int(read.numpy()) / steps
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
                    [decoded[k] for k in kinds], [records[k] for k in kinds]], np.float64)
    every = backend.allgather(tf.constant(med[None]), world, "bench.input").numpy() \
        if grid.size > 1 else med[None]
    if tfhybrid.is_root():
        out = {"ranks": grid.size, "data_parallel": grid.data_size, "global_batch": BATCH,
               "target_rows_per_rank": BATCH / grid.data_size}
        for j, kind in enumerate(kinds):
            out[kind] = {"ms_per_step": round(1e3 * float(every[:, 0, j].max()), 3),
                         "rows_decoded_per_rank_per_step": float(every[:, 1, j].max()),
                         "decoded_over_target": round(float(every[:, 1, j].max())
                                                      / (BATCH / grid.data_size), 3),
                         "raw_records_read_per_rank_per_step": float(every[:, 2, j].max()),
                         "read_over_target": round(float(every[:, 2, j].max())
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
    lines = ["| ranks | target rows/rank | form | raw records read/rank | read/target | "
             "rows decoded/rank | decoded/target | ms/step | time/batched |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        for kind in ("batched", "scaling", "files"):
            k = r[kind]
            lines.append(f"| {r['ranks']} | {r['target_rows_per_rank']:g} | {kind} | "
                         f"{k['raw_records_read_per_rank_per_step']:g} | "
                         f"{k['read_over_target']:.3f} | "
                         f"{k['rows_decoded_per_rank_per_step']:g} | "
                         f"{k['decoded_over_target']:.3f} | {k['ms_per_step']:.2f} | "
                         f"{k['ms_per_step'] / r['batched']['ms_per_step']:.2f} |")
    print(f"global batch {BATCH}, {SIDE}x{SIDE}x3 PNG rows ({FILES} TFRecord files for "
          f"'files'), {STEPS} steps, median of "
          f"{ROUNDS} interleaved rounds, slowest rank")
    print("\n".join(lines))
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({"rows": results, "rounds": ROUNDS,
                                   "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())},
                                  indent=2) + "\n")


if __name__ == "__main__":
    worker() if "--worker" in sys.argv else driver()
