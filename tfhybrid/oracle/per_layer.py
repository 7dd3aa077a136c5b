"""Gholami et al.'s integrated choice, layer by layer and grid by grid (§2.2-2.3, Eq. 6).

On a ``P_r x P_c`` grid (``P_r`` = model group ``k``, ``P_c = p / k`` data
groups) every weighted layer uses its model group in one of four ways:

==========  ==================================================================
choice      compute per rank, and the collectives it costs (one iteration)
==========  ==================================================================
s           domain split (L_D): ``B/P_c`` samples on ``1/k`` of the space;
            halo exchange of x forward and dL/dy backward; the weight
            gradient all-reduced over all ``p`` ranks
f           model split by output units (L_M, 1.5D): ``1/k`` of the layer;
            allgather of y forward, allreduce of dL/dx backward over ``k``;
            the ``1/k`` weight gradient all-reduced over ``P_c``
c           model split by input units (L_M): allreduce of y forward,
            allgather of dL/dx backward; weight gradient as f
replicate   the whole layer on the group's ``B/P_c`` samples (redundant
            within the group); weight gradient all-reduced over ``P_c``. Eq. 6
            puts every layer in L_M or L_D; tfhybrid's ``s``/``ds`` replicate
            the layers after the spatial region, so replication is priced too,
            but a grid whose plan splits no layer is not offered (it would be
            ``d`` on fewer groups with redundant copies)
==========  ==================================================================

A filter layer whose output reaches the next weighted layer only through
element-wise/pooling rows may pair with it (``f`` then ``c``): one allreduce
of the pair's output forward and one of its input gradient backward, no
allgather (what ``tfhybrid.transform`` builds). Domain splits form a
contiguous prefix of convolutions (the spatial region) whose end gathers the
activation once. Each layer's choice minimises its own time (a dynamic
program over the layer sequence takes pairs and the prefix into account);
every grid ``k | p`` is tried and the fastest grid wins (§2.2). Times come
from the same machine model as every other prediction
(:class:`tfhybrid.oracle.machine.Machine`: calibrated alpha/beta per tier,
per-layer seconds when calibrated, else FLOPs / flop_rate).

Departures from Eq. 6 (and why): collectives are those ``tfhybrid.transform``
issues (ring allreduce/allgather, the pairing above), not 1.5D's three
allgathers per layer; non-weighted rows are charged where their input lives
(split inside the spatial region and between a pair, replicated elsewhere);
the spatial split is along the first spatial axis (``spatial="height"``).

Example:
    >>> from tfhybrid.oracle.profile import LayerRow, ModelProfile
    >>> fc = LayerRow("fc", "dense", 4096, 4096, 0, 8192, 16384, 64, 64, 64, 64)
    >>> plans = integrated_plans(ModelProfile("m", (fc,), 4096), 4, 8,
    ...                          {"alpha": 1e-4, "beta": 1e-9, "flop_rate": 1e9})
    >>> [(pl.model_parallel, pl.strategy) for pl in plans][:1]
    [(1, 'd')]
"""
from __future__ import annotations

import dataclasses
import math
from typing import Dict, List, Optional, Tuple

from tfhybrid.oracle.machine import as_machine
from tfhybrid.oracle.record import Context, divisors
from tfhybrid.oracle.strategies import halo_sent

CHOICES = ("s", "f", "c", "replicate")


@dataclasses.dataclass(frozen=True)
class LayerChoice:
    """One weighted layer's choice on a grid and what each alternative costs.

    Attributes:
        name: Layer name.
        choice: ``"s"``, ``"f"``, ``"c"`` or ``"replicate"``.
        costs: Seconds per iteration of this layer (compute + its
            collectives) under each alternative that applies; a layer in an
            ``f``->``c`` pair is charged its share of the pair.
        paired_with: The partner layer of an ``f``->``c`` pair, else None.
    """

    name: str
    choice: str
    costs: Dict[str, float]
    paired_with: Optional[str] = None

    def why(self) -> str:
        """``f 1.2 ms (c 1.9 ms, replicate 3.1 ms)``: the choice first, then the others."""
        others = ", ".join(f"{k} {_ms(v)}" for k, v in sorted(self.costs.items(),
                                                                key=lambda kv: kv[1])
                           if k != self.choice)
        pair = f" paired with {self.paired_with}" if self.paired_with else ""
        return f"{self.choice} {_ms(self.costs[self.choice])}{pair}" + \
            (f" ({others})" if others else "")


