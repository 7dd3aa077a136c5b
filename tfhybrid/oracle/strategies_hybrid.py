"""SplitBrain group model parallelism (``gmp``) and Stanza layer separation (``ls``).

``gmp`` (SplitBrain, Section 3): every layer before the first partitioned
Dense layer is data parallel over all p ranks (local batch b = B/p); from the
first partitioned Dense layer on, each model group of ``mp`` consecutive ranks
gathers its batches (ModuloLayer), runs partitioned Dense layers with 1/mp of
the units each, pairs adjacent ones filter -> channel as tfhybrid's
transformer does (one allreduce of the pair's output; the next pair's input
gradient is allreduced too), shards (allgathers) the outputs of unpaired
ones, and returns each rank its own rows before the loss (backward: an
allgather of the output gradient, unless the last layer is an unpaired
shard). Scheme ``"BK"`` (the default: what
``tfhybrid.transform`` builds) gathers all mp*b samples at once; ``"B/K"``
(SplitBrain's) runs mp micro-steps of b/mp samples per rank (activation
memory of b, mp times the latencies); ``"B"`` runs mp rounds in which one
rank broadcasts its b samples (binomial tree) and the region runs on them;
backward, the rows' gradient is summed to that rank (a direct reduce, the
root receiving mp-1 copies) and the outputs' gradient broadcast from it
(activation memory of b; each round's forward is recomputed in the
backward pass, so its forward collectives and FLOPs are charged twice;
"B/K"'s recomputation is not charged). Dense layers are partitioned when
their CCR in FLOPs per byte moved
(:func:`tfhybrid.oracle.formulas.splitbrain_ccr`, the function the transformer
uses) is at least ``ccr_threshold`` (default
:data:`tfhybrid.oracle.formulas.SPLITBRAIN_CCR_THRESHOLD`, 64) and ``mp`` divides their units; others stay replicated
inside the group (recorded in ``options``).

``ls`` (Stanza, Eq. 2-7): n_c CONV workers run the layers before the first
Dense layer data parallel with K = B/n_c samples each and send the last conv
activations to n_f FC workers, which run the Dense layers on n_c K / n_f
samples each and send the gradients back. n_f maximises throughput (Eq. 5)
by exhaustive search unless given. Priced as tfhybrid runs it: the CONV
workers, then the FC workers compute (each side waits for the other), so
each side is slowed only by its own ranks sharing the node's cores
(``machine.oversubscription(n_c)``, then ``(n_f)``); the activations and
their error are one alltoall each on the FC worker's group; the CONV
workers' gradients are one ring allreduce over the n_c CONV workers, and
the FC workers' allreduce counts only where it outlasts the error's
transfer, the CONV backward and the CONV allreduce that run meanwhile
(Stanza assumes it hidden and uses tree rounds).
``options['ps_baseline_s']`` is Stanza's parameter-server iteration (Eq. 6)
with n_c workers and n_f servers.

Example:
    >>> sorted(STRATEGIES_HYBRID)
    ['gmp', 'ls']
"""
from __future__ import annotations

import math

from tfhybrid.oracle import formulas
from tfhybrid.oracle.record import divisors
from tfhybrid.oracle.strategies import (STRATEGIES, _batch_reasons, _best, _result, pairs_of,
                                        split_shares, strategy)

STRATEGIES_HYBRID = {}


def _gmp_layers(ctx, mp, ccr_threshold):
    """(partitioned, kept) Dense row indices from the first Dense row on."""
    part, kept = [], []
    for i in range(ctx.first_dense(), len(ctx.rows)):
        r = ctx.rows[i]
        if r.kind != "dense":
            continue
        # float32 activations, as the layers transform builds move them: the
        # same function and threshold as the transformer, so the same layers.
        per_byte = formulas.splitbrain_ccr(r.channels, r.filters)
        if not formulas.splitbrain_partitions(per_byte, ccr_threshold):
            kept.append((r.name, f"CCR {per_byte:.3g} FLOP/B < threshold {ccr_threshold}"))
        elif r.filters % mp:
            kept.append((r.name, f"{r.filters} units not divisible by mp={mp}"))
        else:
            part.append(i)
    return part, kept


