"""Data-parallel throughput: tfhybrid vs what a Keras 3 user can use today.

Run: ``.venv/bin/horovodrun -np 2 --gloo .venv/bin/python bench/dp.py``

Same model, same global batch, contenders interleaved over several rounds
(medians and ratios from one run, so outside load on a shared machine hits
every contender alike):

- ``tfhybrid``: ``model.fit`` with ``tfhybrid.DistributedOptimizer`` (default
  25 MiB buckets: one bucket for this model) on pre-sharded local batches;
  also with 1 MiB buckets (3 buckets, the large one overlappable with the
  conv layers' back-propagation), with ``compile(steps_per_execution=10)``
  (Keras runs 10 steps per call of its compiled function, removing most of
  fit's per-step Python work) and in a GradientTape loop.

Every contender above reads the same ``tf.data`` pipeline of local batches
(the loops iterate it with ``for x, y in dataset``). Two contenders are
written the way users write them instead (the ``--pair`` comparison):

- ``horovod loop (numpy)``: the Horovod loop below fed numpy slices of this
  rank's arrays (``for i in range(steps): step(x[i*b:(i+1)*b], ...)``), the
  fastest loop a user writes;
- ``tfhybrid fit (README)``: ``transform(model, "d")`` and ``fit`` over the
  README's input path, ``tfhybrid.data.shard(rows, model=model,
  batch_size=global)`` of single rows (each rank keeps its block), with the
  transformed model's guards and watchdog and ``callbacks=tfhybrid.callbacks.
  standard()`` in every timed ``fit``. Each fit then has a fixed cost the
  loop has not, which short fits (``--steps``) weigh more: one allgather of
  every rank's state digest (rank 0's state is broadcast only where it
  differs) carrying the guards' structure/steps check, the guards' weight
  check after step 2 (one allgather inside the traced step) and the
  epoch-end metric average (one allreduce).

``--pair`` also times ``tfhybrid fit (README, tf.data autotune on)``: the same
fit over ``data.shard(..., autotune=True)``. With tf.data's autotuning on,
the end of a fit often waits for the autotuner's next period (10 ms
doubling), which is why ``shard`` turns autotuning off by default; the
``autotune_off_vs_on`` ratio shows what that saves.

``--single`` (run without horovodrun) compares plain Keras ``fit`` with
``transform(model, "d")`` + ``DistributedOptimizer`` ``fit`` at world size 1
on the same arrays, interleaved.
- ``horovod loop``: a ``tf.function`` GradientTape loop that all-reduces each
  gradient with ``hvd.allreduce`` (``hvd.DistributedGradientTape`` fails on
  Keras 3 variables).
- ``MWMS loop``: ``tf.distribute.MultiWorkerMirroredStrategy`` with a custom
  loop and ``strategy.run`` (its ``model.fit`` path fails on Keras 3.15).
  TF_CONFIG is built per rank from HOROVOD_RANK with localhost ports
  ``DP_BENCH_PORT`` (default 29811) + rank.

Also reported: bytes each rank writes to its sockets per step (``wchar`` of
/proc/self/io, i.e. real traffic incl. Horovod's control messages) against
the ring minimum 2(p-1)/p |W| (MWMS talks gRPC through sendmsg, which
wchar does not count, so its bytes are not reported), and Lee et al.'s overlap ratio (Eq. 11)
R = 100 (T_c - T_b) / T_c with T_c the time of the step's bucket allreduces
run alone and T_b the exposed communication time T_step - T_compute
(T_compute: the same fit with the plain optimizer, no communication).

Each contender is timed in wall time and in CPU time (``time.process_time``
of each process, all its threads, summed over the ranks): on a shared box
the wall time mostly measures the other load, the CPU time the work a step
costs. The README fit vs numpy loop (and, with ``--single``, plain Keras vs
``transform(d)``) ratios are printed for both, paired per round (median
and range) and from each contender's best round. ``--pair`` runs only that
pair (``horovodrun -np 2 ... bench/dp.py --pair``). ``--step-level`` times
the pair's traced steps alone, interleaved step by step (fit's train
function called directly vs the loop's step): it tells whether what the
README fit loses to the loop is in the step or in fit's per-step Python
(Keras' epoch loop and callback list) and per-fit work.

Writes bench/results/dp.json and prints a markdown table on rank 0.
"""
import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
RANK, SIZE = int(os.environ.get("HOROVOD_RANK", 0)), int(os.environ.get("HOROVOD_SIZE", 1))