@dataclasses.dataclass(frozen=True)
class IntegratedPlan:
    """The per-layer plan on one grid and the ``transform`` call that builds it.

    Attributes:
        p: World size.
        model_parallel: ``P_r`` (model / spatial group size).
        strategy: ``"d"``, ``"df"``/``"f"`` (no domain split) or
            ``"ds"``/``"s"`` (with a spatial prefix).
        options: ``transform`` options: ``layers`` (every weighted layer's
            choice outside the spatial region), ``spatial_layers``, ``spatial``.
        total_s: Predicted seconds per iteration.
        layers: One :class:`LayerChoice` per weighted layer, in model order.
    """

    p: int
    model_parallel: int
    strategy: str
    options: dict
    total_s: float
    layers: Tuple[LayerChoice, ...]

    def table(self) -> str:
        """One line per weighted layer: its choice and the alternatives' times."""
        head = (f"grid {self.p // self.model_parallel} x {self.model_parallel} "
                f"(data x model): {self.strategy} {_ms(self.total_s)} per iteration")
        return "\n".join([head] + [f"  {c.name:<24} {c.why()}" for c in self.layers])


def _ms(s: float) -> str:
    return "inf" if math.isinf(s) else f"{s * 1e3:.3g} ms"


class _Costs:
    """Per-layer seconds of one grid (k model, p // k data)."""

    def __init__(self, ctx: Context, p: int, k: int):
        self.ctx, self.p, self.k, self.pc = ctx, p, k, p // k
        self.nb = ctx.B / self.pc
        self.m, self.d = ctx.m, ctx.delta
        self.slow = ctx.m.oversubscription(p)
        weighted = ctx.weighted()
        self.first = weighted[0] if weighted else -1

    def comp(self, i, share=1.0, how=None):
        """Row i's compute at ``share`` of its width; ``how`` ("f"/"c": row i
        split k ways; "s": its first spatial axis split k ways) takes the
        forward+backward share from the machine's calibrated ``split_scales``
        instead (the update stays ``share``)."""
        if how == "s":
            fb = self.ctx.spatial_share(i, (self.k,))
        else:
            fb = self.ctx.split_share(i, how, self.k) if how else share
        return (self.nb * self.ctx.fb[i] * fb + self.ctx.wu[i] * share) * self.slow

    def grad(self, i, parts):
        """Weight-gradient allreduce of row i's 1/parts shard over the data groups."""
        r, m = self.ctx.rows[i], self.m
        return m.t_allreduce(self.pc, r.params / parts * self.d, span=self.p,
                             phi=m.phi if parts > 1 else 1.0)

    def replicate(self, i):
        return self.comp(i) + self.grad(i, 1)

    def f(self, i):
        r, m, k = self.ctx.rows[i], self.m, self.k
        if r.filters % k:
            return math.inf
        bwd = m.t_allreduce(k, self.nb * r.x * self.d) if i != self.first else 0.0
        return self.comp(i, 1 / k, "f") + m.t_allgather(k, self.nb * r.y * self.d / k) + bwd + \
            self.grad(i, k)

    def c(self, i):
        r, m, k = self.ctx.rows[i], self.m, self.k
        if r.channels % k:
            return math.inf
        bwd = m.t_allgather(k, self.nb * r.x * self.d / k) if i != self.first else 0.0
        return self.comp(i, 1 / k, "c") + m.t_allreduce(k, self.nb * r.y * self.d) + bwd + \
            self.grad(i, k)

    def pair(self, a, b):
        """(cost of a, cost of b) as an f -> c pair; inf when it cannot pair."""
        ra, rb, m, k = self.ctx.rows[a], self.ctx.rows[b], self.m, self.k
        between = self.ctx.rows[a + 1:b]
        if ra.filters % k or rb.channels % k or \
                not all(r.kind in ("elementwise", "pool") for r in between):
            return math.inf, math.inf
        inner = sum(self.comp(j, 1 / k) for j in range(a + 1, b))
        bwd = m.t_allreduce(k, self.nb * ra.x * self.d) if a != self.first else 0.0
        return (self.comp(a, 1 / k, "f") + bwd + self.grad(a, k) + inner,
                self.comp(b, 1 / k, "c") + m.t_allreduce(k, self.nb * rb.y * self.d) +
                self.grad(b, k))

    def spatial(self, i):
        """Row i in the spatial region: split compute, its halo, the world gradient."""
        r, m = self.ctx.rows[i], self.m
        e = r.spatial_out[0] if r.spatial_out else 1
        if self.k > e:
            return math.inf
        halo = 0.0
        if r.kernel:   # comm.halo's neighbour-only alltoall (strategies.halo_sent)
            hx, hdy = halo_sent(r, (self.k,) + (1,) * (len(r.kernel) - 1))
            if hx:
                halo += m.t_neighbours(self.k, self.nb * self.d * hx, self.k)
            if hdy and i != self.first:
                halo += m.t_neighbours(self.k, self.nb * self.d * hdy, self.k)
        grad = m.t_allreduce(self.p, r.params * self.d) if r.params else 0.0
        return self.comp(i, 1 / self.k, "s") + halo + grad


