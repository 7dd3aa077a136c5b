"""Calibrate a :class:`~tfhybrid.oracle.machine.Machine` on the machine it runs on.

Run under the launcher on every rank::

    horovodrun -np 4 --gloo .venv/bin/tfhybrid calibrate -o machine.json

What it measures (rank 0 writes the file):

1. alpha/beta: Horovod allreduce, allgather and alltoall (through
   :mod:`tfhybrid.comm.backend`, on process sets of g consecutive ranks, all
   such groups at once, for g = 2, 4, ..., N) over a range of message sizes, each timed as a traced
   chain of dependent collectives (what a step's layers run); for each group size a
   least-squares fit (each timing weighted by 1/sqrt(seconds)) of the ring cost models of
   :mod:`machine` gives one tier ``{max_ranks: g, latency, alpha, beta}``, and
   each kind's own fit its ``collectives[kind]`` ({latency, beta, burst_bytes}:
   the kinds move bytes at different rates, and a link may carry a lone
   collective's first bytes free, :func:`fit_burst`; p2p also its
   ``stream_latency``); the largest group gives the top-level numbers.
2. flop_rate: a Dense forward+backward of known FLOPs, timed on rank 0 alone
   while the other ranks wait; the oracle scales compute by
   ranks on the node / ``compute_slots`` (usable cores / intra-op threads).
3. layer_times and compute_fixed_s (optional ``--model``): the whole
   model's forward and backward times at the local batch and at local batch
   x world, fitted as ``fixed + batch x slope``; the slope is split over the
   layers in proportion to each layer's own forward/backward time (every
   layer timed alone at the largest batch: pooling and activations cost far
   more than their FLOPs, and f/c/s keep them replicated), falling back to
   FLOPs when a layer cannot be timed alone; the intercept is the
   batch-independent cost per iteration (rank 0 alone, as 2).
4. step_overhead_s: the cost of one Keras ``train_on_batch`` of a 1-unit model;
   with ``--model``, at least what the model's ``train_on_batch`` costs beyond
   its forward+backward (loss, weight update, Keras' step machinery).
5. gamma (with ``--model``): peak RSS growth of training the model divided by
   the naive serial memory estimate (ParaDL's memory reuse factor).
6. compute_contention (with ``--model`` on N > 1 ranks; median of five
   estimates): the best block of 8 back-to-back forward+backward passes
   then a 1-item world allreduce on every rank, minus the allreduce alone,
   over rank 0's best block alone (calibrate_run.measure_contention; blocks
   rather than single passes, whose minima scatter more from run to run on
   an oversubscribed node); it replaces
   the ``compute_slots`` estimate for the ranks per node it was measured at.
   It is measured for 2, 4, ... ranks computing at once (the others
   waiting) up to the ranks on the node: a pipeline's or layer
   separation's stages take turns, so fewer ranks than the node holds
   share its cores.

The fitting functions are pure numpy and unit-tested without Horovod.
Approximations: one latency/bandwidth per group size (no small/large message
protocol switch), timings are minima of few repetitions, RSS is a coarse
proxy for tensor memory.

Example:
    >>> samples = [("allreduce", 2, m, 2 * (1e-5 + m / 2 * 1e-9)) for m in (1e3, 1e6)]
    >>> a, b, _ = fit_alpha_beta(samples)
    >>> round(a, 8), round(b, 12)
    (1e-05, 1e-09)
"""
from __future__ import annotations

import os
import statistics
import time

import numpy as np

from tfhybrid.oracle.machine import Tier

COLLECTIVE_KINDS = ("allreduce", "allgather", "alltoall", "p2p")


def design_row(kind: str, p: int, nbytes: float) -> tuple:
    """Coefficients (of alpha, of beta) of one collective's ring cost.

    allreduce of m bytes: 2(p-1), 2(p-1)m/p; allgather of m bytes per rank:
    (p-1), (p-1)m; alltoall of m bytes per rank: (p-1), (p-1)m/p; p2p, m bytes
    one way: 1, m.
    """
    if kind == "allreduce":
        return 2 * (p - 1), 2 * (p - 1) * nbytes / p
    if kind == "allgather":
        return p - 1, (p - 1) * nbytes
    if kind == "alltoall":
        return p - 1, (p - 1) * nbytes / p
    if kind == "p2p":
        return 1, nbytes
    raise ValueError(f"Received kind={kind!r}; expected one of {COLLECTIVE_KINDS}.")