def configure_threads():
    """One intra-op thread per rank (several ranks share 2 cores); before TF starts."""
    import tensorflow as tf
    tf.config.threading.set_intra_op_parallelism_threads(
        int(os.environ.get("TF_NUM_INTRAOP_THREADS", 1)))
    tf.config.threading.set_inter_op_parallelism_threads(
        int(os.environ.get("TF_NUM_INTEROP_THREADS", 2)))


def make_strategy():
    """MWMS must exist before TensorFlow initialises its runtime."""
    if SIZE < 2 or os.environ.get("DP_BENCH_SKIP_MWMS") or {
            "--pair", "--single", "--step-level"} & set(sys.argv):
        # --pair/--single do not run it: no idle gRPC server beside the timed pair
        return None, "skipped (one process, --pair/--single or DP_BENCH_SKIP_MWMS set)"
    base = int(os.environ.get("DP_BENCH_PORT", 29811))
    os.environ["TF_CONFIG"] = json.dumps({
        "cluster": {"worker": [f"localhost:{base + r}" for r in range(SIZE)]},
        "task": {"type": "worker", "index": RANK}})
    import tensorflow as tf
    try:
        return tf.distribute.MultiWorkerMirroredStrategy(), None
    except Exception as err:  # noqa: BLE001 - report why the baseline cannot run
        return None, f"{type(err).__name__}: {err}"


configure_threads()
STRATEGY, MWMS_ERROR = make_strategy()

import horovod.tensorflow as hvd  # noqa: E402  (bench only: the plain Horovod baseline)
import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tfhybrid  # noqa: E402
from tfhybrid.comm import backend  # noqa: E402

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def make_model():
    keras.utils.set_random_seed(0)
    return keras.Sequential([
        keras.Input((32, 32, 3)),
        keras.layers.Conv2D(16, 3, activation="relu"),
        keras.layers.Conv2D(32, 3, strides=2, activation="relu"),
        keras.layers.Flatten(),
        keras.layers.Dense(128, activation="relu"),
        keras.layers.Dense(10),
    ])


def wchar():
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("wchar"):
                return int(line.split()[1])
    return 0


def barrier():
    """A 1-element allreduce (backend.barrier calls hvd.barrier, which
    horovod.tensorflow 0.28.1 does not export)."""
    if SIZE > 1:
        backend.allreduce(tf.zeros([1]), tuple(range(SIZE)), "bench.barrier").numpy()


def timed(fn):
    """(wall seconds, CPU seconds of this process, bytes written) of ``fn()``."""
    barrier()
    w0, c0, t0 = wchar(), time.process_time(), time.perf_counter()
    fn()
    return time.perf_counter() - t0, time.process_time() - c0, wchar() - w0


def summed_over_ranks(samples):
    """``{name: [seconds per round]}`` summed over the ranks (one allreduce)."""
    names = list(samples)
    if SIZE == 1 or not names:
        return samples
    table = np.array([samples[k] for k in names], np.float64)
    total = backend.allreduce(tf.constant(table), tuple(range(SIZE)), "bench.cpu").numpy()
    return {k: list(total[i]) for i, k in enumerate(names)}