def _dp(ctx, costs, todo):
    """Cheapest choices for the weighted rows ``todo`` (model order): single f/c/
    replicate per layer or f->c pairs of consecutive rows. Returns (seconds, picks)
    with picks = [(row, choice, costs dict, partner row or None)]."""
    n = len(todo)
    best: List[Tuple[float, list]] = [(0.0, [])] * (n + 1)
    for j in range(n - 1, -1, -1):
        i = todo[j]
        alts = {"f": costs.f(i), "c": costs.c(i), "replicate": costs.replicate(i)}
        pick = min(alts, key=alts.get)
        cand = (alts[pick] + best[j + 1][0], [(i, pick, alts, None)] + best[j + 1][1])
        if j + 1 < n:
            ca, cb = costs.pair(i, todo[j + 1])
            if ca + cb < math.inf:
                alts_b = {"f": costs.f(todo[j + 1]), "c": costs.c(todo[j + 1]),
                          "replicate": costs.replicate(todo[j + 1])}
                tot = ca + cb + best[j + 2][0]
                if tot < cand[0]:
                    cand = (tot, [(i, "f", dict(alts, f=ca), todo[j + 1]),
                                  (todo[j + 1], "c", dict(alts_b, c=cb), i)] + best[j + 2][1])
        best[j] = cand
    return best[0]


def _use_the_group(seconds, picks):
    """(inf, None) when no layer is split over the model group (then the grid is
    only redundant copies of ``d`` on fewer groups), else unchanged."""
    if any(choice != "replicate" for _, choice, _, _ in picks):
        return seconds, picks
    return math.inf, None


def _unweighted(ctx, costs, lo, hi, region_end, picks):
    """Compute of the non-weighted rows in [lo, hi): split inside the spatial region
    (index < region_end) and between paired layers, replicated elsewhere."""
    inside_pair = set()
    for i, _, _, partner in picks:
        if partner is not None and partner > i:
            inside_pair.update(range(i + 1, partner))
    weighted = set(ctx.weighted())
    total = 0.0
    for j in range(lo, hi):
        if j in weighted or j in inside_pair:
            continue
        total += costs.comp(j, 1 / costs.k, "s") if j < region_end else costs.comp(j)
    return total