def fit_alpha_beta(samples) -> tuple:
    """Non-negative least squares of (alpha, beta) from (kind, p, bytes, seconds).

    Returns:
        (alpha, beta, r2) with r2 the coefficient of determination.

    Raises:
        ValueError: fewer than two samples.
    """
    _, alpha, beta, r2 = _fit(samples, latency=False)
    return alpha, beta, r2


def fit_collective_costs(samples) -> tuple:
    """Non-negative least squares of (latency, alpha, beta): each collective
    costs ``latency`` once plus its ring cost (:func:`design_row`).

    Returns:
        (latency, alpha, beta, r2).

    Raises:
        ValueError: fewer than three samples.

    Example:
        >>> rows = [(k, 2, m, 1e-3 + design_row(k, 2, m)[0] * 1e-4
        ...          + design_row(k, 2, m)[1] * 1e-9)
        ...         for k in COLLECTIVE_KINDS for m in (1e3, 1e6)]
        >>> [round(v, 10) for v in fit_collective_costs(rows)[:3]]
        [0.001, 0.0001, 1e-09]
    """
    return _fit(samples, latency=True)


def _fit(samples, latency):
    samples = list(samples)
    need = 3 if latency else 2
    if len(samples) < need:
        raise ValueError(f"Need at least {need} timing samples to fit "
                         f"{'latency, ' if latency else ''}alpha and beta; "
                         f"received {len(samples)}.")
    A = np.array([((1.0,) if latency else ()) + design_row(k, p, m)
                  for k, p, m, _ in samples], dtype=float)
    t = np.array([s for *_, s in samples], dtype=float)
    sol = _weighted_nnls(A, t)
    lat = float(sol[0]) if latency else 0.0
    return lat, float(sol[-2]), float(sol[-1]), _r2(A, t, sol)


def _weighted_nnls(A, t):
    """Non-negative least squares of (A x - t) / sqrt(t): each timing weighted by
    the inverse of its variance, taken proportional to its duration.

    Sizes span three decades. Plain least squares lets the largest messages
    set both numbers and leaves the small messages' fixed cost (what a step of
    many small collectives pays) to chance; relative errors (weights 1/t) let
    the few-millisecond timings, which scatter by tens of percent from run to
    run, tilt the bandwidth by 10% or more."""
    w = 1.0 / np.sqrt(np.maximum(t, 1e-12))
    return _nnls(A * w[:, None], t * w)


def _r2(A, t, sol):
    ss = float(((t - t.mean()) ** 2).sum())
    return 1.0 - float(((t - A @ sol) ** 2).sum()) / ss if ss > 0 else 1.0


def fit_kind_costs(samples) -> dict:
    """Per collective kind: (latency, beta, burst_bytes) of that kind's own
    timings, alpha 0 (:func:`fit_burst`).

    All samples must be of one group size (a tier): there the per-message
    alpha and the per-collective latency cannot be told apart, so the
    intercept is the latency. A kind timed at fewer than two sizes is
    left out (the tier's common fit serves it).

    ``p2p`` also gets ``stream_latency`` (:func:`stream_latency`): what a
    transfer that follows another on the link pays beside its bytes.

    Returns:
        ``{kind: {"latency": s, "alpha": 0.0, "beta": s/B, "burst_bytes": B}}``.

    Example:
        >>> rows = [("allgather", 2, m, 2e-3 + m * 3e-9) for m in (1e3, 1e5, 1e6)]
        >>> {k: [round(v, 12) for v in c.values()] for k, c in fit_kind_costs(rows).items()}
        {'allgather': [0.002, 0.0, 3e-09, 0.0]}
    """
    samples = list(samples)
    if len({p for _, p, _, _ in samples}) > 1:
        raise ValueError("fit_kind_costs fits one group size; received samples of group sizes "
                         f"{sorted({p for _, p, _, _ in samples})}.")
    out = {}
    for kind in COLLECTIVE_KINDS:
        rows = [s for s in samples if s[0] == kind]
        if len({m for _, _, m, _ in rows}) < 2:
            continue
        lat, beta, burst = fit_burst([design_row(k, p, m)[1] for k, p, m, _ in rows],
                                     [s for *_, s in rows])
        out[kind] = {"latency": lat, "alpha": 0.0, "beta": beta, "burst_bytes": burst}
        if kind == "p2p":
            out[kind]["stream_latency"] = stream_latency(rows, beta)
    return out