class Contenders:
    """Each contender runs ``steps`` training steps on the same local batches."""

    def __init__(self, steps, global_batch):
        self.steps, self.gb = steps, global_batch
        local = global_batch // SIZE
        r = np.random.default_rng(RANK)
        self.x = r.standard_normal((steps * local, 32, 32, 3)).astype(np.float32)
        self.y = r.integers(0, 10, steps * local).astype(np.int32)
        self.ds = tf.data.Dataset.from_tensor_slices((self.x, self.y)).batch(local).cache()
        self.first = next(iter(self.ds))
        self.models = {}
        g = np.random.default_rng(1234)     # the global rows, the same on every rank
        self.gx = g.standard_normal((steps * global_batch, 32, 32, 3)).astype(np.float32)
        self.gy = g.integers(0, 10, steps * global_batch).astype(np.int32)

    def loop(self, step):
        """Run ``step`` over the same tf.data pipeline ``fit`` reads."""
        step(*self.first)
        return lambda: [step(x, y) for x, y in self.ds]

    def fit_model(self, name, optimizer, steps_per_execution=1):
        model = make_model()
        model.compile(optimizer=optimizer, loss=LOSS, jit_compile=False,
                      steps_per_execution=steps_per_execution)
        model.fit(self.ds.take(1), verbose=0, callbacks=tfhybrid.callbacks.standard()
                  if isinstance(optimizer, tfhybrid.DistributedOptimizer) else None)
        self.models[name] = model
        return lambda: model.fit(self.ds, verbose=0)

    @staticmethod
    def horovod_step(prefix):
        """A user's Horovod step: GradientTape, hvd.allreduce per gradient, apply."""
        model, opt = make_model(), keras.optimizers.SGD(0.01)

        @tf.function(jit_compile=False)
        def step(x, y):
            with tf.GradientTape() as tape:
                loss = LOSS(y, model(x, training=True))
            grads = tape.gradient(loss, model.trainable_variables)
            grads = [hvd.allreduce(g, op=hvd.Average, name=f"{prefix}_{i}")
                     for i, g in enumerate(grads)]
            opt.apply(grads, model.trainable_variables)
        return step

    def horovod_loop(self):
        return self.loop(self.horovod_step("hvd_grad"))

    def horovod_numpy_loop(self):
        """The Horovod loop over numpy slices of this rank's arrays (no tf.data)."""
        step = self.horovod_step("hvd_np_grad")
        b = self.gb // SIZE
        step(self.x[:b], self.y[:b])
        return lambda: [step(self.x[i * b:(i + 1) * b], self.y[i * b:(i + 1) * b])
                        for i in range(self.steps)]

    def readme_fit(self, autotune=False):
        """transform(d) + fit over data.shard of single rows, as the README writes it
        (``autotune=True``: with tf.data's autotuning left on, shard's option)."""
        model = tfhybrid.transform(make_model(), "d")
        model.compile(optimizer=tfhybrid.DistributedOptimizer(keras.optimizers.SGD(0.01)),
                      loss=LOSS, jit_compile=False)
        rows = tf.data.Dataset.from_tensor_slices((self.gx, self.gy))
        data = tfhybrid.data.shard(rows, model=model, batch_size=self.gb,
                                   autotune=autotune).cache()
        model.fit(data.take(1), verbose=0, callbacks=tfhybrid.callbacks.standard())
        return lambda: model.fit(data, verbose=0, callbacks=tfhybrid.callbacks.standard())

    def mwms_loop(self):
        with STRATEGY.scope():
            model, opt = make_model(), keras.optimizers.SGD(0.01)

        def replica_step(x, y):
            with tf.GradientTape() as tape:
                per_example = keras.losses.sparse_categorical_crossentropy(
                    y, model(x, training=True), from_logits=True)
                loss = tf.nn.compute_average_loss(per_example, global_batch_size=self.gb)
            grads = tape.gradient(loss, model.trainable_variables)
            opt.apply(grads, model.trainable_variables)

        @tf.function(jit_compile=False)
        def step(x, y):
            STRATEGY.run(replica_step, args=(x, y))
        return self.loop(step)

    def tape_loop(self, optimizer):
        """tfhybrid's optimizer in the same hand-written loop as the baselines."""
        model = make_model()

        @tf.function(jit_compile=False)
        def step(x, y):
            with tf.GradientTape() as tape:
                loss = LOSS(y, model(x, training=True))
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply(grads, model.trainable_variables)
        return self.loop(step)

    def comm_only(self, name, optimizer):
        """The tfhybrid step's bucket allreduces alone (T_c)."""
        model = self.models[name]
        grads = [tf.ones_like(v) for v in model.trainable_variables]
        step = tf.function(lambda: optimizer.reduce_gradients(grads, model.trainable_variables))
        step()
        return lambda: [step() for _ in range(self.steps)]