def _gmp_comm(ctx, p, mp, part, b, scheme):
    """Modulo gather, filter->channel pairs (allreduce) or shards (allgather), scatter."""
    if scheme == "B":
        return _gmp_comm_b(ctx, p, mp, part, b)
    m, d = ctx.m, ctx.delta
    steps = mp if scheme == "B/K" else 1
    piece = b / steps                      # samples each rank contributes per micro-step
    ag = ar = 0.0
    pairs = pairs_of(ctx, part, mp) if part else []
    paired = {i for ab in pairs for i in ab}
    if part:
        # the ModuloLayer: an allgather of each rank's rows; its adjoint a reduce-scatter
        # of the group's rows (an alltoall in tfhybrid: the same bytes, alltoall's cost)
        x0 = piece * ctx.rows[part[0]].x * d
        ag += steps * (m.t_allgather(mp, x0) + m.t_reducescatter(mp, mp * x0))
        for a, bb in pairs:
            ar += steps * m.t_allreduce(mp, mp * piece * ctx.rows[bb].y * d)
            if a != part[0]:
                ar += steps * m.t_allreduce(mp, mp * piece * ctx.rows[a].x * d)
        for i in (i for i in part if i not in paired):   # shards: the adjoint is a slice
            ag += steps * m.t_allgather(mp, piece * ctx.rows[i].y * d)
        # leaving the region each rank keeps its own rows (a slice); backward, the
        # gradient of the group's rows is all-gathered, unless the last layer is a
        # shard (its adjoint slice leaves the gradient partial: nothing to move)
        if not _ends_in_shard(ctx, part, paired):
            ag += steps * m.t_allgather(mp, piece * ctx.rows[-1].y * d)
    pset = set(part)
    w_rep = sum(r.params for i, r in enumerate(ctx.rows) if i not in pset)
    w_part = sum(ctx.rows[i].params for i in part) / mp
    ge = m.t_allreduce(p, w_rep * d)
    ge += m.t_allreduce(p // mp, w_part * d, span=p, phi=m.phi if mp > 1 else 1.0)
    return {"FB-allgather": ag, "FB-allreduce": ar, "GE-allreduce": ge}, pairs


def _ends_in_shard(ctx, part, paired):
    """True when the model's last Dense row is partitioned and unpaired: the
    ModuloInverseLayer then follows a ShardLayer, whose gradient stays partial."""
    dense = [i for i, r in enumerate(ctx.rows) if r.kind == "dense"]
    return bool(dense) and dense[-1] in set(part) and dense[-1] not in paired


def _gmp_comm_b(ctx, p, mp, part, b):
    """Scheme "B": mp rounds on one rank's b rows; forward collectives twice (recompute)."""
    m, d = ctx.m, ctx.delta
    ag = ar = 0.0
    pairs = pairs_of(ctx, part, mp) if part else []
    paired = {i for ab in pairs for i in ab}
    if part:
        x0 = b * ctx.rows[part[0]].x * d
        ag += mp * (2 * m.t_broadcast(mp, x0) + m.t_reduce(mp, x0))
        for a, bb in pairs:
            ar += mp * 2 * m.t_allreduce(mp, b * ctx.rows[bb].y * d)
            if a != part[0]:
                ar += mp * m.t_allreduce(mp, b * ctx.rows[a].x * d)
        for i in (i for i in part if i not in paired):
            ag += mp * 2 * m.t_allgather(mp, b * ctx.rows[i].y / mp * d)
        # the outputs' gradient is broadcast from the round's rank
        ag += mp * m.t_broadcast(mp, b * ctx.rows[-1].y * d)
    pset = set(part)
    w_rep = sum(r.params for i, r in enumerate(ctx.rows) if i not in pset)
    w_part = sum(ctx.rows[i].params for i in part) / mp
    ge = m.t_allreduce(p, w_rep * d)
    ge += m.t_allreduce(p // mp, w_part * d, span=p, phi=m.phi if mp > 1 else 1.0)
    return {"FB-allgather": ag, "FB-allreduce": ar, "GE-allreduce": ge}, pairs


def _gmp_one(ctx, p, mp, ccr_threshold, scheme):
    B = ctx.B
    b = B / p
    part, kept = _gmp_layers(ctx, mp, ccr_threshold) if mp > 1 else ([], [])
    pset, start = set(part), (part[0] if part else len(ctx.rows))
    comp = sum(ctx.wu[i] / (mp if i in pset else 1) for i in range(len(ctx.rows)))
    comm, pairs = _gmp_comm(ctx, p, mp, part, b, scheme)
    # a partitioned layer runs the group's mp * b rows at its share of the width
    # (1/mp, or the machine's calibrated split_scales: f, or c as a pair's second)
    shares = split_shares(ctx, part, pairs, mp)
    share = [shares.get(i, 1.0) for i in range(len(ctx.rows))]
    terms, nb_group = [], (mp * b if scheme == "BK" else b)
    for i, r in enumerate(ctx.rows):
        if i < start:
            comp += b * ctx.fb[i]
            terms.append((r, b, 1, 1))
        elif i in pset:
            comp += mp * b * ctx.fb[i] * share[i]
            terms.append((_half_split(r, mp), nb_group, 1, mp))
        else:
            comp += mp * b * ctx.fb[i]
            terms.append((r, nb_group, 1, 1))
    if scheme == "B" and part:   # each round's forward runs again in the backward pass
        fwd = 1.0 - ctx.backward_share()
        comp += fwd * sum(mp * b * ctx.fb[i] * share[i] for i in range(start, len(ctx.rows)))
    reasons = _batch_reasons(B, p)
    if p % mp:
        reasons.append(f"mp={mp} does not divide the world size p={p}")
    opts = {"mp": mp, "scheme": scheme, "partitioned_layers": [ctx.rows[i].name for i in part],
            "replicated_layers": kept, "param_memory_bytes": _param_mem(ctx, part, mp)}
    opts["pairs"] = [(ctx.rows[a].name, ctx.rows[c].name) for a, c in pairs]
    return _result(ctx, "gmp", p, comp * ctx.m.oversubscription(p), comm, ctx.mem(terms),
                   opts, reasons)


def _half_split(r, mp):
    """A row whose output is split mp ways (input stays whole) for memory terms."""
    import dataclasses  # noqa: WPS433
    return dataclasses.replace(r, y=r.y / mp)


def _param_mem(ctx, part, mp):
    conv = sum(r.params for i, r in enumerate(ctx.rows) if i not in set(part))
    fc = sum(ctx.rows[i].params for i in part)
    return formulas.splitbrain_param_memory(conv, fc, mp, ctx.delta)


@strategy("gmp")
def group_model_parallel(ctx, p, mp=None, ccr_threshold=formulas.SPLITBRAIN_CCR_THRESHOLD,
                         scheme="BK", **_):
    """SplitBrain GMP with model groups of ``mp`` (searched over divisors of p)."""
    if scheme not in ("B/K", "B", "BK"):
        raise ValueError(f"Received scheme={scheme!r} for gmp; expected 'BK', 'B' or 'B/K'.")
    if mp is not None and (not isinstance(mp, int) or mp < 1):
        raise ValueError(f"Received mp={mp!r} for gmp; expected a positive integer.")
    choices = [mp] if mp else divisors(p)
    return _best(_gmp_one(ctx, p, g, ccr_threshold, scheme) for g in choices)


def _ls_one(ctx, p, n_f):
    m, d, B = ctx.m, ctx.delta, ctx.B
    n_c = p - n_f
    K = B / n_c
    split = ctx.first_dense()
    conv, fc = range(split), range(split, len(ctx.rows))
    # CONV workers and FC workers take turns (each waits for the other's
    # activations or errors): only n_c ranks, then only n_f ranks, share the cores
    slow_c, slow_f = m.oversubscription(n_c), m.oversubscription(n_f)
    fixed_c = m.compute_fixed_s * len(conv) / max(len(ctx.rows), 1)
    T_c = K * sum(ctx.fb[i] for i in conv) + sum(ctx.wu[i] for i in conv) + fixed_c
    T_f = K * sum(ctx.fb[i] for i in fc) + m.compute_fixed_s - fixed_c
    wu_fc = sum(ctx.wu[i] for i in fc)
    comp = T_c * slow_c + (formulas.stanza_compute(0.0, T_f, n_c, n_f) + wu_fc) * slow_f
    A = ctx.rows[split - 1].y if split > 0 else ctx.prof.input_items
    per_fc = n_c / n_f
    g = math.ceil(per_fc)
    # as tfhybrid issues them: one alltoall on each FC worker's group (its g CONV
    # workers and itself) for the activations, one for their error, on the critical
    # path (the predictions' alltoall runs during the CONV backward); each moves data
    # one way (CONV workers -> FC worker, then back): the p2p kind's cost
    a2a = m.t_neighbours(g + 1, per_fc * K * A * d, kind="p2p")
    p2p = 2 * a2a
    P_c = sum(ctx.rows[i].params for i in conv)
    P_f = sum(ctx.rows[i].params for i in fc)
    # CONV workers reduce after their backward; the FC workers' reduction starts when
    # the FC backward ends and runs meanwhile (what it does not hide is added)
    ar_c = m.t_allreduce(n_c, P_c * d)
    ar_f = m.t_allreduce(n_f, P_f * d)
    bwd_c = slow_c * K * sum(ctx.bw[i] for i in conv)
    ge = ar_c + max(ar_f - a2a - bwd_c - ar_c, 0.0)
    beta = m.alpha_beta(p)[1]
    mem = max(ctx.mem((ctx.rows[i], K, 1, 1) for i in conv),
              ctx.mem((ctx.rows[i], per_fc * K, 1, 1) for i in fc))
    reasons = _batch_reasons(B, n_c, "n_c")
    if split == len(ctx.rows):
        reasons.append("the model has no Dense layer: nothing to place on FC workers")
    T_ps = K * sum(ctx.fb) + sum(ctx.wu)
    ps = formulas.ps_iteration(n_c, n_f, sum(r.params for r in ctx.rows) * d,
                               1 / beta if beta else math.inf, T_ps)
    opts = {"n_c": n_c, "n_f": n_f, "K": K, "ps_baseline_s": ps}
    return _result(ctx, "ls", p, comp, {"p2p": p2p, "GE-allreduce": ge}, mem, opts, reasons,
                   fixed=False)


@strategy("ls")
def layer_separation(ctx, p, n_f=None, **_):
    """Stanza: n_c = p - n_f CONV workers and n_f FC workers (Eq. 2-5, 6-7)."""
    if p < 2:
        return _result(ctx, "ls", p, math.inf, {}, 0.0, {"n_f": None},
                       [f"layer separation needs p >= 2 (one CONV and one FC worker); p={p}"])
    if n_f is not None and not (isinstance(n_f, int) and 1 <= n_f < p):
        raise ValueError(f"Received n_f={n_f!r} for ls with p={p}; expected 1 <= n_f < p.")
    choices = [n_f] if n_f else range(1, p)
    return _best(_ls_one(ctx, p, k) for k in choices)


STRATEGIES_HYBRID.update(gmp=STRATEGIES["gmp"], ls=STRATEGIES["ls"])
