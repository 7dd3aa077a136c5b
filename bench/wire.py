"""Performance on a real wire: 2 test hosts x 1 rank joined by a link of set rate.

Run as root on one machine (the ranks need the Horovod with tfhybrid's Gloo
interface patch, see tests/multihost/conftest.py)::

    .venv/bin/python bench/wire.py [--quick] [--rates 100mbit 1gbit unlimited]

The driver makes two test hosts (tests/multihost/hosts.py: network
namespaces on a bridge, sshd in each), and launches ``horovodrun --gloo -H
h1:1,h2:1 --network-interface eth0`` from h1:

1. ``tfhybrid calibrate --model <oracle model>`` at the first rate (the link's
   latency and bandwidth into a machine file), then ``tfhybrid plan`` on it;
   ``tfhybrid calibrate`` (collectives only) at every other rate;
2. the measuring jobs (``--worker``), one per model below and one per
   strategy of the oracle, as a user runs one model and one strategy per job
   (a process that has traced many functions dispatches every op more
   slowly): each rank pins itself to one core (rank r on core r) and shapes
   its own host's egress to the rate (``tc``, :func:`tc_commands`: each
   direction of the link is shaped once; small packets, ACKs and Horovod's
   negotiation, leave before queued data, as with Linux's default fq_codel;
   ``--queue fifo``: one queue); a model's contenders take turns in
   every round and at every rate (rounds x rates x contenders), so outside
   load on this shared machine hits all alike (faster links, shorter steps:
   more steps per round, :func:`steps_at`). The oracle's strategies, each in
   its own job, run one after the other: outside load that comes and goes
   can reach one of them and not the next.
   Every job runs with tfhybrid's defaults, among them ``comm_priority``
   (every thread but Horovod's and Gloo's 10 nice levels below them;
   ``TFHYBRID_COMM_PRIORITY=0`` in the driver's environment measures without it).

Per model (a small CNN with a large dense head; a VGG-like conv stack at
32x32 input) and rate, in a GradientTape step traced with ``tf.function``:

- ``after``: ``DistributedOptimizer`` with one bucket (the default 25 MiB
  holds every gradient): the reduction starts when back-propagation ends;
- ``bucket <size>``: buckets of that size, reduced during back-propagation;
- ``compute``: the plain optimizer (no communication);
- ``comm``: the one-bucket reduction alone (T_comm), ``comm fp16`` likewise
  with ``compression="fp16"``; ``fp16``: the default step with fp16.

Each contender's ``CPU busy / wall`` is the share of its steps' wall time the rank's
process ran on its one core: what communication alone takes of the core that
back-propagation needs (copies into Horovod's fusion buffer, Gloo's sends and receives).

Overlap: hidden = (compute + comm - step) / min(compute, comm) (1: the
shorter of the two is wholly hidden, 0: none). Fusion: the sweep above picks
the fastest fixed size; then the ``default`` (``bucket_bytes="auto"`` on each
rate's calibrated link, traced only now: a function traced before the sweep
would slow its steps) and that size run in turn in fresh rounds; the ratio of
their median steps there is the headline (:func:`summarise_rate` says why not
the sweep's own, nor each round's best). Bytes: the
interface's ``tx_bytes`` (TCP/IP headers included) per step, against the ring
minimum 2(p-1)/p |W|. Compression: fp16's bytes and step against fp32. Oracle:
every strategy of bench/oracle_accuracy.py built by ``tfhybrid.transform`` and timed the same
way at the calibrated rate (:data:`ORACLE_ROUNDS` x ``--rounds`` rounds, after as many
rounds of warm-up), against the prediction on the calibrated machine
file; bytes per step against :func:`tfhybrid.describe`'s ``sent_bytes`` (what its analysis
says one rank sends: ring allreduce, allgather blocks, halo rows to real neighbours), as
sent and less Horovod's coordination (the bytes per second a rank sends while idle, times
the step: :func:`payload_bytes`); the strategy ``plan`` ranks first against the measured
fastest.

Writes bench/results/wire.json and wire.md (the tables); ``--repredict``
reports the last run's measurements again. The last line printed is
``WIRE overlap_hidden=.. fusion_default_vs_best=.. bytes_vs_ring=..
fp16_speedup=.. oracle_mean=.. oracle_worst=.. pick=ok|miss``.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS = HERE / "results"
IFACE = "eth0"
# Jumbo frames, as HPC clusters' Ethernet usually runs: TCP/IP headers then cost
# 0.4% of a large message (4.6% at MTU 1500, plus the receiver's ACKs), and tbf
# (whose burst is smaller than a 64 KB segmentation-offload packet) sends frames
# of this size
MTU = 9000
DEFAULT_BUCKET = 25 * 2**20
BUCKETS = (128 * 2**10, 256 * 2**10, 2**20)   # the sweep, besides "after" (one bucket)
RATES = ("100mbit", "250mbit", "1gbit", "unlimited")   # 250mbit: comm ~ compute here
STRATEGIES_FULL = ("d", "f", "c", "s", "df", "ds", "gmp", "p", "ls")
STRATEGIES_QUICK = ("d", "f", "df", "gmp", "s")
ORACLE_ROUNDS = 3   # an oracle strategy's rounds (and warm-up rounds) per --rounds


# -- pure helpers (tests/unit/test_bench_wire.py) ------------------------------------------

def rate_bits(rate):
    """Bits per second of a tc rate ("100mbit", "1gbit", "500kbit"); None for "unlimited"."""
    text = str(rate).strip().lower()
    if text in ("unlimited", "none", "0"):
        return None
    units = {"gbit": 10**9, "mbit": 10**6, "kbit": 10**3, "bit": 1}
    for unit, scale in units.items():
        if text.endswith(unit):
            number = text[: -len(unit)]
            try:
                value = float(number)
            except ValueError:
                break
            if value > 0:
                return int(value * scale)
            break
    raise ValueError(f"link rate {rate!r}: expected a tc rate such as 100mbit or 1gbit, "
                     "or 'unlimited'")


QUEUES = ("small-first", "fifo")
# packets up to this size (IP total length) leave before queued data with
# --queue small-first: TCP's pure ACKs (52 bytes) and Horovod's negotiation
SMALL_PACKET = 256


def tc_commands(rate, queue="small-first", dev=IFACE, tc="tc"):
    """argv lists shaping ``dev``'s egress to ``rate`` (or removing the shaping).

    The burst is 1 ms at the rate, and at least two jumbo frames (:data:`MTU`):
    the link then serialises every message at the rate, as a wire of that
    speed does. A 10 ms burst (1 Mbit at 100 Mbit/s) let messages up to
    ~100 KB through at memory speed, so small collectives looked free; with
    1 ms, large messages still move at the rate (within 2%), and at 1 Gbit/s
    the shaper itself costs ~10%, which calibration measures as that link's
    bandwidth. Data waits in a queue of 50 ms at the rate.

    ``queue``:

    - ``"small-first"`` (default): an htb class of rate ``rate`` with two
      children, packets of at most :data:`SMALL_PACKET` bytes (a ``u32`` match
      on the IP length) served before the data. What a host's egress does with
      Linux's default qdisc, fq_codel, which sends a sparse flow's packets
      before a bulk flow's backlog (this kernel has neither fq_codel nor sfq):
      the ACKs of an incoming transfer and the small messages Horovod
      negotiates each collective with do not wait behind the host's outgoing
      data. With one FIFO (``"fifo"``) a 64-byte ping-pong between the test
      hosts took up to 15 ms while 4 MB went each way at 100 Mbit/s (at most
      0.6 ms with ``"small-first"``), and every collective that overlaps
      another transfer pays that wait.
    - ``"fifo"``: one tbf queue for everything.
    """
    if queue not in QUEUES:
        raise ValueError(f"queue {queue!r}: expected one of {QUEUES}")
    bits = rate_bits(rate)
    clear = [tc, "qdisc", "del", "dev", dev, "root"]
    if bits is None:
        return [clear]
    frame = MTU + 18
    burst = max(2 * frame * 8, bits // 1000)          # bits
    if queue == "fifo":
        return [[tc, "qdisc", "replace", "dev", dev, "root", "tbf", "rate", str(rate),
                 "burst", f"{burst // 1000}kbit", "latency", "50ms"]]
    nbytes = f"{burst // 8}b"
    small = max(bits // 10, 1000)
    cls = [tc, "class", "add", "dev", dev]
    return [clear,
            [tc, "qdisc", "add", "dev", dev, "root", "handle", "1:", "htb", "default", "20"],
            [*cls, "parent", "1:", "classid", "1:1", "htb", "rate", f"{bits}bit",
             "burst", nbytes, "cburst", nbytes],
            [*cls, "parent", "1:1", "classid", "1:10", "htb", "rate", f"{small}bit",
             "ceil", f"{bits}bit", "burst", nbytes, "cburst", nbytes, "prio", "0",
             "quantum", str(frame)],
            [*cls, "parent", "1:1", "classid", "1:20", "htb", "rate", f"{bits - small}bit",
             "ceil", f"{bits}bit", "burst", nbytes, "cburst", nbytes, "prio", "1",
             "quantum", str(frame)],
            [tc, "qdisc", "add", "dev", dev, "parent", "1:20", "bfifo", "limit",
             str(max(4 * frame, bits // 8 // 20))],           # 50 ms of data
            [tc, "filter", "add", "dev", dev, "parent", "1:", "protocol", "ip", "prio", "1",
             "u32", "match", "u16", "0x0000", f"{0x10000 - SMALL_PACKET:#06x}", "at", "2",
             "flowid", "1:10"]]


def _run_tc(commands, prefix=(), where=""):
    """Run :func:`tc_commands`' argv lists (removing a qdisc that is not there is no
    error); raise with tc's message otherwise."""
    for argv in commands:
        out = subprocess.run([*prefix, *argv], capture_output=True, text=True)
        if out.returncode != 0 and argv[1:3] != ["qdisc", "del"]:
            raise RuntimeError(f"tc on {where or os.uname().nodename}: "
                               f"{' '.join(argv)}: {out.stderr.strip()}")