# name -> (bucket_bytes, steps_per_execution); bucket None: default 25 MiB
VARIANTS = {"tfhybrid": (None, 1), "tfhybrid (1 MiB buckets)": (2**20, 1),
            "tfhybrid (steps_per_execution=10)": (None, 10)}


def build_pair(c):
    """Only the ``--pair`` contenders: the user's Horovod loop and the README fit."""
    return {"horovod loop (numpy)": c.horovod_numpy_loop(),
            "tfhybrid fit (README)": c.readme_fit(),
            AUTOTUNE_ON: c.readme_fit(autotune=True)}, {}


AUTOTUNE_ON = "tfhybrid fit (README, tf.data autotune on)"


def build(c):
    runs, opts = {}, {}
    for name, (bucket_bytes, spe) in VARIANTS.items():
        kwargs = {"bucket_bytes": bucket_bytes} if bucket_bytes else {}
        opts[name] = tfhybrid.DistributedOptimizer(keras.optimizers.SGD(0.01), **kwargs)
        runs[name] = c.fit_model(name, opts[name], steps_per_execution=spe)
    runs["tfhybrid (tape loop)"] = c.tape_loop(
        tfhybrid.DistributedOptimizer(keras.optimizers.SGD(0.01)))
    runs["horovod loop"] = c.horovod_loop()
    runs["horovod loop (numpy)"] = c.horovod_numpy_loop()
    runs["tfhybrid fit (README)"] = c.readme_fit()
    if STRATEGY is not None:
        try:
            runs["MWMS loop"] = c.mwms_loop()
        except Exception as err:  # noqa: BLE001
            globals()["MWMS_ERROR"] = f"{type(err).__name__}: {str(err)[:300]}"
    runs["compute only"] = c.fit_model("compute", keras.optimizers.SGD(0.01))
    for name in ("tfhybrid", "tfhybrid (1 MiB buckets)"):
        runs[f"comm only: {name}"] = c.comm_only(name, opts[name])
    return runs, opts


def median_of(samples, key):
    return statistics.median(samples[key])


def overlap(samples, name, steps):
    """Lee Eq. 11: R = 100 (T_c - T_b) / T_c, T_b = T_fit - T_compute.

    Two estimators: from the medians of the paired (same-round) differences,
    and from the best (minimum) time of each contender over the rounds, the
    one least disturbed by other load on a shared machine.
    """
    comm, compute, fit = (samples[f"comm only: {name}"], samples["compute only"], samples[name])
    t_c = statistics.median(comm) / steps
    t_b = statistics.median(f - p for f, p in zip(fit, compute)) / steps
    best_c, best_b = min(comm) / steps, (min(fit) - min(compute)) / steps
    return {"T_c": t_c, "T_b": t_b, "R_percent": 100 * (t_c - t_b) / t_c,
            "T_c_best": best_c, "T_b_best": best_b,
            "R_percent_best": 100 * (best_c - best_b) / best_c}