def fit_burst(sent, seconds) -> tuple:
    """(latency, beta, burst) of ``t = latency + beta max(sent - burst, 0)``, least
    squares weighted as :func:`_weighted_nnls`, ``burst`` one of 0 and the sizes
    timed below the two largest (the fit needs two sizes beyond it for beta).

    ``sent``: the bytes one rank sends in each timed collective. A link that lets
    a burst through at once carries the first bytes of a collective at no cost
    when it was idle before: between two test hosts shaped to 100 Mbit/s every
    kind took 1.2-1.3 ms from 4 to 30 KB, then 80 ns a byte. A line through
    every size then has an intercept of about 0 and charges the small ones the
    bytes they do not pay (a halo of 16 KB: 1.3 ms, not 2.6); on a link without
    a burst the fit keeps ``burst`` 0 and is the plain line.

    Example:
        >>> sent = [4e3, 1e4, 3e4, 8e4, 2e5, 6e5, 1.6e6, 4e6]
        >>> t = [1.2e-3 + 8e-8 * max(n - 3e4, 0) for n in sent]
        >>> lat, beta, burst = fit_burst(sent, t)
        >>> round(lat, 6), round(beta, 10), burst
        (0.0012, 8e-08, 30000.0)
    """
    x, t = np.asarray(sent, float), np.asarray(seconds, float)
    if len(x) != len(t) or len(set(x.tolist())) < 2:
        raise ValueError(f"fit_burst needs as many sizes as times, at least two sizes; "
                         f"received {len(x)} sizes and {len(t)} times.")
    w = 1.0 / np.sqrt(np.maximum(t, 1e-12))
    best = None
    for burst in [0.0, *sorted(set(x.tolist()))[:-2]]:
        A = np.stack([np.ones_like(x), np.maximum(x - burst, 0.0)], axis=1)
        sol = _weighted_nnls(A, t)
        err = float((((A @ sol - t) * w) ** 2).sum())
        if best is None or err < best[0] * 0.99 - 1e-24:   # a burst only where it fits better
            best = (err, float(sol[0]), float(sol[1]), float(burst))
    return best[1:]


def stream_latency(rows, beta):
    """The fixed cost of a transfer that follows another on the link: the
    smallest message's time less its bytes at ``beta`` (at least 0).

    Calibration times transfers alone on an idle link. A link that lets a
    burst through at once carries a small one's bytes free (between two test
    hosts shaped to 100 Mbit/s, 4 to 30 KB p2p transfers all took 1.2 ms, 80 KB
    5.1), and its time is the fixed cost alone, which also covers the wait for
    Horovod's next cycle. A pipeline's transfers follow one another: each pays
    all its bytes, and its fixed cost overlaps the transfer before it (32
    micro-batches of 32 KB paid 0.9 ms each beyond their bytes, where one alone
    took 1.2). Without a burst the smallest message's time is the line's
    intercept plus its bytes, and this is that intercept.

    Example:
        >>> rows = [("p2p", 2, 4096, 1.2e-3), ("p2p", 2, 4e6, 0.33)]
        >>> round(stream_latency(rows, 8e-8), 6)
        0.000872
    """
    _, p, m, t = min(rows, key=lambda r: r[2])
    return float(max(0.0, t - design_row("p2p", p, m)[1] * beta))


def _nnls(A, t):
    """argmin |A x - t| with x >= 0, by least squares on every subset of columns
    (A has 2 or 3 columns); columns are scaled to unit norm first."""
    import itertools  # noqa: WPS433
    norms = np.linalg.norm(A, axis=0)
    norms[norms == 0] = 1.0
    B = A / norms
    best_err, best = float("inf"), np.zeros(A.shape[1])
    for k in range(A.shape[1], 0, -1):
        for cols in itertools.combinations(range(A.shape[1]), k):
            x = np.zeros(A.shape[1])
            x[list(cols)] = np.linalg.lstsq(B[:, cols], t, rcond=None)[0]
            err = float(((B @ x - t) ** 2).sum())
            if (x >= 0).all() and err < best_err:
                best_err, best = err, x
    return best / norms