def parse_proc_net_dev(text, dev=IFACE):
    """(rx_bytes, tx_bytes) of ``dev`` from /proc/net/dev text."""
    for line in text.splitlines():
        if ":" not in line:
            continue
        name, rest = line.split(":", 1)
        if name.strip() == dev:
            fields = rest.split()
            return int(fields[0]), int(fields[8])
    raise ValueError(f"interface {dev!r} not in /proc/net/dev")


def tx_bytes(dev=IFACE, sys_root="/sys/class/net", proc="/proc/net/dev"):
    """Bytes ``dev`` has sent: /sys/class/net/<dev>/statistics/tx_bytes, else /proc/net/dev."""
    path = Path(sys_root) / dev / "statistics" / "tx_bytes"
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return parse_proc_net_dev(Path(proc).read_text(), dev)[1]


def ring_minimum(param_bytes, p):
    """Bytes each rank sends in a ring allreduce of ``param_bytes``: 2(p-1)/p |W|."""
    return 2 * (p - 1) / p * param_bytes


def payload_bytes(tx, control_rate, seconds):
    """Bytes a step sent beyond Horovod's coordination: ``tx`` less ``control_rate`` (bytes
    per second the interface sends while the ranks only cycle, see :func:`_control_rate`)
    over the step's ``seconds``. Horovod's background thread agrees on the ready tensors
    with its peers every cycle (``HOROVOD_CYCLE_TIME``), whatever the step does: a few
    hundred bytes per cycle, at a 1 ms cycle about as much per step as a halo. While a
    collective runs the thread cycles less often, so this subtracts at most what the
    coordination sent."""
    return max(tx - control_rate * seconds, 0.0)


def hidden_fraction(compute, comm, step):
    """Lee et al.'s overlap as the share of the shorter part hidden:
    (compute + comm - step) / min(compute, comm); nan if either is not positive."""
    if not (compute > 0 and comm > 0):
        return float("nan")
    return (compute + comm - step) / min(compute, comm)


def accuracy(predicted, measured):
    """1 - |predicted - measured| / measured (bench/oracle_accuracy.py's measure)."""
    return 1.0 - abs(predicted - measured) / measured


def typical(samples, per_round):
    """The median over rounds of each round's best step (per-step samples, in order)."""
    best = [min(samples[i:i + per_round]) for i in range(0, len(samples), per_round)]
    return statistics.median(best)


def pick_ok(predicted, measured, tolerance=0.10):
    """Whether the strategy predicted fastest is within ``tolerance`` of the measured
    fastest (over the strategies both hold)."""
    common = [s for s in predicted if s in measured]
    if not common:
        return False
    first = min(common, key=lambda s: predicted[s])
    return measured[first] <= (1 + tolerance) * min(measured[s] for s in common)


def plan_order(plan_json):
    """Feasible strategies of ``tfhybrid plan --json`` output, ranked first to last,
    with their predicted seconds: [(name, total_s)]."""
    out = []
    for row in plan_json.get("predictions", []):
        total = row.get("total_s")
        if row.get("feasible", True) and total is not None and math.isfinite(total):
            out.append((row["strategy"], float(total)))
    return out


def wire_line(overlap_hidden, fusion_default_vs_best, bytes_vs_ring, fp16_speedup,
              oracle_mean, oracle_worst, pick):
    """The bench's last line."""
    def num(x):
        return "nan" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.3f}"
    pick_text = pick if isinstance(pick, str) else ("ok" if pick else "miss")
    return (f"WIRE overlap_hidden={num(overlap_hidden)} "
            f"fusion_default_vs_best={num(fusion_default_vs_best)} "
            f"bytes_vs_ring={num(bytes_vs_ring)} fp16_speedup={num(fp16_speedup)} "
            f"oracle_mean={num(oracle_mean)} oracle_worst={num(oracle_worst)} pick={pick_text}")


def steps_at(rate, steps):
    """Steps per contender per round at ``rate``: ``steps`` at 100 Mbit/s and below,
    ceil(sqrt(rate / 100 Mbit/s)) times as many on faster links (6 times unlimited).
    A step there takes a few milliseconds, where one scheduler hiccup is a tenth of
    it; more steps per round cost little and make each round's best steadier.

    Example:
        >>> [steps_at(r, 5) for r in ("100mbit", "250mbit", "1gbit", "unlimited")]
        [5, 10, 20, 30]
    """
    bits = rate_bits(rate)
    scale = 6 if bits is None else min(6, max(1, math.ceil(math.sqrt(bits / 100e6) - 1e-9)))
    return steps * scale