def summarise(samples, bytes_sent, cpu, c, opts, args):
    if "tfhybrid" not in c.models:       # --pair: the two contenders only
        return {"world_size": SIZE, "global_batch": c.gb, "steps_per_round": c.steps,
                "rounds": args.rounds, **_pair_summary(samples, cpu, c.steps)}
    params = sum(int(np.prod(v.shape)) for v in c.models["tfhybrid"].trainable_variables)
    ring_min = 2 * (SIZE - 1) / SIZE * params * 4
    t = {k: median_of(samples, k) / c.steps for k in samples}
    thr = {k: c.gb / v for k, v in t.items() if "only" not in k}
    return {
        **_pair_summary(samples, cpu, c.steps),
        "world_size": SIZE, "global_batch": c.gb, "steps_per_round": c.steps,
        "rounds": args.rounds, "parameters": params,
        "step_time_s": t, "samples_per_s": thr,
        "best_step_time_s": {k: min(v) / c.steps for k, v in samples.items()},
        "step_time_s_per_round": {k: [x / c.steps for x in v] for k, v in samples.items()},
        "ratio_vs_tfhybrid": {k: thr["tfhybrid"] / v for k, v in thr.items()},
        "bytes_per_step": {
            "ring_minimum": ring_min,
            "tfhybrid_counted": {k: o.communication_plan()["ring_bytes"] for k, o in opts.items()},
            "measured_socket_writes": {k: median_of(bytes_sent, k) / c.steps for k in bytes_sent},
        },
        "buckets": {k: [b["bytes"] for b in o.communication_plan()["buckets"]]
                    for k, o in opts.items()},
        "overlap": {k: overlap(samples, k, c.steps) for k in opts if f"comm only: {k}" in samples},
        "mwms_error": MWMS_ERROR,
    }


def _pair_summary(samples, cpu, steps):
    """The ``--pair`` comparison in wall time and in CPU time (summed over ranks)."""
    slow, fast = "horovod loop (numpy)", "tfhybrid fit (README)"
    extra = ({"autotune_off_vs_on": _paired_ratio(samples, AUTOTUNE_ON, fast)}
             if AUTOTUNE_ON in samples else {})
    return {**extra, "readme_fit_vs_numpy_loop": _paired_ratio(samples, slow, fast),
            "readme_fit_vs_numpy_loop_cpu": _paired_ratio(cpu, slow, fast),
            "cpu_ms_per_step_summed_over_ranks": {
                k: {"min": min(v) / steps * 1e3, "median": statistics.median(v) / steps * 1e3}
                for k, v in cpu.items()},
            "wall_ms_per_step": {
                k: {"min": min(v) / steps * 1e3, "median": statistics.median(v) / steps * 1e3}
                for k, v in samples.items()}}


def _ratio_line(title, wall, cpu, wall_best, cpu_best, target):
    """One line: the paired wall and CPU ratios and the ratio of the best rounds."""
    return (f"{title}, paired per round: wall {wall['median']:.3f}x median (range "
            f"{wall['min']:.3f}-{wall['max']:.3f}), CPU {cpu['median']:.3f}x median (range "
            f"{cpu['min']:.3f}-{cpu['max']:.3f}); best rounds: wall {wall_best:.3f}x, CPU "
            f"{cpu_best:.3f}x ({wall['rounds']} rounds; > 1: tfhybrid is faster; target "
            f">= {target})")


def _pair_lines(res, slow, fast, title, target):
    w, c = res["wall_ms_per_step"], res["cpu_ms_per_step_summed_over_ranks"]
    rows = [f"{k}: wall {w[k]['median']:.2f} ms/step median, {w[k]['min']:.2f} best; CPU "
            f"(process_time, summed over {res['world_size']} rank(s)) {c[k]['median']:.2f} "
            f"ms/step median, {c[k]['min']:.2f} best" for k in (slow, fast)]
    rows.append(_ratio_line(title, res["ratio_wall"], res["ratio_cpu"],
                            w[slow]["min"] / w[fast]["min"], c[slow]["min"] / c[fast]["min"],
                            target))
    return rows


def _paired_ratio(samples, slow_name, fast_name):
    """Median over rounds of time(slow_name) / time(fast_name), and its range:
    > 1 means ``fast_name`` is faster (paired within a round: same load)."""
    ratios = sorted(a / b for a, b in zip(samples[slow_name], samples[fast_name]))
    return {"median": statistics.median(ratios), "min": ratios[0], "max": ratios[-1],
            "rounds": len(ratios)}