def fit_tiers(samples) -> list:
    """One :class:`Tier` per group size in the samples (sorted): latency, alpha and
    beta common to every kind, and each kind's own in ``collectives``
    (:func:`fit_kind_costs`)."""
    tiers = []
    for g in sorted({p for _, p, _, _ in samples}):
        group = [s for s in samples if s[1] == g]
        lat, a, b, _ = fit_collective_costs(group)
        tiers.append(Tier(max_ranks=g, alpha=a, beta=b, latency=lat,
                          collectives=fit_kind_costs(group) or None))
    return tiers


def fit_line(xs, ys) -> tuple:
    """Least-squares ``y = a + b x`` with a, b >= 0; one point gives (0, y/x).

    Example:
        >>> [round(v, 6) for v in fit_line([1, 3], [3.0, 7.0])]
        [1.0, 2.0]
    """
    xs, ys = np.asarray(xs, float), np.asarray(ys, float)
    if len(xs) != len(ys) or not len(xs):
        raise ValueError(f"fit_line needs as many x as y values, at least one; received "
                         f"{len(xs)} and {len(ys)}.")
    if len(set(xs.tolist())) < 2:
        return 0.0, float(ys.mean() / xs.mean())
    a, b = _nnls(np.stack([np.ones_like(xs), xs], axis=1), ys)
    return float(a), float(b)


def estimate_gamma(measured_bytes: float, naive_bytes: float) -> float:
    """ParaDL's memory reuse factor: measured / naive (ValueError if naive <= 0)."""
    if naive_bytes <= 0:
        raise ValueError(f"Received naive_bytes={naive_bytes!r}; expected a positive estimate.")
    return max(measured_bytes, 0.0) / naive_bytes