def merge_parts(measured, part):
    """One measuring job's result (``--worker``'s JSON) added to those of the jobs
    before it: its ``models`` and ``oracle`` strategies next to theirs, every other
    key as it says.

    Example:
        >>> merge_parts({"rates": ["100mbit"], "models": {"vgg": 1}, "oracle": {"s": 1}},
        ...             {"rates": ["100mbit"], "models": {"cnn_head": 3}, "oracle": {"d": 2}})
        {'rates': ['100mbit'], 'models': {'vgg': 1, 'cnn_head': 3}, 'oracle': {'s': 1, 'd': 2}}
    """
    out = dict(measured)
    out.update({k: v for k, v in part.items() if k not in ("models", "oracle")})
    out["models"] = {**(measured.get("models") or {}), **(part.get("models") or {})}
    if "oracle" in measured or "oracle" in part:
        out["oracle"] = {**(measured.get("oracle") or {}), **(part.get("oracle") or {})}
    return out


def bucket_label(nbytes):
    if nbytes >= 2**20:
        return f"bucket {nbytes / 2**20:g}MiB"
    return f"bucket {nbytes / 2**10:g}KiB"


def sweep_names(buckets=BUCKETS):
    """The fixed bucket sizes of the sweep: "after" (one bucket) and each size."""
    return ("after", *(bucket_label(n) for n in buckets))


def fusion_rival(t, buckets=BUCKETS):
    """The fastest fixed bucket size of the sweep ("after" or a ``bucket ..``
    contender) in ``t`` {contender: step s}: what the default is confirmed against.

    Example:
        >>> fusion_rival({"after": 0.3, "bucket 128KiB": 0.2, "bucket 256KiB": 0.25,
        ...               "bucket 1MiB": 0.4, "default": 0.1})
        'bucket 128KiB'
    """
    return min(sweep_names(buckets), key=lambda k: t[k])


def summarise_rate(t, b, param_bytes, p, buckets=BUCKETS, confirm=None, confirm_median=None):
    """Per (model, rate): ``t`` {contender: step s}, ``b`` {contender: tx bytes/step};
    ``confirm``: {"default": s, <rival>: s} of the confirmation rounds (the default
    against the sweep's fastest fixed size, :func:`fusion_rival`, timed again), as
    :func:`typical` reads them; ``confirm_median``: the same pair's median step over
    every step of those rounds.

    The bucketed contender with the best step is the overlap case. The fusion ratio
    is the confirmation's default / rival when there is one: the fastest of five
    contenders whose steps spread by 5-10% from round to round is, on the very
    rounds that chose it, faster than its own typical step (the winner's curse),
    so the sweep's own ratio (``fusion_sweep_default_vs_best``; None when the
    default was timed in the confirmation rounds only) is biased upwards. With
    ``confirm_median`` the ratio is of the median steps: on a fast link a step's
    time spreads widely (at unlimited rate, cnn_head: 5.7-8.9 ms for one
    contender's best of 30 steps in five rounds, and 11-12 ms its median), and
    the best of a round is then an extreme of that spread, where the median is
    the step training takes."""
    swept = "default" in t
    if confirm and not swept:       # the default's step: the confirmation's
        t = dict(t, default=confirm["default"])
    # the default: bucket_bytes="auto" on this rate's calibrated link ("default"), or
    # the fixed 25 MiB ("after") when the run had no calibration per rate
    default = t.get("default", t["after"])
    sweep = {"default": default, "after": t["after"],
             **{bucket_label(n): t[bucket_label(n)] for n in buckets}}
    best_name = min(sweep, key=sweep.get)
    bucketed = min((bucket_label(n) for n in buckets), key=lambda k: t[k])
    comm, comm16 = t["comm"], t.get("comm fp16")
    out = {
        "step_s": t, "tx_bytes_per_step": b,
        "comm_over_compute": comm / t["compute"] if t["compute"] > 0 else float("nan"),
        "hidden": {k: hidden_fraction(t["compute"], comm, t[k])
                   for k in ("after", *(bucket_label(n) for n in buckets))},
        "overlap_case": bucketed,
        "overlap_hidden": hidden_fraction(t["compute"], comm, t[bucketed]),
        "fusion_best": best_name,
        "fusion_sweep_default_vs_best": default / sweep[best_name] if swept or not confirm
        else None,
        "fusion_default_vs_best": default / sweep[best_name],
        "ring_min_bytes": ring_minimum(param_bytes, p),
        "bytes_vs_ring": b["after"] / ring_minimum(param_bytes, p) if b.get("after") else None,
    }
    if confirm:
        rival = next(k for k in confirm if k != "default")
        out["fusion_confirm"] = dict(confirm)
        pair = confirm_median or confirm
        out["fusion_default_vs_best"] = pair["default"] / pair[rival]
        if confirm_median:
            out["fusion_confirm_median"] = dict(confirm_median)
    if "fp16" in t:
        out["fp16_speedup"] = t["after"] / t["fp16"]
        out["fp16_cut_of_comm"] = (t["after"] - t["fp16"]) / comm if comm > 0 else float("nan")
        out["fp16_bytes_ratio"] = b["fp16"] / b["after"] if b.get("after") else None
        out["fp16_comm_ratio"] = comm16 / comm if comm16 else None
    return out


# -- the ranks ---------------------------------------------------------------------------

def _pin():
    """Rank r on core r (modulo the cores), before TensorFlow starts its threads."""
    rank = int(os.environ.get("HOROVOD_RANK", 0))
    cores = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cores[rank % len(cores)]})
    return cores[rank % len(cores)]


def _tc_binary():
    import shutil  # noqa: WPS433
    return shutil.which("tc") or "/usr/sbin/tc"


def set_rate(rate, queue):
    """Shape this host's egress (run by each rank on its own host)."""
    _run_tc(tc_commands(rate, queue, tc=_tc_binary()))


def make_cnn_head():
    """A small CNN with a large dense head: 32x32x3 -> 2 convs -> Dense(256) -> 10
    (the dense head holds 99% of the 0.53M weights)."""
    import keras  # noqa: WPS433
    L = keras.layers
    inp = keras.Input((32, 32, 3), name="image")
    x = L.Conv2D(16, 3, padding="same", activation="relu", name="conv1")(inp)
    x = L.MaxPooling2D(2, name="pool1")(x)
    x = L.Conv2D(32, 3, padding="same", activation="relu", name="conv2")(x)
    x = L.MaxPooling2D(2, name="pool2")(x)
    x = L.Flatten(name="flatten")(x)
    x = L.Dense(256, activation="relu", name="fc1")(x)
    out = L.Dense(10, name="fc2")(x)
    return keras.Model(inp, out, name="wire_cnn_head")


def make_vgg():
    """A VGG-like conv stack at 32x32 input (0.42M weights, most in the convolutions)."""
    import keras  # noqa: WPS433
    L = keras.layers
    inp = keras.Input((32, 32, 3), name="image")
    x = inp
    for i, (filters, convs) in enumerate(((32, 2), (64, 2), (128, 2))):
        for j in range(convs):
            x = L.Conv2D(filters, 3, padding="same", activation="relu",
                         name=f"conv{i + 1}_{j + 1}")(x)
        x = L.MaxPooling2D(2, name=f"pool{i + 1}")(x)
    x = L.Flatten(name="flatten")(x)
    x = L.Dense(64, activation="relu", name="fc1")(x)
    out = L.Dense(10, name="fc2")(x)
    return keras.Model(inp, out, name="wire_vgg")


MODELS = {"cnn_head": make_cnn_head, "vgg": make_vgg}


