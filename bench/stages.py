"""Bytes per rank per step of Stanza's layer separation ``ls`` vs ``d`` and a
parameter server, against Stanza's analytic model (§6, Fig. 6b/6c); and the
``ls``/``d`` step-time ratio measured interleaved.

Bytes (any world size, no collectives): ``python bench/stages.py``. For
VGG16 (32x32, 10 classes) and the SplitBrain VGG at 4 ranks (n_c=3 CONV
workers, n_f=1 FC worker, K rows per CONV worker) it prints, per rank and
step, the bytes ``ls`` issues (read from the shapes of the tensors
``tfhybrid.transformer.layer_separation`` moves: activations, errors,
predictions, gradient rings), Stanza's analytic FC data (each CONV worker
sends A K values and its FC worker sends back n_c/n_f A K, Eq. 3) and total
data (FC data + the CONV workers' parameter sync), ``d`` (a ring all-reduce
of all parameters: 2 (p-1)/p P per rank) and a parameter server (Eq. 6:
each worker sends P, the n_s servers send n_w P / n_s), and the ratios.

Counted (``horovodrun -np 4 --gloo .venv/bin/python bench/stages.py --count
--k 4``): one eager ``ls`` step of the SplitBrain VGG with the alltoalls and
gradient all-reduces wrapped, each rank's rows sent to other ranks and ring
bytes summed and compared with ``step_bytes`` (the numbers above).

Timing (``horovodrun -np 4 --gloo .venv/bin/python bench/stages.py --measure``):
a small SplitBrain-like VGG trained with ``d`` and ``ls`` (fc_workers=1) on
the same global batch, one ``train_on_batch`` step each, interleaved round by round;
the median over rounds of the per-step time averaged over the ranks, and the
ratio ls/d.

Pipeline (``horovodrun -np 4 --gloo .venv/bin/python bench/stages.py --pipeline
--batch 32``): the same small VGG as ``p`` with one stage per rank and
M = 1, 2, 4, 8 micro-batches beside ``d``, one step each interleaved round by
round (p/d ratio); then each rank times its stage alone (forward+backward of
its M micro-batches, no communication): the bubble fraction measured is
1 - busy / step time (mean over stages), printed beside GPipe's
(S-1)/(M+S-1) (which assumes balanced stages, free transfers and one core
per rank: where ranks outnumber cores their compute does not overlap, so the
measured fraction is not the schedule's alone).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

D = 4   # bytes per float32


def stanza_bytes(p_c, p_f, a, k, n_c, n_f):
    """Stanza's analytic bytes per rank per step (float32)."""
    fc_data_conv = a * k * D                  # activations up
    fc_data_fc = n_c / n_f * a * k * D        # errors down
    sync = 2 * (n_c - 1) / n_c * p_c * D      # CONV parameter sync (ring)
    fc_sync = 2 * (n_f - 1) / n_f * p_f * D
    return {"CONV": {"fc_data": fc_data_conv, "total": fc_data_conv + sync},
            "FC": {"fc_data": fc_data_fc, "total": fc_data_fc + fc_sync},
            "fc_data_all": n_c * fc_data_conv + n_f * fc_data_fc,
            "total_all": n_c * (fc_data_conv + sync) + n_f * (fc_data_fc + fc_sync)}