def pair_table(res):
    res = dict(res, ratio_wall=res["readme_fit_vs_numpy_loop"],
               ratio_cpu=res["readme_fit_vs_numpy_loop_cpu"])
    lines = _pair_lines(res, "horovod loop (numpy)", "tfhybrid fit (README)",
                        "tfhybrid fit (README) speed vs horovod loop (numpy)", 1.0)
    if "autotune_off_vs_on" in res:
        r, w = res["autotune_off_vs_on"], res["wall_ms_per_step"][AUTOTUNE_ON]
        lines.append(f"{AUTOTUNE_ON}: wall {w['median']:.2f} ms/step median, {w['min']:.2f} "
                     f"best; data.shard's default (autotune off) speed vs it, paired: "
                     f"{r['median']:.3f}x median (range {r['min']:.3f}-{r['max']:.3f})")
    return "\n".join(lines)


def table(res):
    if "step_time_s" not in res:
        return pair_table(res)
    rows = ["| contender | step ms (median) | step ms (best) | samples/s (median) | tfhybrid "
            "speed-up | bytes sent/step (measured) |", "|---|---:|---:|---:|---:|---:|"]
    b = res["bytes_per_step"]
    meas = b["measured_socket_writes"]
    for k, v in res["step_time_s"].items():
        thr, ratio = res["samples_per_s"].get(k), res["ratio_vs_tfhybrid"].get(k)
        sent = "n/a (gRPC)" if k == "MWMS loop" else f"{meas[k]:,.0f}"
        best = res["best_step_time_s"][k] * 1e3
        rows.append(f"| {k} | {v * 1e3:.1f} | {best:.1f} | {thr:.0f} | {ratio:.2f}x | {sent} |"
                    if thr else f"| {k} | {v * 1e3:.1f} | {best:.1f} | - | - | {sent} |")
    rows += ["", f"ring minimum 2(p-1)/p|W| = {b['ring_minimum']:,.0f} B/step"]
    for k, o in res["overlap"].items():
        counted = b["tfhybrid_counted"][k]
        rows.append(f"{k}: buckets {res['buckets'][k]} B; counted {counted:,.0f} B "
                    f"({counted / b['ring_minimum']:.4f}x min), measured {meas[k]:,.0f} B "
                    f"({meas[k] / b['ring_minimum']:.4f}x); overlap (Lee Eq. 11) T_c = "
                    f"{o['T_c'] * 1e3:.1f} ms, T_b = {o['T_b'] * 1e3:.1f} ms, "
                    f"R = {o['R_percent']:.0f}% (best-of-rounds: T_c = {o['T_c_best'] * 1e3:.1f} ms, "
                    f"T_b = {o['T_b_best'] * 1e3:.1f} ms, R = {o['R_percent_best']:.0f}%)")
    if res["mwms_error"]:
        rows.append(f"MWMS baseline not run: {res['mwms_error']}")
    rows.append(pair_table(res))
    return "\n".join(rows)


def single(args):
    """World size 1: plain Keras fit vs transform(d) + DistributedOptimizer fit."""
    x = np.random.default_rng(0).standard_normal((args.steps * args.batch, 32, 32, 3))
    x = x.astype(np.float32)
    y = np.random.default_rng(1).integers(0, 10, len(x)).astype(np.int32)
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(args.batch).cache()
    plain = make_model()
    plain.compile(optimizer=keras.optimizers.SGD(0.01), loss=LOSS, jit_compile=False)
    ours = tfhybrid.transform(make_model(), "d")
    ours.compile(optimizer=tfhybrid.DistributedOptimizer(keras.optimizers.SGD(0.01)),
                 loss=LOSS, jit_compile=False)
    runs = {"keras fit": lambda: plain.fit(ds, verbose=0),
            "tfhybrid d fit": lambda: ours.fit(tfhybrid.data.shard(ds, model=ours), verbose=0)}
    for fn in runs.values():
        fn()
    samples, cpu = {k: [] for k in runs}, {k: [] for k in runs}
    for _ in range(args.rounds):
        for name, fn in runs.items():
            dt, dc, _ = timed(fn)
            samples[name].append(dt)
            cpu[name].append(dc)
    steps = args.steps
    res = {"world_size": 1, "ratio_wall": _paired_ratio(samples, "keras fit", "tfhybrid d fit"),
           "ratio_cpu": _paired_ratio(cpu, "keras fit", "tfhybrid d fit"),
           "cpu_ms_per_step_summed_over_ranks": {
               k: {"min": min(v) / steps * 1e3, "median": statistics.median(v) / steps * 1e3}
               for k, v in cpu.items()},
           "wall_ms_per_step": {
               k: {"min": min(v) / steps * 1e3, "median": statistics.median(v) / steps * 1e3}
               for k, v in samples.items()}}
    print("\n".join(_pair_lines(res, "keras fit", "tfhybrid d fit",
                                "world size 1: tfhybrid d fit speed vs plain Keras fit", 0.98)))