def _contenders(make, local_batch, buckets, rate_machines=None):
    """{name: step callable} of one model, its parameter bytes, and a function that
    traces, per rate, the ``default`` step (``bucket_bytes="auto"`` traced with that
    rate's calibrated machine in ``TFHYBRID_MACHINE``) and returns {rate: (step,
    the bucket sizes it chose)}. The worker traces the defaults after the sweep:
    every function traced in a process slows its steps a little (:func:`worker`)."""
    import keras  # noqa: WPS433
    import numpy as np  # noqa: WPS433
    import tensorflow as tf  # noqa: WPS433
    import tfhybrid  # noqa: WPS433
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    rng = np.random.default_rng(int(os.environ.get("HOROVOD_RANK", 0)))
    x = tf.constant(rng.standard_normal((local_batch, 32, 32, 3)).astype("float32"))
    y = tf.constant(rng.integers(0, 10, local_batch).astype("int32"))

    def train_step(optimizer):
        keras.utils.set_random_seed(0)
        model = make()

        @tf.function(jit_compile=False)
        def step():
            with tf.GradientTape() as tape:
                loss = loss_fn(y, model(x, training=True))
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply(grads, model.trainable_variables)
            return loss
        return model, step

    def dist(name, **kw):    # distinct names: distinct collective names per contender
        return tfhybrid.DistributedOptimizer(keras.optimizers.SGD(0.01), name=name, **kw)

    steps = {}
    after_opt = dist("wire_after", bucket_bytes=DEFAULT_BUCKET)
    model, steps["after"] = train_step(after_opt)
    for nbytes in buckets:
        steps[bucket_label(nbytes)] = train_step(dist(f"wire_b{nbytes}", bucket_bytes=nbytes))[1]
    steps["compute"] = train_step(keras.optimizers.SGD(0.01))[1]
    fp16_opt = dist("wire_fp16", bucket_bytes=DEFAULT_BUCKET, compression="fp16")
    steps["fp16"] = train_step(fp16_opt)[1]
    ones = [tf.ones_like(v) for v in model.trainable_variables]
    for name, opt in (("comm", after_opt), ("comm fp16", fp16_opt)):
        steps[name] = tf.function(
            lambda opt=opt: opt.reduce_gradients(ones, model.trainable_variables))
    for fn in steps.values():      # trace, and build the optimizers' slots
        fn()
        fn()

    def trace_defaults():
        defaults = {}
        for i, (rate, machine) in enumerate((rate_machines or {}).items()):
            # the default optimizer as a user on a link of this rate runs it: its machine
            # file in TFHYBRID_MACHINE when the step is traced (when "auto" is resolved)
            os.environ["TFHYBRID_MACHINE"] = str(machine)
            try:
                opt = dist(f"wire_auto{i}")
                fn = train_step(opt)[1]
                fn()
                fn()
            finally:
                os.environ.pop("TFHYBRID_MACHINE", None)
            defaults[rate] = (fn, [b["bytes"] for b in opt.communication_plan()["buckets"]])
        return defaults
    param_bytes = sum(int(np.prod(v.shape)) * 4 for v in model.trainable_variables)
    return steps, param_bytes, trace_defaults


def _control_rate(barrier, seconds=2.0):
    """Bytes per second eth0 sends while this rank only sleeps: Horovod's per-cycle
    coordination (:func:`payload_bytes`)."""
    barrier()
    b0, t0 = tx_bytes(), time.perf_counter()
    time.sleep(seconds)
    rate = (tx_bytes() - b0) / (time.perf_counter() - t0)
    barrier()
    return rate


def _timed_steps(fn, n, barrier, cpu=None):
    """n step times and the bytes eth0 sent over them; appends to ``cpu`` the share of
    the steps' wall time this process was on a CPU (all its threads: TensorFlow's, and
    Horovod's background and Gloo's, which send and receive)."""
    barrier()
    b0, times, c0 = tx_bytes(), [], time.process_time()
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    if cpu is not None:
        cpu.append((time.process_time() - c0) / sum(times))
    barrier()
    return times, tx_bytes() - b0


def _oracle_part(args, say, barrier, set_all_rates):
    """Every strategy at the calibrated rate, as bench/oracle_accuracy.py builds and
    times them, plus the bytes each step puts on the wire and describe's volume."""
    import bench.oracle_accuracy as oa  # noqa: WPS433
    import tfhybrid  # noqa: WPS433
    from tfhybrid.comm import backend  # noqa: WPS433
    oa.make_model, oa.MODEL_PATH = make_cnn_head, args.oracle_model
    use_plan_segments(oa, args.p_segments)
    set_all_rates(args.rates[0])
    n = backend.size()
    steps = oa._build_steps(list(args.strategies), n, args.batch, args.machine)
    steps.pop("serial", None)
    say(f"oracle: built {list(steps)} at {args.rates[0]}")
    # rounds first, not timed: a strategy's first seconds of steps ran slower (round by
    # round at 100 Mbit/s, ds's best step 37.6, 34.4, then 28-31 ms; gmp's 42-45 ms for
    # a few seconds, then 33-36), and a run trains in the later state; then
    # ORACLE_ROUNDS x as many rounds as a model's contenders get (a strategy's step is
    # short and the job's start-up long: the median of 15 rounds' bests is steadier)
    rounds = ORACLE_ROUNDS * args.rounds
    oa._interleaved(steps, rounds, args.steps, lambda s: None)
    say(f"oracle: {rounds} rounds of warm-up")
    times, _ = oa._interleaved(steps, rounds, args.steps, say)
    control = _control_rate(barrier)
    say(f"oracle: Horovod's coordination while idle sends {control:,.0f} B/s per rank")
    out = {}
    for name, (step, info) in steps.items():
        oa._use_grid(info.get("model_parallel"))
        barrier()
        byte_times, nbytes = _timed_steps(step, args.steps, barrier)
        described = None
        model = getattr(step, "model", None)
        try:
            # what describe says this rank sends per step (not the payload `comm_bytes`)
            described = tfhybrid.describe(model, batch_size=args.batch, print_fn=None).sent_bytes
        except Exception as err:  # noqa: BLE001 - a strategy describe cannot read: say so
            described = f"{type(err).__name__}: {str(err)[:120]}"
        phases = None
        if name not in ("ls", "p"):     # Profile's per-phase measurement, with the
            from tfhybrid.profiling import measure_phases  # noqa: WPS433
            # calibration's statistic, so that measured and predicted phases compare
            phases = measure_phases(model, step.local_batch, reps=5, stat=args.collective_stat)
        out[name] = dict(info, seconds=typical(times[name], args.steps),
                         best_s=min(times[name]), tx_bytes_per_step=nbytes / args.steps,
                         describe_bytes=described, phases=phases,
                         control_bytes_per_s=control,
                         bytes_step_s=statistics.mean(byte_times))
    return out


def _mean_over_ranks(values, name):
    """{key: the mean over the ranks of this rank's value} (collective: every rank
    calls it with the same keys, in the same order)."""
    import tensorflow as tf  # noqa: WPS433
    from tfhybrid.comm import backend  # noqa: WPS433
    size = backend.size()
    total = backend.allreduce(tf.constant(list(values.values()), tf.float64),
                              tuple(range(size)), name).numpy()
    return {k: v / size for k, v in zip(values, total.tolist())}