def compute_slots() -> int:
    """Ranks that can compute at once on this node: usable cores / intra-op threads."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 1
    threads = int(os.environ.get("TF_NUM_INTRAOP_THREADS", "0") or 0) or cores
    return max(1, cores // max(1, threads))


def _best_time(fn, reps):
    """Minimum seconds of ``reps`` calls after one warm-up call.

    The minimum, not the median: on a shared machine it is the reproducible
    figure (the machine without external load), and ParaDL also reports the
    best times measured. Benchmarks compared with predictions must use it too.
    """
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def trimmed_mean(times):
    """Mean of ``times`` without the fastest and slowest fifth (at least one
    each from five samples on): what a step pays on average for a collective
    whose time spreads, without one outlier of the shared machine.

    Example:
        >>> trimmed_mean([1.0, 2.0, 3.0, 4.0, 100.0])
        3.0
    """
    ordered = sorted(times)
    if not ordered:
        raise ValueError("trimmed_mean of no times: expected at least one.")
    cut = len(ordered) // 5
    kept = ordered[cut:len(ordered) - cut]
    return sum(kept) / len(kept)


STATS = {"best": min, "median": statistics.median, "mean": trimmed_mean}


def stat_function(stat):
    """The function of :data:`STATS` named ``stat`` (a list of seconds -> seconds).

    Raises:
        ValueError: ``stat`` is not one of them.
    """
    if stat not in STATS:
        raise ValueError(f"stat={stat!r}: expected one of {sorted(STATS)}")
    return STATS[stat]


def times_interleaved(fns, reps, before=None, stat="best"):
    """Seconds of each of ``fns`` (the ``stat`` of its times: by default the
    minimum) over ``reps`` rounds in which every function runs once in turn
    (after one warm-up call each): outside load that comes and goes hits every
    function alike, so their ratios and differences hold even when the
    absolute times drift.

    ``stat="median"`` keeps each function's median instead, ``stat="mean"``
    its mean without the fastest and slowest fifth (:func:`trimmed_mean`):
    over a real link a collective's time spreads with the network (TCP, the
    link's queue, where Horovod's cycle falls), and a step pays the typical
    time of each of its collectives, not the best. Where the times fall in
    two groups (a small message that catches Horovod's cycle or misses it),
    the median lands on either, the mean between them, as many steps average.

    Example:
        >>> [t >= 0 for t in times_interleaved([lambda: None, lambda: 1], 2)]
        [True, True]
    """
    pick = stat_function(stat)
    for fn in fns:
        fn()
    times = [[] for _ in fns]
    for _ in range(reps):
        for i, fn in enumerate(fns):
            if before is not None:
                before()
            t0 = time.perf_counter()
            fn()
            times[i].append(time.perf_counter() - t0)
    return [pick(t) for t in times]


def _collective(kind, x, ranks, backend, n, step=0):
    """One collective of the ``n`` items of ``x`` whose output has ``n`` items
    again (allgather: the first block of the result).

    Each kind, group size and message size has its own name, as each
    collective of a training step has: Horovod's response cache then skips
    the negotiation from the second call on, as it does from a step's second
    call. One name for every size would make each call a cache miss, costing
    a small allreduce several times its steady-state time on an
    oversubscribed node, and the oracle would then predict strategies with
    many small collectives (df, gmp) far too slow.
    """
    tag = f"{len(ranks)}.{n}"
    if kind == "p2p":
        return _one_way(x, ranks, backend, n, f"calib.p2p.{tag}.{step % 2}", step % 2)
    if kind == "allreduce":
        return backend.allreduce(x, ranks, f"calib.ar.{tag}")
    if kind == "allgather":
        return backend.allgather(x, ranks, f"calib.ag.{tag}")[:n]
    return backend.alltoall(x, [n // len(ranks)] * len(ranks), ranks, f"calib.a2a.{tag}")


def _one_way(x, ranks, backend, n, name, src=0):
    """Group rank ``src`` of a pair sends its ``n`` items to the other, which gets them
    as its result (the sender: zeros computed from ``x``): a pipeline's or layer
    separation's transfer, one direction of the link loaded. An alltoall with empty
    splits elsewhere, as tfhybrid sends such transfers. A chain alternates ``src``
    (:func:`collective_chain`), so each transfer starts once the previous one has
    arrived, and the time counts its delivery, not only the sender's copy into its
    socket buffers."""
    import tensorflow as tf  # noqa: WPS433
    me = backend.rank()
    sender = me == ranks[src]
    splits = [0] * len(ranks)
    if sender:
        splits[1 - src] = n
    out = backend.alltoall(x if sender else x[:0], splits, ranks, name)
    if me == ranks[1 - src]:
        return out
    return backend.zeros_reading(x) + tf.reduce_sum(out)


def collective_chain(kind, ranks, backend, chain, n):
    """A traced function running ``chain`` dependent collectives of one kind.

    Each takes the previous one's output, as a forward pass feeds one
    layer's collective into the next: what a step pays per collective
    (graph dispatch, Horovod's negotiation and the transfer, one after the
    other), which eager calls one at a time do not show.
    """
    import tensorflow as tf  # noqa: WPS433

    @tf.function(input_signature=[tf.TensorSpec([n], tf.float32)])
    def run(x):
        for step in range(chain):
            x = tf.ensure_shape(_collective(kind, x, ranks, backend, n, step), [n])
        return x
    return run


def sync(backend):
    """Barrier over the world as a 1-item allreduce (backend.barrier calls
    ``hvd.barrier``, which horovod.tensorflow 0.28.1 does not export)."""
    import tensorflow as tf  # noqa: WPS433
    if backend.size() > 1:
        backend.allreduce(tf.zeros([1]), tuple(range(backend.size())), "calib.sync").numpy()


def chain_length(kind, group, local_size, chain=4):
    """Collectives per timed chain: ``chain`` for a group inside one node, 1 for one
    that spans nodes (2 for ``p2p``: there and back, so the time counts delivery).

    Inside a node a chain of dependent collectives shows what a step pays per
    collective (graph dispatch and Horovod's negotiation, one after the other).
    Across a link each is timed alone after a sync, as a step issues its
    collectives with compute between them (with stock Gloo a chain of allgathers
    also paid its two directions taking turns, 1.3-1.5 times one alone between two
    test hosts at 100 Mbit/s; patches/horovod/0101-gloo-receive-before-send.patch).

    Example:
        >>> [chain_length(k, 2, 2) for k in ("allgather", "p2p")]
        [4, 4]
        >>> [chain_length(k, 2, 1) for k in ("allgather", "p2p")]
        [1, 2]
    """
    if group <= max(local_size, 1):
        return chain
    return 2 if kind == "p2p" else 1


def time_collectives(sizes, group_sizes, reps=5, log=print, chain=4, stat="best") -> list:
    """(kind, g, bytes, seconds) for every kind, group size and message size (rank 0's view).

    Seconds are per collective: the ``stat`` (best, median or trimmed mean,
    :data:`STATS`) of ``reps`` runs of a traced chain of dependent collectives
    (:func:`collective_chain`; ``chain`` of them inside a node, one across nodes:
    :func:`chain_length`; a shorter chain is repeated more, so that as many
    collectives are timed), divided by its length; one message size after the
    other, from the smallest, the kinds of each size interleaved.
    Groups smaller than the world run side by side, one per block of g
    consecutive ranks (as a hybrid strategy's model groups all communicate at
    once), so their timings include that contention.
    Collective: every rank must call it with the same arguments.
    """
    from tfhybrid.comm import backend  # noqa: WPS433

    world, me = backend.size(), backend.rank()
    local = backend.local_size()
    blocks = {g: [tuple(range(s, s + g)) for s in range(0, world - g + 1, g)]
              for g in group_sizes if 1 < g <= world}
    backend.register_groups([b for g, bs in blocks.items() if g < world for b in bs])
    samples = []
    for g in group_sizes:
        ranks = next((b for b in blocks.get(g, ()) if me in b), None)
        kinds = [k for k in COLLECTIVE_KINDS if k != "p2p" or g == 2]   # p2p: a pair's
        lengths = [chain_length(kind, g, local, chain) for kind in kinds]
        for nbytes in sizes:
            n = max(g, int(nbytes) // 4 // g * g)
            calls = [_chain_call(kind, ranks, backend, length, n)
                     for kind, length in zip(kinds, lengths)]
            # the kinds of one size in turn, round after round (the same order on
            # every rank): outside load that comes and goes hits all of them alike
            # instead of one kind's whole series. One size at a time: right after a
            # 4 MB collective a small one took 1.5-3x its time after small ones
            # (across two test hosts, each rank on one core), and a step's small
            # collectives follow small ones and compute.
            sync(backend)
            # as many collectives timed as chains of ``chain`` would: a lone collective's
            # time spreads more than a chain's mean over its links
            # (and more of the small ones: :func:`repetitions`)
            times = times_interleaved(
                calls, repetitions(nbytes, reps * max(1, chain // min(lengths))),
                before=lambda: sync(backend), stat=stat)
            samples += [(kind, g, 4 * n, sec / length)
                        for kind, sec, length in zip(kinds, times, lengths)]
        sync(backend)
        if backend.rank() == 0:
            log(f"  group {g}: {', '.join(kinds)} timed at {len(sizes)} sizes")
    return samples


SMALL_MESSAGE_BYTES = 64 << 10


def repetitions(nbytes, reps):
    """Timings of one size: ``reps``, times up to 8 for messages under
    :data:`SMALL_MESSAGE_BYTES` (4 KiB: 8x, 16 KiB: 4x, 32 KiB: 2x).

    A small collective takes about a millisecond, so ``reps`` of them span a few
    tens of milliseconds, and a disturbance that long moves their median (with a
    Gloo whose small collectives waited 2-8 ms one time in three,
    ``patches/horovod/0102-gloo-yield-to-busy-pair.patch``, a 4 KB alltoall's
    median of 20 read 4.8 ms in one calibration and 1.3 ms in another). The
    fixed costs and bursts the oracle fits come from these sizes, and halos and
    a pipeline's transfers are made of them; more timings cost little.

    Example:
        >>> [repetitions(n, 5) for n in (4096, 16384, 32768, 1 << 20)]
        [40, 20, 10, 5]
    """
    return reps * max(1, min(8, SMALL_MESSAGE_BYTES // max(int(nbytes), 1)))


def _chain_call(kind, ranks, backend, chain, n):
    """A call running one chain of ``kind`` on ``n`` items (:func:`collective_chain`);
    a no-op on a rank outside every group of this size (world not a multiple of
    it), which still joins the syncs between the timings."""
    if ranks is None:
        return lambda: None
    import tensorflow as tf  # noqa: WPS433
    x = tf.ones([n], tf.float32)
    run = collective_chain(kind, ranks, backend, chain, n)
    return lambda: run(x).numpy()
