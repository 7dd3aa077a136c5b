"""Per-strategy time and memory models (one iteration, global batch B, p ranks).

Each model follows ParaDL Table 3 / Appendix A applied layer by layer with
the collectives tfhybrid actually issues (``python -m tfhybrid.docs concepts``,
"the collective algebra"), plus Gholami's 1.5D
grid, SplitBrain's group model parallelism and Stanza's layer separation.
Notation: ``b = B/p`` local batch, ``fb_l`` forward+backward seconds per
sample, ``|x_l|``, ``|y_l|``, ``|w_l|`` items, ``delta`` bytes per item.

Where this module departs from the paper's closed forms (and why):

* Layers a strategy cannot split (pooling, norm, activations under filter or
  channel parallelism; Dense layers under spatial parallelism) are computed
  **replicated** (cost not divided by p), as ParaDL's tool does with its
  layer-configuration files; Table 3 divides every layer by p.
* Filter / channel collectives are charged only on the partitioned (conv /
  dense) layers, not on every row of the model, with each layer's own
  |x_l| and |y_l|; and f/df pair filter -> channel layers as tfhybrid's
  transformer does (``pairing=False`` gives ParaDL's per-layer scheme).
* ``s``/``ds`` gather the activations before the first Dense layer (DESIGN)
  and run the rest replicated; ParaDL Table 3 assumes every layer is split.
* The gradient allreduce covers all parameters (biases too).
* BatchNormalization layers synchronize their moments over the ranks that
  split the batch or space (tfhybrid's SyncBatchNormalization: two
  allreduces of C items forward, two backward, in ``FB-allreduce``); the
  papers' models have no such term (found by ``tfhybrid.callbacks.Profile``).
* Pipeline weight update is per iteration (Eq. 12 multiplies it by D). The
  pipeline is priced by simulating its fill-drain step as tfhybrid runs it
  (:mod:`tfhybrid.oracle.schedule`): a transfer runs while its sender
  computes the next micro-batch, and only the stages computing at the same
  moment share the node's cores (Eq. 12-13 serialise every transfer and
  make no statement about oversubscription).
* Uneven spatial splits are charged ceil(H/ph) rows (load imbalance).
* A halo exchange is one alltoall over the spatial group sending only to the
  neighbours (``comm.halo``'s default), priced per layer and direction as
  lambda + (p_sp - 1) alpha + (bytes the busiest rank sends) beta
  (:func:`halo_sent`), not ParaDL's 2(alpha + |h| beta) per split axis.

Approximations: of the overlap of communication with computation only the
gradient allreduce's with back-propagation is credited, by the machine's
measured ``overlap`` fraction (0 unless calibrated: the papers' Table 3),
ring collectives everywhere, Stanza's FC-worker
allreduce assumed hidden (as in the paper), contention only via ``phi``.

Example:
    >>> from tfhybrid.oracle.profile import LayerRow, ModelProfile
    >>> from tfhybrid.oracle.machine import Machine
    >>> from tfhybrid.oracle.record import Context
    >>> row = LayerRow("fc", "dense", 100, 100, 0, 200, 400, 10, 10, 10, 10)
    >>> ctx = Context(ModelProfile("m", (row,), 10), Machine(0, 0, flop_rate=600), 4)
    >>> STRATEGIES["d"](ctx, 2).compute_s
    2.3333333333333335
"""
from __future__ import annotations

import math

from tfhybrid._compat import renamed_option
from tfhybrid.oracle import formulas
from tfhybrid.oracle.profile import _halo_rows
from tfhybrid.oracle.record import Prediction, divisors
from tfhybrid.spatial_geometry import SPATIAL_AXES, spatial_grid

STRATEGIES = {}


def strategy(name):
    def register(fn):
        STRATEGIES[name] = fn
        return fn
    return register


_PHASE_OF = {"FB_ag": "FB-allgather", "FB_ar": "FB-allreduce", "halo": "halo",
             "GE_ar": "GE-allreduce", "p2p": "p2p"}


def _phases(**kw):
    """Keyword shorthands (FB_ag, FB_ar, halo, GE_ar, p2p) to phase names."""
    return {_PHASE_OF[k]: v for k, v in kw.items()}