def bytes_table(name, model, p, k):
    from tfhybrid.transformer.layer_separation import step_bytes
    n_f = 1
    n_c = p - n_f
    got = step_bytes(model, n_c, n_f, k)
    pc, pf, a = got["params"]["conv"], got["params"]["fc"], got["params"]["cut_items"]
    want = stanza_bytes(pc, pf, a, k, n_c, n_f)
    P = pc + pf
    d_rank = 2 * (p - 1) / p * P * D
    ps_worker, ps_server = P * D, n_c * P * D / n_f
    print(f"\n{name}: P={P} (CONV {pc}, FC {pf}), cut A={a} values/row, p={p}, "
          f"n_c={n_c}, n_f={n_f}, K={k} rows per CONV worker (global batch {k * n_c})")
    print(f"{'':28s}{'issued (ls)':>14s}{'Stanza':>14s}{'ratio':>8s}")
    conv_fc = got["CONV"]["activations"]
    fc_fc = got["FC"]["errors"]
    rows = [("CONV fc data", conv_fc, want["CONV"]["fc_data"]),
            ("FC fc data", fc_fc, want["FC"]["fc_data"]),
            ("CONV total", got["CONV"]["total"], want["CONV"]["total"]),
            ("FC total (+predictions)", got["FC"]["total"], want["FC"]["total"]),
            ("all ranks fc data", n_c * conv_fc + n_f * fc_fc, want["fc_data_all"]),
            ("all ranks total", n_c * got["CONV"]["total"] + n_f * got["FC"]["total"],
             want["total_all"])]
    for label, g, w in rows:
        print(f"  {label:26s}{g / 1e6:12.3f}MB{w / 1e6:12.3f}MB{g / w:8.3f}")
    ls_max = max(got["CONV"]["total"], got["FC"]["total"])
    print(f"  per-rank max: ls {ls_max / 1e6:.3f} MB, d {d_rank / 1e6:.3f} MB, "
          f"PS worker {ps_worker / 1e6:.3f} MB / server {ps_server / 1e6:.3f} MB")
    print(f"  all ranks: ls {(n_c * got['CONV']['total'] + n_f * got['FC']['total']) / 1e6:.3f}"
          f" MB, d {p * d_rank / 1e6:.3f} MB, PS {(n_c * ps_worker + n_f * ps_server) / 1e6:.3f}"
          f" MB; ls/d {(n_c * got['CONV']['total'] + n_f * got['FC']['total']) / (p * d_rank):.3f}")


def small_vgg(keras):
    L = keras.layers
    return keras.Sequential([
        keras.Input((16, 16, 3)),
        L.Conv2D(8, 3, padding="same", activation="relu", name="conv0"),
        L.MaxPooling2D(2, name="pool0"),
        L.Conv2D(16, 3, padding="same", activation="relu", name="conv1"),
        L.MaxPooling2D(2, name="pool1"),
        L.Flatten(name="flatten"),
        L.Dense(256, activation="relu", name="fc0"),
        L.Dense(256, activation="relu", name="fc1"),
        L.Dense(10, name="fc2")], name="small_vgg")