def _confirm_default(built, defaults, times, args, set_all_rates, say, barrier):
    """({(model, rate): {"default": s, rival: s}}, the same with median steps): the
    default step and the sweep's fastest fixed bucket size (:func:`fusion_rival`,
    chosen on the ranks' mean steps, so that every rank runs the same pair) timed
    in ``args.rounds`` fresh rounds, in turn, which of the two first alternating;
    :func:`typical` of their steps, and the median of all of them."""
    keys = [(m, r, k) for m in built for r in args.rates for k in sweep_names()]
    agreed = _mean_over_ranks(
        {key: typical(times[key], steps_at(key[1], args.steps)) for key in keys}, "wire.confirm")
    pairs, fns = {}, {}
    for m in built:
        for rate in args.rates:
            if rate in defaults[m]:
                t = {k: agreed[(m, rate, k)] for k in sweep_names()}
                pairs[(m, rate)] = ("default", fusion_rival(t))
                fns[(m, rate)] = {"default": defaults[m][rate][0],
                                  pairs[(m, rate)][1]: built[m][0][pairs[(m, rate)][1]]}
    if not pairs:
        return {}, {}
    got = {(m, r, k): [] for (m, r), pair in pairs.items() for k in pair}
    for rnd in range(args.rounds):
        for rate in args.rates:
            set_all_rates(rate)
            for m in built:
                if (m, rate) not in pairs:
                    continue
                pair = pairs[(m, rate)][::(-1) ** rnd]
                for k in pair:
                    t, _ = _timed_steps(fns[(m, rate)][k], steps_at(rate, args.steps),
                                        barrier)
                    got[(m, rate, k)] += t
        say(f"confirmation round {rnd + 1}/{args.rounds} done")
    return ({(m, r): {k: typical(got[(m, r, k)], steps_at(r, args.steps)) for k in pair}
             for (m, r), pair in pairs.items()},
            {(m, r): {k: statistics.median(got[(m, r, k)]) for k in pair}
             for (m, r), pair in pairs.items()})


def worker(args):
    core = _pin()
    os.environ["DP_BENCH_SKIP_MWMS"] = "1"      # bench.dp: no MWMS server at import
    sys.path.insert(0, str(ROOT))
    import bench.dp as dp  # noqa: WPS433  (its barrier)
    import tfhybrid  # noqa: WPS433
    from tfhybrid.comm import backend  # noqa: WPS433
    tfhybrid.init()
    rank, size = backend.rank(), backend.size()
    say = (lambda s: print(s, flush=True)) if rank == 0 else (lambda s: None)
    say(f"{size} ranks; rank 0 on {os.uname().nodename} core {core}")

    def set_all_rates(rate):
        dp.barrier()
        set_rate(rate, args.queue)
        dp.barrier()

    res = {"world_size": size, "rates": args.rates, "rounds": args.rounds,
           "steps": args.steps, "batch": args.batch, "models": {}}
    if args.models:
        local = args.batch // size
        machines = dict(zip(args.rates, args.rate_machines or ()))
        built = {m: _contenders(MODELS[m], local, BUCKETS, machines) for m in args.models}

        say(f"traced {sum(len(built[m][0]) for m in built)} contenders per rate")
        times = {(m, r, k): [] for m in built for r in args.rates for k in built[m][0]}
        sent = {key: [] for key in times}
        busy = {key: [] for key in times}
        for rnd in range(args.rounds):
            for rate in args.rates:
                set_all_rates(rate)
                for m in built:
                    n_steps = steps_at(rate, args.steps)
                    for k, fn in built[m][0].items():
                        t, nb = _timed_steps(fn, n_steps, dp.barrier, busy[(m, rate, k)])
                        times[(m, rate, k)] += t
                        sent[(m, rate, k)].append(nb / n_steps)
            say(f"round {rnd + 1}/{args.rounds} done")
        # the defaults, traced now: each function traced before the sweep would slow it
        defaults = {m: built[m][2]() for m in built}
        confirm, confirm_median = _confirm_default(built, defaults, times, args,
                                                   set_all_rates, say, dp.barrier)
        for m, (_, param_bytes, _) in built.items():
            res["models"][m] = {"param_bytes": param_bytes, "rates": {}}
            for rate in args.rates:
                steps = built[m][0]
                t = {k: typical(times[(m, rate, k)], steps_at(rate, args.steps)) for k in steps}
                # bytes: the mean over the ranks of what each one's interface sent
                b = _mean_over_ranks({k: statistics.median(sent[(m, rate, k)]) for k in steps},
                                     "wire.bytes")
                res["models"][m]["rates"][rate] = summarise_rate(
                    t, b, param_bytes, size, confirm=confirm.get((m, rate)),
                    confirm_median=confirm_median.get((m, rate)))
                res["models"][m]["rates"][rate]["cpu_share"] = {
                    k: statistics.median(busy[(m, rate, k)]) for k in steps}
                if rate in defaults[m]:
                    res["models"][m]["rates"][rate]["auto_buckets"] = defaults[m][rate][1]
    if args.strategies:
        res["oracle"] = _oracle_part(args, say, dp.barrier, set_all_rates)
    set_all_rates("unlimited")
    if rank == 0:
        Path(args.out).write_text(json.dumps(res, indent=1, default=str))


# -- the driver ----------------------------------------------------------------------------

def _jobs():
    # hosts of our own (tfhwire-*): hosts.py's cleanup() removes every host of its prefix,
    # and other runs (the multi-host tests) use the default one on this machine
    os.environ.setdefault("TFHYBRID_TEST_HOSTS_PREFIX", "tfhwire")
    sys.path.insert(0, str(ROOT / "tests" / "multihost"))
    import hosts as hosts_mod  # noqa: WPS433
    import jobs  # noqa: WPS433
    return hosts_mod, jobs


def _launch(hosts, jobs, script, args, timeout, log):
    """jobs.launch, once more if ssh to a test host was refused at the key exchange
    (sshd under load on this shared machine: ``kex_exchange_identification``)."""
    run = jobs.launch(hosts, script, 1, args=args, timeout=timeout)
    if run.rc != 0 and "kex_exchange_identification" in run.out:
        log("ssh to a test host was reset at the key exchange; launching once more")
        time.sleep(5)
        run = jobs.launch(hosts, script, 1, args=args, timeout=timeout)
    return run


def _jumbo_frames(hosts):
    """MTU :data:`MTU` on the test hosts' link: both ends of each host's veth pair and
    the bridge (``tests/multihost/hosts.py`` names them)."""
    prefix = _jobs()[0].PREFIX
    for name in hosts.names:
        ns = f"{prefix}-{name}"
        for argv in (["ip", "link", "set", ns, "mtu", str(MTU)],
                     ["ip", "-n", ns, "link", "set", IFACE, "mtu", str(MTU)]):
            subprocess.run(argv, check=True, capture_output=True)
    subprocess.run(["ip", "link", "set", f"{prefix}-br0", "mtu", str(MTU)], check=True,
                   capture_output=True)


def _shape_hosts(hosts, rate, queue):
    """Shape every test host's egress (``ip netns exec <host's namespace> tc ...``)."""
    prefix = _jobs()[0].PREFIX
    for name in hosts.names:
        _run_tc(tc_commands(rate, queue), ("ip", "netns", "exec", f"{prefix}-{name}"), name)


def _calibrate_sizes(args):
    """calibrate's message sizes and repetitions: 8 sizes from 4 KiB to 4 MiB (the
    step's collectives lie between), 5 repetitions; --quick: 6 and 3."""
    return ["--max-bytes", str(4 << 20), "--sizes", "6" if args.quick else "8",
            "--reps", "3" if args.quick else "5"]


def rate_machine_path(rate):
    """The machine file ``tfhybrid calibrate`` measures at ``rate`` (no model)."""
    return RESULTS / f"wire_machine_{rate}.json"