def _result(ctx, name, p, comp, comm, mem, options, reasons, fixed=True):
    """The Prediction; adds the machine's batch-independent compute and framework
    overhead per iteration (both CPU work, so both slowed by oversubscription),
    and credits the measured overlap of the gradient allreduce with the backward
    part of the compute."""
    reasons = list(reasons) + ctx.memory_reasons(mem)
    bn = ctx.batch_norm_sync_s(_bn_group(name, p, options))
    if bn:
        comm = dict(comm)
        comm["FB-allreduce"] = comm.get("FB-allreduce", 0.0) + bn
    slow = ctx.m.oversubscription(p)
    hidden = ctx.m.overlap * min(comm.get("GE-allreduce", 0.0), comp * ctx.backward_share())
    if fixed:      # (the pipeline's schedule charges it per micro-batch itself)
        comp += ctx.m.compute_fixed_s * slow
    return Prediction(strategy=name, p=p, batch=ctx.B, compute_s=comp,
                      comm_s=comm, overhead_s=ctx.m.step_overhead_s * slow, memory_bytes=mem,
                      options=options, feasible=not reasons, reasons=tuple(reasons),
                      hidden_s=hidden)


def _bn_group(name, p, options):
    """Ranks a BatchNormalization synchronizes its moments over (tfhybrid's
    default batch_norm="sync": every group that splits the batch or space)."""
    if name in ("d", "s", "ds", "gmp"):
        return p
    if name == "df":
        return int((options.get("grid") or {}).get("data", 1))
    return 1     # f, c: a model group holds the same rows; serial; ls, p: local


def _batch_reasons(B, groups, what="p"):
    if groups > B:
        return [f"{what}={groups} exceeds the batch B={B} (limit {what} <= B)"]
    if B % groups:
        return [f"batch B={B} is not divisible by {what}={groups}"]
    return []


def _best(candidates):
    """Feasible prediction with the smallest total, else the smallest total."""
    candidates = [c for c in candidates if c is not None]
    feasible = [c for c in candidates if c.feasible]
    pool = feasible or candidates
    return min(pool, key=lambda c: c.total_s) if pool else None


@strategy("serial")
def serial(ctx, p, **_):
    """Table 3 row Serial: B sum(FW+BW) + sum WU; memory with the whole batch."""
    comp = ctx.B * sum(ctx.fb) + sum(ctx.wu)
    mem = ctx.mem((r, ctx.B, 1, 1) for r in ctx.rows)
    return _result(ctx, "serial", 1, comp, {}, mem, {"p": 1}, [])


@strategy("d")
def data(ctx, p, replicated_fc=0, **_):
    """Table 3 row Data (Eq. 5-7); Lee et al.'s replicated gradients for the first
    ``replicated_fc`` Dense layers (allgather activations and errors instead)."""
    B, m, d = ctx.B, ctx.m, ctx.delta
    b = B / p
    reasons = _batch_reasons(B, p)
    dense = [i for i in ctx.weighted() if ctx.rows[i].kind == "dense"][:replicated_fc]
    comp = b * sum(ctx.fb) + sum(ctx.wu)
    ag, lee = 0.0, []
    for i in dense:
        r = ctx.rows[i]
        ag += m.t_allgather(p, b * (r.x + r.y) * d)
        comp += (B - b) * r.bwd_flops / 2 / (m.flop_rate or math.inf)
        lee.append({"layer": r.name, "allreduce_items": r.weights,
                    "allgather_items": (r.x + r.y) * B})
    w_ar = sum(r.params for i, r in enumerate(ctx.rows) if i not in dense)
    comm = _phases(GE_ar=m.t_allreduce(p, w_ar * d), FB_ag=ag)
    mem = ctx.mem((r, b, 1, 1) for r in ctx.rows)
    opts = {"local_batch": b, "replicated_fc": lee}
    return _result(ctx, "d", p, comp * m.oversubscription(p), comm, mem, opts, reasons)


def _spatial_limits(ctx, idx, grid):
    """ParaDL's limit p <= W x H per axis: each split must not exceed the extent."""
    reasons, uneven = [], []
    for axis, parts in enumerate(grid):
        if parts <= 1:
            continue
        extents = [(ctx.rows[i].spatial_out[axis], ctx.rows[i].name) for i in idx
                   if len(ctx.rows[i].spatial_out) > axis]
        if not extents:
            reasons.append(f"no layer has spatial axis {axis} to split {parts} ways")
            continue
        small, name = min(extents)
        if parts > small:
            reasons.append(f"spatial split {parts} along axis {axis} exceeds the extent "
                           f"{small} of layer {name!r} (limit p <= W x H)")
        uneven += [n for e, n in extents if e % parts]
    return reasons, sorted(set(uneven))