def _plan_for_prefix(ctx, p, k, n_s):
    costs = _Costs(ctx, p, k)
    weighted = ctx.weighted()
    prefix = [i for i in ctx.spatial_prefix() if ctx.rows[i].kind == "conv"][:n_s]
    if len(prefix) < n_s:
        return None
    s_cost = [costs.spatial(i) for i in prefix]
    if any(math.isinf(c) for c in s_cost):
        return None
    region_end = (prefix[-1] + 1) if prefix else 0
    gather = 0.0
    if prefix:
        last = ctx.rows[prefix[-1]]
        gather = costs.m.t_allgather(k, costs.nb * last.y * costs.d / k, k)
    rest = [i for i in weighted if i >= region_end]
    seconds, picks = _dp(ctx, costs, rest)
    if not prefix:
        seconds, picks = _use_the_group(seconds, picks)
        if picks is None:
            return None
    total = sum(s_cost) + gather + seconds + _unweighted(ctx, costs, 0, len(ctx.rows),
                                                         region_end, picks)
    total += (ctx.m.compute_fixed_s + ctx.m.step_overhead_s) * costs.slow
    choices = []
    for i, c in zip(prefix, s_cost):
        alts = {"s": c + (gather if i == prefix[-1] else 0.0), "f": costs.f(i),
                "c": costs.c(i), "replicate": costs.replicate(i)}
        choices.append(LayerChoice(ctx.rows[i].name, "s", alts))
    for i, choice, alts, partner in picks:
        alts = {key: v for key, v in alts.items()}
        choices.append(LayerChoice(ctx.rows[i].name, choice, alts,
                                   ctx.rows[partner].name if partner is not None else None))
    layers = {c.name: c.choice for c in choices if c.choice != "s"}
    if prefix:
        strategy = "s" if k == p else "ds"
        options = {"spatial": "height", "spatial_layers": len(prefix), "layers": layers}
    else:
        strategy = "f" if k == p else "df"
        options = {"layers": layers}
    return IntegratedPlan(p, k, strategy, options, total, tuple(choices))


def _data_plan(ctx, p):
    costs = _Costs(ctx, p, 1)
    weighted = ctx.weighted()
    choices = tuple(LayerChoice(ctx.rows[i].name, "replicate",
                                {"replicate": costs.replicate(i)}) for i in weighted)
    compute = sum(costs.comp(j) for j in range(len(ctx.rows)))
    reduce = ctx.m.t_allreduce(p, sum(r.params for r in ctx.rows) * ctx.delta)
    hidden = ctx.m.overlap * min(reduce, compute * ctx.backward_share())   # as strategies.d
    total = compute + reduce - hidden + \
        (ctx.m.compute_fixed_s + ctx.m.step_overhead_s) * costs.slow
    return IntegratedPlan(p, 1, "d", {}, total, choices)


def grid_plan(ctx: Context, p: int, k: int) -> Optional[IntegratedPlan]:
    """The cheapest per-layer plan with model groups of ``k`` (None: nothing fits)."""
    if k == 1:
        return _data_plan(ctx, p)
    if ctx.B % (p // k):
        return None
    n_conv = len([i for i in ctx.spatial_prefix() if ctx.rows[i].kind == "conv"])
    plans = [_plan_for_prefix(ctx, p, k, n) for n in range(n_conv + 1)]
    plans = [pl for pl in plans if pl is not None and not math.isinf(pl.total_s)]
    return min(plans, key=lambda pl: pl.total_s) if plans else None


def integrated_plans(model_or_profile, p: int, batch_size: int, machine,
                     model_parallel: Optional[int] = None) -> List[IntegratedPlan]:
    """The best per-layer plan of every grid ``k x p/k`` (or of ``model_parallel``
    only), fastest first.

    Args:
        model_or_profile: Keras model or :class:`~tfhybrid.oracle.profile.ModelProfile`.
        p: World size.
        batch_size: Global mini-batch.
        machine: Machine spec (dict, JSON path or Machine).
        model_parallel: Keep the grid's model-group size fixed.

    Raises:
        ValueError: p < 1, a batch smaller than 1, or model_parallel not dividing p.
    """
    from tfhybrid.oracle.api import _as_profile
    if not isinstance(p, int) or p < 1 or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"Received p={p!r}, batch_size={batch_size!r}; both must be positive "
                         "integers (the world size and the global batch).")
    ks = divisors(p)
    if model_parallel is not None:
        if model_parallel not in ks:
            raise ValueError(f"Received model_parallel={model_parallel!r}, which does not "
                             f"divide p={p}; use one of {ks}.")
        ks = [model_parallel]
    ctx = Context(_as_profile(model_or_profile), as_machine(machine), batch_size)
    plans = [grid_plan(ctx, p, k) for k in ks]
    return sorted((pl for pl in plans if pl is not None), key=lambda pl: pl.total_s)