def _calibrate(hosts, jobs, args, log, rate, out, extra=(), save=None):
    """``tfhybrid calibrate -o out`` across the hosts at ``rate``, each rank pinned to
    one core as in the measuring job (wire.py --pin-exec); ``save``: a file for the
    job's output, written whether it succeeds or not."""
    _shape_hosts(hosts, rate, args.queue)
    cal = [__file__, "--pin-exec", jobs.python(), "-m", "tfhybrid", "calibrate", "-o",
           str(out), "--collective-stat", args.collective_stat, *extra, *_calibrate_sizes(args)]
    t0 = time.time()
    run = _launch(hosts, jobs, cal[0], cal[1:], args.timeout, log)
    if save is not None:
        save.write_text(run.out)
    if run.rc != 0:
        raise RuntimeError(f"calibrate across the hosts at {rate} failed: {run.out[-3000:]}")
    log(f"calibrated across the hosts at {rate} in {time.time() - t0:.0f} s")


def _calibrate_links(hosts, jobs, args, log):
    """``tfhybrid calibrate`` (collectives only) at every rate but the first, whose
    machine is the oracle's: the links the default bucket size adapts to."""
    paths = [args.machine]
    for rate in args.rates[1:]:
        _calibrate(hosts, jobs, args, log, rate, rate_machine_path(rate))
        paths.append(str(rate_machine_path(rate)))
    return paths