def time_ratio(rounds, batch):
    import keras
    import numpy as np
    import tensorflow as tf
    import tfhybrid
    from tfhybrid.comm import backend
    tfhybrid.init()
    p = backend.size()
    keras.utils.set_random_seed(1)
    base = small_vgg(keras)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((batch * 2, 16, 16, 3)).astype("float32")
    y = rng.integers(0, 10, batch * 2)
    runs = {}
    for strat, opts in (("d", {}), ("ls", {"fc_workers": 1})):
        m = tfhybrid.transform(base, strat, **opts)
        m.compile(tfhybrid.DistributedOptimizer(keras.optimizers.SGD(0.01)),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        xl, yl = tfhybrid.data.shard((x, y), model=m, batch_size=batch)
        lb = tfhybrid.data.local_batch_size(batch, m)
        m.fit(xl, yl, batch_size=lb, epochs=1, shuffle=False, verbose=0)   # trace
        runs[strat] = (m, xl[:lb], yl[:lb])
    times = {s: [] for s in runs}
    world = tuple(range(p))
    for _ in range(rounds):
        for s, (m, xb, yb) in runs.items():
            backend.barrier()
            t0 = time.perf_counter()
            m.train_on_batch(xb, yb)
            dt = time.perf_counter() - t0
            slow = backend.allreduce(tf.constant([dt]), world, f"bench.t.{s}").numpy()
            times[s].append(float(slow[0]) / p)   # mean over ranks
    if backend.rank() == 0:
        med = {s: statistics.median(v) for s, v in times.items()}
        print(f"\nstep time (small VGG 16x16, global batch {batch}, p={p}, {rounds} interleaved "
              f"rounds, median of the rank mean): d {med['d'] * 1e3:.1f} ms, ls "
              f"{med['ls'] * 1e3:.1f} ms, ls/d {med['ls'] / med['d']:.2f}")


def count_bytes(k):
    """Bytes each rank's collectives actually carry in one eager ``ls`` step of the
    SplitBrain VGG (horovodrun): alltoall rows sent to other ranks, gradient
    all-reduces as Horovod rings (2 (n-1)/n x payload); compared with step_bytes."""
    import keras
    import numpy as np
    import tensorflow as tf
    import tfhybrid
    from tfhybrid.comm import backend
    from tfhybrid.oracle.models import splitbrain_vgg
    from tfhybrid.transformer import layer_separation as lsm
    tfhybrid.init()
    p, me = backend.size(), backend.rank()
    sent = {"p2p": 0.0, "gradients": 0.0}
    real_a2a, real_gar = backend.alltoall, backend.grouped_allreduce

    def a2a(x, splits, ranks, name, **kw):
        splits_np = np.asarray(splits)
        row = int(np.prod(x.shape[1:])) * x.dtype.size
        sent["p2p"] += sum(int(n) for i, n in enumerate(splits_np) if ranks[i] != me) * row
        return real_a2a(x, splits, ranks, name, **kw)

    def gar(tensors, ranks, name, **kw):
        n = len(ranks)
        sent["gradients"] += 2 * (n - 1) / n * sum(int(np.prod(t.shape)) * 4 for t in tensors)
        return real_gar(tensors, ranks, name, **kw)

    backend.alltoall, backend.grouped_allreduce = a2a, gar
    keras.utils.set_random_seed(1)
    m = tfhybrid.transform(splitbrain_vgg(10), "ls", fc_workers=1)
    m.compile(keras.optimizers.SGD(0.01), loss="sparse_categorical_crossentropy",
              run_eagerly=True)
    n_c = m.n_c
    rng = np.random.default_rng(0)
    x = rng.standard_normal((k * n_c, 32, 32, 3)).astype("float32")
    y = rng.integers(0, 10, k * n_c)
    xl, yl = tfhybrid.data.shard((x, y), model=m, batch_size=k * n_c)
    m.train_on_batch(xl, yl)
    want = lsm.step_bytes(m, m.n_c, m.n_f, k)[m.role]
    w_p2p = want["activations"] + want["errors"] + want["predictions"]
    rows = backend.allgather(tf.constant([[sent["p2p"], w_p2p, sent["gradients"],
                                           want["gradients"]]], tf.float64),
                             tuple(range(p)), "bench.bytes").numpy()
    if me == 0:
        print(f"\ncounted in one eager ls step, SplitBrain VGG, p={p}, K={k} (bytes sent by rank):")
        for r, (a, b, c, d) in enumerate(rows):
            role = "FC" if r >= n_c else "CONV"
            print(f"  rank {r} {role:4s} p2p {a / 1e6:.3f} MB (step_bytes {b / 1e6:.3f}, ratio "
                  f"{a / b:.3f}); gradients {c / 1e6:.3f} MB (step_bytes {d / 1e6:.3f})")


def _stage_busy(m, lb, rounds):
    """Seconds this rank's stage of pipeline model ``m`` computes per step alone: forward
    and backward of its M micro-batches of ``lb / M`` rows, no communication (median)."""
    import tensorflow as tf
    spec = m.spec
    shape, dtype = spec.boundaries[spec.stage]
    rows = lb // spec.micro_batches
    ins = [tf.random.normal((rows,) + tuple(shape)) for _ in range(spec.micro_batches)]
    variables = m.stage.trainable_variables

    @tf.function
    def step():
        total = []
        for a in ins:
            with tf.GradientTape() as tape:
                tape.watch(a)
                out = m.stage(a, training=True)
                loss = tf.reduce_sum(out)
            total.append(tape.gradient(loss, variables + [a]))
        return total

    step()
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def pipeline_ratio(rounds, batch, micro):
    """p (one stage per rank, M micro-batches) vs d: step times measured interleaved,
    and the bubble fraction measured against GPipe's (S-1)/(M+S-1)."""
    import keras
    import numpy as np
    import tensorflow as tf
    import tfhybrid
    from tfhybrid.comm import backend
    tfhybrid.init()
    S = backend.size()
    tfhybrid.shutdown()
    tfhybrid.init(model_parallel=S)       # one pipeline of S stages; d over all ranks
    keras.utils.set_random_seed(1)
    base = small_vgg(keras)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((batch * 2, 16, 16, 3)).astype("float32")
    y = rng.integers(0, 10, batch * 2)
    runs = {}
    for label, strat, opts in [("d", "d", {})] + [(f"p M={m}", "p", {"micro_batches": m})
                                                  for m in micro]:
        m = tfhybrid.transform(base, strat, **opts)
        m.compile(tfhybrid.DistributedOptimizer(keras.optimizers.SGD(0.01)),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        xl, yl = tfhybrid.data.shard((x, y), model=m, batch_size=batch)
        lb = tfhybrid.data.local_batch_size(batch, m)
        m.fit(xl, yl, batch_size=lb, epochs=1, shuffle=False, verbose=0)   # trace
        runs[label] = (m, xl[:lb], yl[:lb], lb)
    times = {s: [] for s in runs}
    world = tuple(range(S))
    for _ in range(rounds):
        for s, (m, xb, yb, _) in runs.items():
            backend.barrier()
            t0 = time.perf_counter()
            m.train_on_batch(xb, yb)
            dt = time.perf_counter() - t0
            slow = backend.allreduce(tf.constant([dt]), world, f"bench.pt.{s}").numpy()
            times[s].append(float(slow[0]) / S)   # mean over ranks
    med = {s: statistics.median(v) for s, v in times.items()}
    busy = {}
    for s, (m, _, _, lb) in runs.items():
        if s != "d":
            mine = _stage_busy(m, lb, rounds)
            busy[s] = float(backend.allreduce(tf.constant([mine]), world,
                                              f"bench.busy.{s}").numpy()[0]) / S
    if backend.rank() == 0:
        print(f"\np vs d (small VGG 16x16, global batch {batch}, {S} stages on {S} ranks, "
              f"{rounds} interleaved rounds, median of the rank mean; stages "
              f"{[list(st) for st in runs[next(iter(busy))][0].spec.plan.stages]}):")
        print(f"  d: {med['d'] * 1e3:.1f} ms")
        for s in busy:
            M = runs[s][0].micro_batches
            measured = 1.0 - busy[s] / med[s]
            gpipe = (S - 1) / (M + S - 1)
            print(f"  {s}: {med[s] * 1e3:.1f} ms, p/d {med[s] / med['d']:.2f}; stage busy "
                  f"{busy[s] * 1e3:.1f} ms (mean over stages) -> bubble {measured:.2f} measured "
                  f"vs (S-1)/(M+S-1) = {gpipe:.2f}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--p", type=int, default=4)
    ap.add_argument("--k", type=int, default=32, help="rows per CONV worker")
    ap.add_argument("--measure", action="store_true", help="measure ls/d (under horovodrun)")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--batch", type=int, default=24)
    ap.add_argument("--pipeline", action="store_true",
                    help="measure p/d and the pipeline bubble (under horovodrun)")
    ap.add_argument("--micro", type=int, nargs="+", default=[1, 2, 4, 8],
                    help="micro-batch counts for --pipeline")
    ap.add_argument("--count", action="store_true",
                    help="count the bytes of one eager ls step (under horovodrun)")
    args = ap.parse_args()
    if args.count:
        count_bytes(args.k)
        return
    if args.measure:
        time_ratio(args.rounds, args.batch)
        return
    if args.pipeline:
        pipeline_ratio(args.rounds, args.batch, args.micro)
        return
    import keras
    from tfhybrid.oracle.models import splitbrain_vgg
    vgg = keras.applications.VGG16(weights=None, input_shape=(32, 32, 3), classes=10)
    bytes_table("VGG16 32x32x3, 10 classes", vgg, args.p, args.k)
    bytes_table("SplitBrain VGG", splitbrain_vgg(10), args.p, args.k)


if __name__ == "__main__":
    main()