def halo_sent(row, grid):
    """(forward, backward) items per sample the busiest rank of a block grid sends
    in one halo exchange: a face to each neighbour along every split axis (two
    inside the grid, one at an edge: ``min(parts - 1, 2)``) and, for each pair
    of split axes, the corner blocks to the diagonal neighbours (what
    ``comm.halo``'s neighbour-only exchange moves). ParaDL charges
    2(alpha + |h| beta) per axis instead, as if every rank had two neighbours.

    Example:
        >>> from tfhybrid.oracle.profile import LayerRow
        >>> r = LayerRow("c", "conv", 0, 0, 0, 0, 0, 64, 64, 1, 1, (8, 8), (8, 8), (3, 3), (1, 1))
        >>> halo_sent(r, (2, 1)), halo_sent(r, (4, 1)), halo_sent(r, (2, 2))
        ((8, 8), (16, 16), (17.0, 17.0))
    """
    axes = [(a, parts) for a, parts in enumerate(grid) if parts > 1 and a < len(row.kernel)]
    faces, sx, sy = {}, 0, 0
    for a, parts in axes:
        hx, hdy = row.halo_for(tuple(parts if b == a else 1 for b in range(len(grid))))
        n = min(parts - 1, 2)
        faces[a] = (n, hx, hdy)
        sx, sy = sx + n * hx, sy + n * hdy
    for k, (a, _) in enumerate(axes):
        for b, _ in axes[k + 1:]:
            (na, hxa, hya), nb = faces[a], faces[b][0]
            rows = _halo_rows(row.kernel[b], row.strides[b])
            sx += na * nb * hxa * rows / max(row.spatial_in[b], 1)
            sy += na * nb * hya * math.ceil(rows / row.strides[b]) / max(row.spatial_out[b], 1)
    return sx, sy