def _calibrate_and_plan(hosts, jobs, args, log):
    """``tfhybrid calibrate`` across the hosts at the first rate; ``tfhybrid plan`` on it."""
    py = jobs.python()
    import tfhybrid  # noqa: F401,WPS433  (the model file needs keras; the driver has it)
    make_cnn_head().save(args.oracle_model)
    _calibrate(hosts, jobs, args, log, args.rates[0], args.machine,
               ["--model", args.oracle_model, "--batch", str(args.batch // 2)],
               save=RESULTS / "wire_calibrate.log")
    plan_json = RESULTS / "wire_plan.json"
    strategies = ",".join(args.strategies)
    out = subprocess.run([py, "-m", "tfhybrid", "plan", args.oracle_model, "--np", "2",
                          "--batch", str(args.batch), "--machine", args.machine,
                          "--strategies", strategies, "--json", str(plan_json)],
                         capture_output=True, text=True, cwd=ROOT, timeout=600,
                         env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2",
                                  PYTHONPATH=str(ROOT)))
    if out.returncode != 0:
        raise RuntimeError(f"tfhybrid plan failed: {out.stdout[-2000:]}{out.stderr[-2000:]}")
    log(out.stdout.strip())
    return json.loads(plan_json.read_text())


def plan_segments(plan_json):
    """The micro-batches ``tfhybrid plan`` chose for p (None: p not planned)."""
    for row in plan_json.get("predictions", []):
        if row.get("strategy") == "p":
            return (row.get("options") or {}).get("segments")
    return None


def use_plan_segments(oa, segments):
    """Build and predict p with the micro-batches plan chose (the p that plan ranks)."""
    if segments:
        oa.STRATEGIES["p"] = ("world", {"micro_batches": int(segments)})
        oa.P_SEGMENTS = int(segments)


def _oracle_rows(measured, args, plan):
    """Per strategy: measured, predicted (the calibrated machine, options as built),
    plan's own prediction, accuracy, phases and bytes."""
    sys.path.insert(0, str(ROOT))
    import bench.oracle_accuracy as oa  # noqa: WPS433
    oa.make_model, oa.MODEL_PATH = make_cnn_head, args.oracle_model
    use_plan_segments(oa, plan_segments(plan))
    plan_pred = dict(plan_order(plan))
    rows = {}
    for name, m in measured.items():
        pred = oa._predict(args.machine, name, 2, args.batch, m.get("model_parallel"))
        comm = sum(pred.comm_s.values())
        rows[name] = {"measured_s": m["seconds"], "best_s": m["best_s"],
                      "predicted_s": pred.total_s, "plan_s": plan_pred.get(name),
                      "pred_compute_s": pred.compute_s, "pred_comm_s": comm,
                      "comm_share": comm / pred.total_s if pred.total_s else None,
                      "accuracy": accuracy(pred.total_s, m["seconds"]),
                      "tx_bytes_per_step": m["tx_bytes_per_step"],
                      "describe_bytes": m["describe_bytes"],
                      "phase_accuracy": oa._phase_accuracy(m.get("phases"), pred)}
        d = m["describe_bytes"]
        known = isinstance(d, (int, float)) and d
        rows[name]["bytes_vs_describe"] = m["tx_bytes_per_step"] / d if known else None
        if "control_bytes_per_s" in m:      # runs before the coordination was measured lack it
            payload = payload_bytes(m["tx_bytes_per_step"], m["control_bytes_per_s"],
                                    m["bytes_step_s"])
            rows[name]["payload_bytes_per_step"] = payload
            rows[name]["payload_vs_describe"] = payload / d if known else None
            rows[name]["control_per_s"] = m["control_bytes_per_s"]
    return rows


def _count(v):
    return "-" if v is None else f"{v:,.0f}"


def _table(res, args):
    lines = []
    for m, mres in res.get("models", {}).items():
        rates = list(mres["rates"])
        names = list(next(iter(mres["rates"].values()))["step_s"])
        lines += [f"\n{m}: |W| = {mres['param_bytes']:,} B, 2 hosts x 1 rank, batch "
                  f"{args.batch}; step ms (median over rounds of each round's best) per rate",
                  "| contender | " + " | ".join(rates) + " | tx B/step @" + rates[0] + " |",
                  "|---|" + "---:|" * (len(rates) + 1)]
        for k in names:
            lines.append(f"| {k} | " + " | ".join(
                f"{mres['rates'][r]['step_s'][k] * 1e3:.1f}" for r in rates)
                + " | " + _count(mres['rates'][rates[0]]['tx_bytes_per_step'].get(k)) + " |")
        for label, key, fmt in (("comm/compute", "comm_over_compute", "{:.2f}"),
                                ("hidden (best bucketed)", "overlap_hidden", "{:.2f}"),
                                ("hidden (one bucket, after)", None, "{:.2f}"),
                                ("default / best bucket size (sweep rounds)",
                                 "fusion_sweep_default_vs_best", "{:.3f}"),
                                ("default / best bucket size (confirmed, median steps)",
                                 "fusion_default_vs_best", "{:.3f}"),
                                ("bytes / ring minimum", "bytes_vs_ring", "{:.3f}"),
                                ("fp16 speed-up (step fp32 / fp16)", "fp16_speedup", "{:.3f}"),
                                ("fp16 step cut / comm time", "fp16_cut_of_comm", "{:.2f}"),
                                ("fp16 bytes / fp32 bytes", "fp16_bytes_ratio", "{:.3f}")):
            vals = []
            for r in rates:
                v = (mres["rates"][r]["hidden"].get("after") if key is None
                     else mres["rates"][r].get(key))
                vals.append("-" if v is None else fmt.format(v))
            lines.append(f"| {label} | " + " | ".join(vals) + " | |")
        for k in ("compute", "comm", "after"):
            shares = [mres["rates"][r].get("cpu_share", {}).get(k) for r in rates]
            if any(v is not None for v in shares):
                lines.append(f"| CPU busy / wall: {k} | " + " | ".join(
                    "-" if v is None else f"{v:.2f}" for v in shares) + " | |")
        rivals = [next((k for k in mres["rates"][r].get("fusion_confirm") or {}
                        if k != "default"), "-") for r in rates]
        if any(v != "-" for v in rivals):
            lines.append("| confirmed against | " + " | ".join(rivals) + " | |")
        autos = [mres["rates"][r].get("auto_buckets") for r in rates]
        if any(autos):
            lines.append("| default (auto) buckets KiB | " + " | ".join(
                "-" if not a else "+".join(f"{n / 2**10:.0f}" for n in a) for a in autos)
                + " | |")
    rows = res.get("oracle_rows")
    if rows:
        lines += [f"\noracle at {args.rates[0]} (machine file from `tfhybrid calibrate` across "
                  "the hosts): ms", "| strategy | measured | predicted | plan | accuracy | "
                  "comm share (pred) | tx B/step | describe B | tx/describe | "
                  "(tx - coordination)/describe |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for s, r in rows.items():
            d = r["describe_bytes"]
            lines.append(
                f"| {s} | {r['measured_s'] * 1e3:.1f} | {r['predicted_s'] * 1e3:.1f} | "
                + (f"{r['plan_s'] * 1e3:.1f}" if r["plan_s"] else "-")
                + f" | {r['accuracy']:.3f} | {r['comm_share'] or 0:.2f} | "
                f"{r['tx_bytes_per_step']:,.0f} | "
                + (f"{d:,}" if isinstance(d, int) else str(d)[:40]) + " | "
                + (f"{r['bytes_vs_describe']:.3f}" if r["bytes_vs_describe"] else "-") + " | "
                + (f"{r['payload_vs_describe']:.3f}" if r.get("payload_vs_describe") else "-")
                + " |")
        idle = {r["control_per_s"] for r in rows.values() if r.get("control_per_s")}
        if idle:
            lines.append(f"- coordination: Horovod's cycle sends {max(idle):,.0f} B/s per rank "
                         f"while idle (cycle {res.get('cycle_ms')} ms); (tx - coordination) "
                         "takes that rate times the step from tx")
        for s, r in rows.items():
            if r["phase_accuracy"]:
                lines.append(f"- {s} phases ms measured ({res.get('collective_stat', 'best')} "
                             "of 5, each collective replayed alone)/predicted: " + "; ".join(
                    f"{k} {a * 1e3:.1f}/{b * 1e3:.1f}" for k, (a, b, _) in
                    r["phase_accuracy"].items()))
    return "\n".join(lines)


def readme_table(res):
    """The short table of the README's Benchmarks section (from the VGG-like model,
    or the first model measured): steps per rate, the fusion ratio, the overlap,
    the oracle."""
    models = res.get("models") or {}
    if not models:
        return ""
    name = "vgg" if "vgg" in models else next(iter(models))
    rates = models[name]["rates"]
    head = (f"| {name}, 2 hosts x 1 rank, {res.get('date')} ({res.get('cores')} cores) | "
            + " | ".join(rates) + " |")
    lines = [head, "|---|" + "---:|" * len(rates)]

    def row(label, fn):
        vals = []
        for v in rates.values():
            try:
                vals.append(fn(v))
            except (KeyError, TypeError, ZeroDivisionError):
                vals.append("-")
        lines.append(f"| {label} | " + " | ".join(vals) + " |")
    row("step ms: compute alone", lambda v: f"{v['step_s']['compute'] * 1e3:.1f}")
    row("step ms: one bucket after back-propagation",
        lambda v: f"{v['step_s']['after'] * 1e3:.1f}")
    row("step ms: default (auto buckets; confirmation rounds)",
        lambda v: f"{v['step_s'].get('default', v['step_s']['after']) * 1e3:.1f}")
    row("default / fastest fixed bucket size (median steps)",
        lambda v: f"{v['fusion_default_vs_best']:.3f}")
    row("step ms: fp16", lambda v: f"{v['step_s']['fp16'] * 1e3:.1f}")
    row("communication hidden (best buckets)", lambda v: f"{v['overlap_hidden']:.2f}")
    row("bytes sent / ring minimum", lambda v: f"{v['bytes_vs_ring']:.3f}")
    acc = [r["accuracy"] for r in (res.get("oracle_rows") or {}).values()]
    if acc:
        lines.append(f"| oracle accuracy at {res['rates'][0]}: mean {statistics.mean(acc):.2f}, "
                     f"worst {min(acc):.2f} ({len(acc)} strategies) |" + " |" * len(rates))
    return "\n".join(lines)


def headline(res):
    """The WIRE line's numbers from the whole result."""
    overlap, fusion, ring, fp16 = float("nan"), float("nan"), float("nan"), float("nan")
    cases = [(m, r, v) for m, mres in res.get("models", {}).items()
             for r, v in mres["rates"].items()]
    if cases:
        # overlap: the case whose communication is closest to its compute, on a shaped
        # link: unshaped, the veth moves the bytes at memory speed on the rank's own
        # core, so "communication" is CPU work that cannot hide behind compute there
        shaped = [c for c in cases if rate_bits(c[1]) is not None] or cases
        m, r, v = min(shaped, key=lambda c: abs(math.log(max(c[2]["comm_over_compute"], 1e-9))))
        overlap = v["overlap_hidden"]
        fusion = max(v["fusion_default_vs_best"] for _, _, v in cases)
        ring_cases = [v["bytes_vs_ring"] for _, _, v in cases if v.get("bytes_vs_ring")]
        ring = statistics.median(ring_cases) if ring_cases else float("nan")
        slow = [v for _, r, v in cases if r == res["rates"][0] and "fp16_speedup" in v]
        fp16 = statistics.median(v["fp16_speedup"] for v in slow) if slow else float("nan")
    rows = res.get("oracle_rows") or {}
    acc = {s: r["accuracy"] for s, r in rows.items()}
    mean = statistics.mean(acc.values()) if acc else float("nan")
    worst = min(acc.values()) if acc else float("nan")
    measured = {s: r["measured_s"] for s, r in rows.items()}
    plan_pred = {s: r["plan_s"] for s, r in rows.items() if r.get("plan_s") is not None}
    pick = "ok" if plan_pred and pick_ok(plan_pred, measured) else "miss"
    return wire_line(overlap, fusion, ring, fp16, mean, worst, pick)


def _last_meta():
    """date, machine, cores, rates of the last run (``--repredict``)."""
    try:
        last = json.loads((RESULTS / "wire.json").read_text())
    except (OSError, ValueError):
        last = {}
    return {k: last.get(k) for k in ("date", "machine", "cores", "rates", "load_average_start",
                                     "cycle_ms", "collective_stat", "queue")}


def driver(args):
    if args.repredict:
        return report(args, json.loads((RESULTS / "wire_measured.json").read_text()),
                      json.loads((RESULTS / "wire_plan.json").read_text()),
                      _last_meta())
    if os.geteuid() != 0:
        sys.exit("bench/wire.py makes test hosts (network namespaces, sshd): run it as root")
    hosts_mod, jobs = _jobs()
    reason = hosts_mod.unavailable_reason()
    if reason:
        sys.exit(f"cannot make test hosts: {reason}")
    if jobs.PATCH not in jobs.horovod_patches():
        sys.exit(f"{jobs.python()}: this Horovod lacks tfhybrid's patch {jobs.PATCH}; run the "
                 "driver with the patched build's python (scripts/setup_env.sh builds it)")
    RESULTS.mkdir(parents=True, exist_ok=True)
    t_start = time.time()
    # every job of the run (calibrations and measurement) with the same Horovod cycle
    os.environ["HOROVOD_CYCLE_TIME"] = f"{args.cycle_ms:g}"

    def log(s):
        print(f"[{time.time() - t_start:6.0f} s] {s}", flush=True)
    res = {"date": time.strftime("%Y-%m-%d %H:%M"), "machine": os.uname().nodename,
           "cores": os.cpu_count(), "load_average_start": os.getloadavg(),
           "rates": args.rates, "cycle_ms": args.cycle_ms, "collective_stat": args.collective_stat,
           "queue": args.queue}
    with hosts_mod.TestHosts(2) as hosts:
        _jumbo_frames(hosts)
        log(f"hosts {hosts.names} up (MTU {MTU})")
        plan = None
        if args.strategies:
            plan = _calibrate_and_plan(hosts, jobs, args, log)
            res["plan"] = plan_order(plan)
        machines = []
        if args.models and plan is not None:
            machines = _calibrate_links(hosts, jobs, args, log)
        _shape_hosts(hosts, "unlimited", args.queue)
        out = RESULTS / "wire_measured.json"
        out.unlink(missing_ok=True)
        common = ["--rounds", args.rounds, "--steps", args.steps, "--batch", args.batch,
                  "--rates", *args.rates, "--machine", args.machine,
                  "--oracle-model", args.oracle_model, "--collective-stat", args.collective_stat,
                  "--queue", args.queue]
        common += ["--p-segments", plan_segments(plan)] if plan and plan_segments(plan) else []
        # one job per model and one per strategy of the oracle, as a user runs one
        # model and one strategy per job: a process that has traced many functions
        # dispatches every op more slowly (after both models' 24 contenders: a 256x256
        # matmul +20%, a small function's call +36%, 8-17 ms more on gmp, s and ls; with
        # 4 more contenders traced next to vgg's, its bucketed steps took 2-5 ms more,
        # and the share of communication hidden at 1 Gbit/s fell from 0.59 to 0.40)
        parts = [(f"model {m}", ["--models", m, "--strategies", "none",
                                 *(["--rate-machines", *machines] if machines else [])])
                 for m in args.models]
        parts += [(f"strategy {s}", ["--models", "none", "--strategies", s])
                  for s in args.strategies]
        measured = {}
        for part, extra in parts:
            part_out = RESULTS / f"wire_measured_{part.replace(' ', '_')}.json"
            part_out.unlink(missing_ok=True)
            t0 = time.time()
            run = _launch(hosts, jobs, Path(__file__),
                          ["--worker", "--out", part_out, *common, *extra], args.timeout, log)
            for line in run.out.splitlines():
                if "[0]<stdout>" in line:
                    log(line.split(">:", 1)[-1].strip())
            if run.rc != 0 or not part_out.exists():
                raise SystemExit(f"the measuring job ({part}) failed (exit {run.rc}): "
                                 f"{run.out[-4000:]}")
            log(f"measured the {part} in {time.time() - t0:.0f} s")
            measured = merge_parts(measured, json.loads(part_out.read_text()))
            part_out.unlink()
        out.write_text(json.dumps(merge_parts(measured, {}), indent=1, default=str))
    return report(args, json.loads(out.read_text()), plan, res)


def report(args, measured, plan, res):
    """The tables, bench/results/wire.json and the WIRE line."""
    res.update(measured)
    if plan is not None and res.get("oracle"):
        res["oracle_rows"] = _oracle_rows(res["oracle"], args, plan)
    res["load_average_end"] = os.getloadavg()
    text = _table(res, args)
    print(text)
    line = headline(res)
    res["wire"] = line
    (RESULTS / "wire.json").write_text(json.dumps(res, indent=1, default=str))
    (RESULTS / "wire.md").write_text(
        f"{res.get('date')}, {res.get('machine')} ({res.get('cores')} cores, load "
        f"{os.getloadavg()[0]:.1f}), rates {' '.join(args.rates)}, rounds {args.rounds} x "
        f"{args.steps} steps (x {steps_at(args.rates[-1], 1)} at {args.rates[-1]}, "
        f"bench/wire.py steps_at; oracle strategies {ORACLE_ROUNDS * args.rounds} rounds after "
        f"as many of warm-up)\n{text}\n\n`{line}`\n")
    table = readme_table(res)
    if table:
        (RESULTS / "wire_readme.md").write_text(table + "\n")
        print("\nREADME table:\n" + table)
    print(f"wrote {RESULTS / 'wire.json'}; load average {os.getloadavg()[0]:.1f} on "
          f"{os.cpu_count()} cores")
    print(line)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true",
                    help="100 Mbit/s and unlimited, the VGG-like model, 2 rounds of 3 steps, "
                    "strategies d f df gmp s, a short calibration")
    ap.add_argument("--rates", nargs="+", help=f"tc rates (default {' '.join(RATES)}); "
                    "the first is the one calibrated and the oracle's")
    ap.add_argument("--models", nargs="+", help=f"of {sorted(MODELS)} (none: skip)")
    ap.add_argument("--strategies", nargs="+", help="oracle strategies (none: skip)")
    ap.add_argument("--rounds", type=int)
    ap.add_argument("--steps", type=int, help="steps per contender per round")
    ap.add_argument("--batch", type=int, default=32, help="global batch")
    ap.add_argument("--cycle-ms", type=float, default=1.0,
                    help="Horovod's background cycle (HOROVOD_CYCLE_TIME, "
                    "tfhybrid.Config(cycle_time_ms=...)) of every job: a collective starts at "
                    "the next cycle, so on a slow link the default 5 ms delays every bucket "
                    "(default 1)")
    ap.add_argument("--collective-stat", choices=("best", "median", "mean"), default="median",
                    help="calibrate's statistic per collective (tfhybrid calibrate "
                    "--collective-stat): across the link a collective's time spreads (a 128 KiB "
                    "allgather at 100 Mbit/s: 9.9 to 17.7 ms), and a step pays the typical "
                    "time (default median)")
    ap.add_argument("--queue", choices=QUEUES, default="small-first",
                    help="each host's egress queue: small packets (ACKs, Horovod's "
                    "negotiation) before queued data, as fq_codel serves sparse flows "
                    "(default), or one FIFO (see tc_commands)")
    ap.add_argument("--timeout", type=int, default=1800, help="seconds per horovodrun job")
    ap.add_argument("--machine", default=str(RESULTS / "wire_machine.json"))
    ap.add_argument("--oracle-model", default=str(RESULTS / "wire_cnn_head.keras"))
    ap.add_argument("--repredict", action="store_true",
                    help="report the last run's measurements again (no hosts, no jobs)")
    ap.add_argument("--rate-machines", nargs="+", help=argparse.SUPPRESS)
    ap.add_argument("--p-segments", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.rates = args.rates or (["100mbit", "unlimited"] if args.quick else list(RATES))
    for r in args.rates:
        rate_bits(r)
    args.models = args.models or (["vgg"] if args.quick else sorted(MODELS))
    args.strategies = args.strategies or list(STRATEGIES_QUICK if args.quick
                                              else STRATEGIES_FULL)
    args.models = [m for m in args.models if m != "none"]
    args.strategies = [s for s in args.strategies if s != "none"]
    bad = [m for m in args.models if m not in MODELS]
    if bad:
        ap.error(f"--models {bad}: expected names of {sorted(MODELS)} or none")
    args.rounds = args.rounds or (2 if args.quick else 5)
    args.steps = args.steps or (3 if args.quick else 5)
    return args


def main(argv=None):
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--pin-exec"]:     # a rank of another program, pinned as the bench's
        _pin()
        os.execv(argv[1], argv[1:])
    args = parse_args(argv)
    if args.worker:
        worker(args)
    else:
        driver(args)


if __name__ == "__main__":
    main()