def step_level(args):
    """The pair's steps alone, interleaved step by step: ``fit``'s train function
    (the README model, one call per batch, no Keras loop or callbacks around it)
    vs the numpy Horovod loop's step. Tells the traced step from fit's per-step
    Python (Keras' epoch loop, callbacks) and per-fit work."""
    c = Contenders(args.steps, args.batch)
    step, b = c.horovod_step("hvd_step_grad"), args.batch // SIZE
    step(c.x[:b], c.y[:b])
    model = tfhybrid.transform(make_model(), "d")
    model.compile(optimizer=tfhybrid.DistributedOptimizer(keras.optimizers.SGD(0.01)),
                  loss=LOSS, jit_compile=False)
    rows = tf.data.Dataset.from_tensor_slices((c.gx, c.gy))
    data = tfhybrid.data.shard(rows, model=model, batch_size=c.gb).cache().repeat()
    model.fit(data.take(1), verbose=0, callbacks=tfhybrid.callbacks.standard())
    iterator = iter(data)
    times = {"horovod loop step (numpy)": [], "tfhybrid train function": []}
    barrier()
    for i in range(args.steps * args.rounds):
        j = i % args.steps
        t0 = time.perf_counter()
        step(c.x[j * b:(j + 1) * b], c.y[j * b:(j + 1) * b])
        t1 = time.perf_counter()
        model.train_function(iterator)
        times["horovod loop step (numpy)"].append(t1 - t0)
        times["tfhybrid train function"].append(time.perf_counter() - t1)
    if RANK == 0:
        for k, v in times.items():
            print(f"{k}: {statistics.median(v) * 1e3:.2f} ms median, "
                  f"{np.percentile(v, 10) * 1e3:.2f} ms 10th percentile")
        ratios = [a / b for a, b in zip(*times.values())]
        print(f"step level, tfhybrid train function speed vs horovod loop step: "
              f"{statistics.median(ratios):.3f}x median of {len(ratios)} paired steps "
              "(> 1: tfhybrid is faster)")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--batch", type=int, default=64, help="global batch")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "dp.json"))
    ap.add_argument("--single", action="store_true",
                    help="world size 1: plain Keras fit vs transform(d) fit")
    ap.add_argument("--pair", action="store_true",
                    help="only the pair: horovod loop (numpy) vs tfhybrid fit (README)")
    ap.add_argument("--step-level", action="store_true",
                    help="the pair's steps alone, interleaved step by step (no fit loop)")
    args = ap.parse_args()
    tfhybrid.init()
    if args.single:
        return single(args)
    if args.step_level:
        return step_level(args)
    c = Contenders(args.steps, args.batch)
    runs, opts = build_pair(c) if args.pair else build(c)
    samples = {k: [] for k in runs}
    bytes_sent = {k: [] for k in runs}
    cpu = {k: [] for k in runs}
    for _ in range(args.rounds):
        for name, fn in runs.items():
            dt, dc, nbytes = timed(fn)
            samples[name].append(dt)
            cpu[name].append(dc)
            bytes_sent[name].append(nbytes)
    res = summarise(samples, bytes_sent, summed_over_ranks(cpu), c, opts, args)
    if RANK == 0:
        print(table(res))
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(res, indent=2))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    sys.exit(main())