def _grids(n, ndim):
    if ndim <= 1:
        return [(n,)]
    return [(a, n // a) for a in divisors(n)]


def _spatial_part(ctx, p_sp, grid, nb, span):
    """Compute, halo, boundary and memory terms of the spatial part at batch nb.

    The boundary is ``{"FB_ag": s}`` (the feature map gathered before the first
    replicated layer), or, for a global pooling right after the region (it pools
    the blocks), ``{"FB_ar": s}`` (average: the blocks' sums all-reduced) or
    ``{"FB_ag": s, "FB_ar": s2}`` (max: the maxima all-gathered, backward the
    tie counts all-reduced)."""
    m, d, idx = ctx.m, ctx.delta, ctx.spatial_prefix()
    comp = halo = 0.0
    for i in idx:
        r = ctx.rows[i]
        comp += nb * ctx.fb[i] * ctx.spatial_share(i, grid)
        sx, sy = halo_sent(r, grid)
        if sx or sy:   # one neighbour-only alltoall forward, one backward (comm.halo)
            halo += m.t_neighbours(p_sp, nb * d * sx, span)
            if i > 0:   # the model input's gradient is never computed: no bwd halo
                halo += m.t_neighbours(p_sp, nb * d * sy, span)
    rest = [i for i in range(len(ctx.rows)) if i not in set(idx)]
    boundary, pooled = {}, []
    pool = ctx.rows[rest[0]].global_pool if idx and rest and rest[0] == idx[-1] + 1 else ""
    if pool:
        # the region ends in a global pooling of the blocks, its compute on the blocks
        pooled, rest = rest[:1], rest[1:]
        comp += nb * ctx.fb[pooled[0]] / p_sp
        c = ctx.rows[pooled[0]].filters
        if pool == "average":    # one all-reduce of the sums, batch x (channels + 1)
            boundary["FB_ar"] = m.t_allreduce(p_sp, nb * (c + 1) * d, span)
        else:                    # the maxima all-gathered; backward the tie counts summed
            boundary["FB_ag"] = m.t_allgather(p_sp, nb * c * d, span)
            boundary["FB_ar"] = m.t_allreduce(p_sp, nb * c * d, span)
    elif idx and rest:
        boundary["FB_ag"] = m.t_allgather(p_sp, nb * ctx.rows[idx[-1]].y * d / p_sp, span)
    comp += sum(nb * ctx.fb[i] for i in rest) + sum(ctx.wu)
    terms = ([(ctx.rows[i], nb, p_sp, 1) for i in idx + pooled]
             + [(ctx.rows[i], nb, 1, 1) for i in rest])
    return comp, halo, boundary, ctx.mem(terms), idx


def _spatial_candidates(ctx, p_sp, grid):
    idx = ctx.spatial_prefix()
    ndim = max((len(ctx.rows[i].spatial_out) for i in idx), default=1)
    if grid is not None:
        return [tuple(grid)]
    return _grids(p_sp, min(ndim, 2))


def _spatial_option(ctx, p_sp, spatial, name):
    """The block grid of the ``spatial=`` option (a tuple, or an axis name as in transform)."""
    if spatial is None or not isinstance(spatial, str):
        return None if spatial is None else tuple(spatial)
    ndim = max((len(ctx.rows[i].spatial_out) for i in ctx.spatial_prefix()), default=2)
    return spatial_grid(spatial, p_sp, name, ndim if ndim in SPATIAL_AXES else 2)


@strategy("s")
def spatial(ctx, p, spatial=None, grid=None, **_):
    """Table 3 row Spatial (Eq. 8-10) for the spatial prefix, replicated after it.

    ``spatial``: the block grid ``(ph, pw)`` (or an axis name); ``grid`` is its
    deprecated spelling.
    """
    if grid is not None:
        spatial = renamed_option({"grid": grid}, "grid", "spatial",
                                 "oracle strategy 's'")["spatial"]
    fixed = _spatial_option(ctx, p, spatial, "s")
    return _best(_spatial_one(ctx, p, 1, g) for g in _spatial_candidates(ctx, p, fixed))


@strategy("ds")
def data_spatial(ctx, p, spatial=None, grid=None, **_):
    """Data groups x spatial groups: ``spatial`` = the block grid ``(ph, pw)`` of each
    spatial group (or an axis name), p_data = p / (ph pw); the deprecated ``grid`` =
    ``(p_data, ph[, pw])``.
    """
    if grid is not None:
        spatial = renamed_option({"grid": tuple(grid[1:])}, "grid", "spatial",
                                 "oracle strategy 'ds'")["spatial"]
    if spatial is not None and not isinstance(spatial, str):
        return _spatial_one(ctx, p, max(p // math.prod(spatial), 1), tuple(spatial), name="ds")
    if isinstance(spatial, str):   # an axis name: every spatial-group size along it
        sizes = [k for k in divisors(p) if 1 < k < p]
        return _best(_spatial_one(ctx, p, p // k, _spatial_option(ctx, k, spatial, "ds"),
                                  name="ds") for k in sizes) or _no_grid(ctx, "ds", p)
    cands = []
    for p1 in divisors(p):
        if 1 < p1 < p:
            cands += [_spatial_one(ctx, p, p1, g, name="ds")
                      for g in _spatial_candidates(ctx, p // p1, None)]
    if not cands:
        return _no_grid(ctx, "ds", p)
    return _best(cands)


def _spatial_one(ctx, p, p1, grid, name="s"):
    p_sp = math.prod(grid)
    reasons = [] if p1 * p_sp == p else [f"grid {(p1,) + tuple(grid)} does not multiply to p={p}"]
    reasons += _batch_reasons(ctx.B, p1, "p_data") if p1 > 1 else []
    if not ctx.spatial_prefix():
        reasons.append("the model has no layer with spatial axes to split")
    lim, uneven = _spatial_limits(ctx, ctx.spatial_prefix(), grid)
    nb = ctx.B / p1
    comp, halo, boundary, mem, idx = _spatial_part(ctx, p_sp, grid, nb, p_sp)
    # spatial weights are partial sums (world); the rest sees the same rows inside a
    # spatial group (identical gradients) and is averaged over the data groups only
    sp_params = sum(ctx.rows[i].params for i in idx)
    ge = ctx.m.t_allreduce(p, sp_params * ctx.delta) + ctx.m.t_allreduce(
        p1, (sum(r.params for r in ctx.rows) - sp_params) * ctx.delta, span=p)
    comm = _phases(halo=halo, GE_ar=ge, **boundary)
    opts = {"grid": {"data": p1, "spatial": list(grid)}, "spatial_layers": len(idx),
            "uneven_layers": uneven}
    comp *= ctx.m.oversubscription(p)
    return _result(ctx, name, p, comp, comm, mem, opts, reasons + lim)


def _no_grid(ctx, name, p):
    return _result(ctx, name, p, math.inf, {}, 0.0, {"grid": None},
                   [f"p={p} has no factorisation p_data x p_model with both > 1"])


def _model_reasons(ctx, idx, g, attr, label):
    if not idx:
        return [f"the model has no conv/dense layer to split by {label}"]
    small = min(idx, key=lambda i: getattr(ctx.rows[i], attr))
    val = getattr(ctx.rows[small], attr)
    reasons = []
    if g > val:
        reasons.append(f"model group {g} exceeds the minimum {label} {val} of layer "
                       f"{ctx.rows[small].name!r} (limit p <= min {label})")
    bad = [ctx.rows[i].name for i in idx if getattr(ctx.rows[i], attr) % g]
    if bad and g <= val:
        reasons.append(f"{label} of layers {bad[:4]} not divisible by model group {g}")
    return reasons


def pairs_of(ctx, idx, g):
    """Filter -> channel pairs tfhybrid's transformer builds (DESIGN: a filter layer
    whose output reaches the next weighted layer only through element-wise or
    pooling rows, with channels divisible by g). Returns [(a, b), ...]."""
    out, used = [], set()
    for a, b in zip(idx, idx[1:]):
        between = ctx.rows[a + 1:b]
        if a in used or ctx.rows[b].channels % g:
            continue
        if all(r.kind in ("elementwise", "pool") for r in between):
            out.append((a, b))
            used.update((a, b))
    return out


def split_shares(ctx, part, pairs, k, kind="f"):
    """``{row: share of its whole per-sample seconds on one rank}`` for the rows
    of ``part`` split ``k`` ways: by ``kind`` ("f" output units, "c" input
    channels), a pair's first row by filters and its second by channels
    (:meth:`Context.split_share`: calibrated, else 1/k)."""
    how = {i: kind for i in part}
    how.update({i: h for ab in pairs for i, h in zip(ab, "fc")})
    return {i: ctx.split_share(i, how[i], k) for i in part}


def _collectives(ctx, idx, nb, p2, kind, pairing):
    """(allgather s, allreduce s, rows split by pairs) of f or c over groups of p2."""
    m, d = ctx.m, ctx.delta
    last, first = len(ctx.rows) - 1, (ctx.weighted() or [0])[0]
    pairs = pairs_of(ctx, idx, p2) if (pairing and kind == "f") else []
    paired = {i for ab in pairs for i in ab}
    ag = ar = 0.0
    for a, b in pairs:            # copy (bwd allreduce of dL/dx_a), reduce (fwd allreduce y_b)
        ar += m.t_allreduce(p2, nb * ctx.rows[a].x * d) if a != first else 0.0
        ar += m.t_allreduce(p2, nb * ctx.rows[b].y * d)
    for i in (i for i in idx if i not in paired):
        r = ctx.rows[i]
        fwd_y = 0.0 if (i == last and not pairing) else nb * r.y * d
        bwd_x = 0.0 if i == first else nb * r.x * d
        if kind == "f":
            ag += m.t_allgather(p2, fwd_y / p2) if fwd_y else 0.0
            ar += m.t_allreduce(p2, bwd_x) if bwd_x else 0.0
        else:
            ar += m.t_allreduce(p2, fwd_y) if fwd_y else 0.0
            ag += m.t_allgather(p2, bwd_x / p2) if bwd_x else 0.0
    inner = {j for a, b in pairs for j in range(a + 1, b)}
    return ag, ar, inner, pairs


def _model_parallel(ctx, p, p1, p2, kind, pairing=True, fallback="error"):
    """Filter ('f') or channel ('c') split over groups of p2, data over p1.

    ``fallback="replicate"`` prices what ``tfhybrid.transform(...,
    fallback="replicate")`` builds: a layer whose filters (f) or channels (c)
    the group size does not divide is replicated (full compute, no
    collective of its own, never paired) instead of making the prediction
    infeasible.
    """
    m, d, B = ctx.m, ctx.delta, ctx.B
    idx = ctx.weighted()
    if kind == "c" and ctx.split is None:
        idx = idx[1:]
    attr, label = ("filters", "filters") if kind == "f" else ("channels", "channels")
    replicated = []
    if _check_fallback(fallback) == "replicate" and p2 > 1:
        replicated = [ctx.rows[i].name for i in idx if getattr(ctx.rows[i], attr) % p2]
        idx = [i for i in idx if getattr(ctx.rows[i], attr) % p2 == 0]
    part, nb = set(idx), B / p1
    ag, ar, inner, pairs = _collectives(ctx, idx, nb, p2, kind, pairing)
    share = split_shares(ctx, part, pairs, p2, kind)
    share.update({i: 1.0 / p2 for i in inner})
    comp = sum(nb * ctx.fb[i] * share.get(i, 1.0) for i in range(len(ctx.rows)))
    comp += sum(ctx.wu[i] / (p2 if i in part else 1) for i in range(len(ctx.rows)))
    w_data = sum(r.params / (p2 if i in part else 1) for i, r in enumerate(ctx.rows))
    ge = m.t_allreduce(p1, w_data * d, span=p, phi=m.phi if p2 > 1 else 1.0)
    terms = [(r, nb, 1, p2 if i in part else 1) for i, r in enumerate(ctx.rows)]
    reasons = _model_reasons(ctx, idx, p2, attr, label)
    reasons += _batch_reasons(B, p1, "p_data") if p1 > 1 else []
    opts = {"grid": {"data": p1, "model": p2},
            "partitioned_layers": [ctx.rows[i].name for i in idx],
            "pairs": [(ctx.rows[a].name, ctx.rows[b].name) for a, b in pairs],
            "replicated_layers": replicated}
    comm = _phases(FB_ag=ag, FB_ar=ar, GE_ar=ge)
    return comp * m.oversubscription(p), comm, ctx.mem(terms), opts, reasons


def _check_fallback(fallback):
    if fallback not in ("error", "replicate"):
        raise ValueError(f"Received fallback={fallback!r}; expected 'error' (a layer the "
                         "model group cannot split makes the prediction infeasible) or "
                         "'replicate' (it is replicated, as transform(..., "
                         "fallback='replicate') builds it).")
    return fallback


@strategy("f")
def filter_parallel(ctx, p, pairing=True, fallback="error", **_):
    """Table 3 row Filter (Eq. 15-16): allgather y forward, allreduce dL/dx backward.

    With ``pairing`` (tfhybrid's transformer, default) a filter layer feeding
    the next weighted layer through element-wise/pooling rows forms a pair
    with it (that layer channel-parallel): one allreduce of its output
    forward and one of the pair's input gradient backward, no allgather.
    ``pairing=False`` is ParaDL's scheme (three collectives per layer, the
    last layer's allgather omitted). ``fallback="replicate"``: layers whose
    filters p does not divide are replicated (as transform builds them).
    """
    comp, comm, mem, opts, reasons = _model_parallel(ctx, p, 1, p, "f", pairing, fallback)
    return _result(ctx, "f", p, comp, comm, mem, opts, reasons)


@strategy("c")
def channel_parallel(ctx, p, fallback="error", **_):
    """Table 3 row Channel (Eq. 17-19), from the second weighted layer as ParaDL
    (``fallback="replicate"``: layers whose channels p does not divide are replicated)."""
    comp, comm, mem, opts, reasons = _model_parallel(ctx, p, 1, p, "c", fallback=fallback)
    return _result(ctx, "c", p, comp, comm, mem, opts, reasons)


@strategy("df")
def data_filter(ctx, p, grid=None, model_parallel=None, pairing=True, fallback="error", **_):
    """Table 3 row Data+Filter (Eq. 20-22); grid (p_data, p_model) searched if not given.

    ``options['gholami_eq5_comm_s']`` gives Gholami's 1.5D estimate (Eq. 5,
    Pr = p_model, Pc = p_data) of the same communication for comparison.
    """
    if grid is None and model_parallel is not None:
        grid = (p // model_parallel, model_parallel)
    grids = [tuple(grid)] if grid is not None else [
        (p // g, g) for g in divisors(p) if 1 < g < p]
    if not grids:
        return _no_grid(ctx, "df", p)
    return _best(_df_one(ctx, p, p1, p2, pairing, fallback) for p1, p2 in grids)


def _df_one(ctx, p, p1, p2, pairing, fallback="error"):
    comp, comm, mem, opts, reasons = _model_parallel(ctx, p, p1, p2, "f", pairing, fallback)
    if p1 * p2 != p:
        reasons.append(f"grid ({p1}, {p2}) does not multiply to p={p}")
    idx = ctx.weighted()
    ab = ctx.m.alpha_beta(p)
    opts["gholami_eq5_comm_s"] = formulas.gholami_15d_comm(
        p2, p1, ctx.B, [ctx.rows[i].y for i in idx[:-1]], [ctx.rows[i].params for i in idx],
        ab[0], ab[1] * ctx.delta)
    return _result(ctx, "df", p, comp, comm, mem, opts, reasons)


def _stages(times, p):
    """Contiguous partition of ``times`` into p stages minimising the largest stage."""
    lo, hi = max(times), sum(times)
    for _ in range(60):
        cap = (lo + hi) / 2
        if len(_greedy(times, cap)) <= p:
            hi = cap
        else:
            lo = cap
    stages = _greedy(times, hi)
    while len(stages) < p and any(len(s) > 1 for s in stages):
        k = max(range(len(stages)), key=lambda j: len(stages[j]))
        half = len(stages[k]) // 2
        stages[k:k + 1] = [stages[k][:half], stages[k][half:]]
    return stages


def _greedy(times, cap):
    stages, cur, acc = [], [], 0.0
    for i, t in enumerate(times):
        if cur and acc + t > cap * (1 + 1e-12):
            stages.append(cur)
            cur, acc = [], 0.0
        cur.append(i)
        acc += t
    stages.append(cur)
    return stages


@strategy("p")
def pipeline(ctx, p, segments=None, **_):
    """Table 3 row Layer (Pipeline), Eq. 12-14, with S micro-batches (searched)."""
    G = len(ctx.rows)
    if p > G:
        return _result(ctx, "p", p, math.inf, {}, 0.0, {"segments": None},
                       [f"p={p} exceeds the number of layers G={G} (limit p <= G)"])
    stages = _stages([f + 1e-30 for f in ctx.fb], p)
    options = [segments] if segments else divisors(ctx.B)
    return _best(_pipe_one(ctx, p, stages, S) for S in options)


def _pipe_one(ctx, p, stages, S):
    """One fill-drain step as tfhybrid runs it (:mod:`tfhybrid.oracle.schedule`):
    transfers run while the sending stage computes its next micro-batch, and
    only the stages computing at the same moment share the node's cores.
    ``compute_s`` is the step with free transfers; ``p2p`` what the transfers
    and the final broadcast of the predictions add to it."""
    from tfhybrid.oracle import schedule  # noqa: WPS433
    m, d, B = ctx.m, ctx.delta, ctx.B
    share, G = ctx.backward_share(), len(ctx.rows)
    # batch-independent forward+backward cost (op dispatch): every micro-batch pays its
    # stage's share of the layers' ops
    fixed = [m.compute_fixed_s * len(st) / G for st in stages]
    fw = [B / S * sum(ctx.fw[i] for i in st) + f * (1 - share) for st, f in zip(stages, fixed)]
    bw = [B / S * sum(ctx.bw[i] for i in st) + f * share for st, f in zip(stages, fixed)]
    wu = [sum(ctx.wu[i] for i in st) for st in stages]
    outs = [ctx.rows[st[-1]].y for st in stages[:-1]]
    # each transfer is one alltoall on the stage pair's process set; with several
    # micro-batches they follow one another on the link (Machine.t_p2p's streamed)
    xfer = [m.t_p2p(B / S * y * d, span=2, streamed=S > 1) for y in outs]
    bcast = m.t_broadcast(p, B * ctx.rows[-1].y * d)    # one collective: one latency
    slow, nodes = schedule.stage_slowdown(m), schedule.node_of(len(stages), m)
    comp = schedule.fill_drain(fw, bw, S, [0.0] * len(outs), slow, wu, nodes)
    step = schedule.fill_drain(fw, bw, S, xfer, slow, wu, nodes, bcast if p > 1 else 0.0)
    mem = max(ctx.mem((ctx.rows[i], B, 1, 1) for i in st) for st in stages)
    reasons = _batch_reasons(B, S, "segments S")
    opts = {"segments": S, "stages": [[ctx.rows[i].name for i in (st[0], st[-1])]
                                      for st in stages]}
    return _result(ctx, "p", p, comp, _phases(p2p=max(step - comp, 0.0)), mem, opts,
                   reasons, fixed=False)
