"""The machine specification the oracle predicts for, and its collective costs.

A :class:`Machine` is explicit: every prediction names the machine it assumes
(a dict, a JSON file of the same keys, or the object itself). It owns the
Hockney alpha-beta cost of the collectives that ParaDL (Section 4.3) uses:

* ``T_p2p(m) = alpha + m beta``
* ``T_ar(p, m) = 2 (p - 1) (alpha + m / p beta)``  (ring allreduce of m bytes)
* ``T_ag(p, m) = (p - 1) (alpha + m beta)``        (ring allgather, m bytes per rank)
* ``T_rs(p, m) = (p - 1) (alpha + m / p beta)``    (ring reduce-scatter of m bytes)
* ``T_a2a(p, m) = (p - 1) (alpha + m / p beta)``   (pairwise all-to-all of m bytes)
* ``T_halo(p, m) = (p - 1) alpha + m beta``          (an all-to-all sending m bytes
  to neighbours only: tfhybrid's halo exchange)

Each collective (and each peer-to-peer exchange) also pays ``latency``
(lambda) once: the runtime's fixed cost per collective, whatever its size or
ring length (Horovod's negotiation between ranks, dispatch from the graph).
It is 0 in the papers and for ParaDL's tiers; calibration fits it beside
alpha and beta, and on an oversubscribed CPU node it dominates (lambda
well above alpha).

Collective kinds. One link does not cost every collective alike: Horovod
and Gloo run each kind with its own algorithm, so their fixed costs and
their bytes per second differ (between two test hosts at 100 Mbit/s a 30 KB
allreduce took 1.9 ms where a 30 KB allgather took 1.2 ms; a stock Gloo
allgather or alltoall also sends one direction of the link after the other,
which ``patches/horovod/0101-gloo-receive-before-send.patch`` fixes). A tier
(or the machine) may therefore carry ``collectives``: ``{kind: {"latency",
"alpha", "beta"}}`` for ``allreduce``, ``allgather``, ``alltoall``,
``broadcast`` or ``p2p``, fitted by calibration from that kind's own timings; a cost function
uses its kind's entry and falls back to the tier's own numbers. The alltoall
entry also prices tfhybrid's reduce-scatter, rooted reduce and halo
exchange, which are alltoalls. ``p2p`` prices a transfer one way (the
pipeline's and the layer separation's): tfhybrid sends it as an alltoall
too, but only one direction of the link carries data; without a ``p2p``
entry the alltoall's serves.

Bursts and streamed transfers. A kind's costs are fitted to collectives
timed one at a time on an idle link, as a step issues them with compute
between. A link that lets a short burst through at once (a switch's buffer,
the token bucket of a shaped test link) carries the first bytes of such a
collective at no cost: between two test hosts shaped to 100 Mbit/s every
kind took 1.2-1.3 ms from 4 to 30 KB, then 80 ns a byte. An entry may
therefore carry ``burst_bytes``: the bytes one rank sends that cost no
beta; a collective pays ``beta`` only for the bytes beyond it (calibration
fits it with latency and beta, 0 where the link has no burst). A pipeline's
micro-batches follow one another on the link, the burst is spent, and each
pays the fixed cost and every byte (32 micro-batches of 32 KB took 227 ms a
step where free fixed costs predicted 170). An entry may also carry
``stream_latency``: the fixed cost of a transfer that follows another, which
``t_p2p(..., streamed=True)`` uses instead of ``latency``, without the
burst; calibration sets it for ``p2p`` to the smallest message's time less
its bytes at the kind's beta (at least 0).

Approximations (what this model ignores): the collective algorithm switch
(tree for small messages), link topology other than through tiers, external
congestion (only self-contention via ``phi``), and overlap of communication
with computation. Tiers pick alpha/beta by the number of consecutive ranks a
group spans (``group size x stride``), so a data group whose members sit on
different nodes pays the inter-node tier even when it has few members; a
group whose span fits in one node (``ranks_per_node``) uses its size.

Example:
    >>> m = Machine(alpha=1e-5, beta=1e-9, flop_rate=1e10)
    >>> round(m.t_allreduce(4, 4e6), 6)
    0.00606
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from typing import Any, Mapping

COLLECTIVE_KINDS = ("allreduce", "allgather", "alltoall", "broadcast", "p2p")
_COST_KEYS = ("latency", "alpha", "beta")
_OPTIONAL_COST_KEYS = ("stream_latency", "burst_bytes")

_NUMBER_FIELDS = ("alpha", "beta", "latency", "flop_rate", "memory_bytes", "phi", "gamma",
                  "bytes_per_item", "step_overhead_s", "compute_slots", "wu_flops_per_param",
                  "compute_fixed_s", "overlap")


def _check_number(name, value, allow_zero=True, allow_none=False):
    if value is None and allow_none:
        return
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value < 0 or (value == 0 and not allow_zero):
        need = "a non-negative" if allow_zero else "a positive"
        raise ValueError(f"Received an invalid machine value `{name}`={value!r}; "
                         f"expected {need} finite number.")


@dataclasses.dataclass(frozen=True)
class Tier:
    """alpha/beta for groups spanning at most ``max_ranks`` consecutive ranks.

    Example:
        >>> Tier(max_ranks=4, alpha=9e-6, beta=1e-11).max_ranks
        4
    """

    max_ranks: int
    alpha: float
    beta: float
    latency: float = 0.0
    collectives: Mapping[str, Mapping[str, float]] | None = None

    def __post_init__(self):
        object.__setattr__(self, "collectives", _check_collectives(
            self.collectives, f"tiers[max_ranks={self.max_ranks}].collectives"))
        if isinstance(self.max_ranks, bool) or not isinstance(self.max_ranks, int) \
                or self.max_ranks < 1:
            raise ValueError(f"Received an invalid tier `max_ranks`={self.max_ranks!r}; "
                             "expected a positive integer.")
        _check_number("tiers[].alpha", self.alpha)
        _check_number("tiers[].beta", self.beta)
        _check_number("tiers[].latency", self.latency)


@dataclasses.dataclass(frozen=True)
class Machine:
    """Per-rank compute, memory and network parameters.

    Attributes:
        alpha: Latency per message (s); used for groups beyond every tier.
        beta: Time per byte (s/B); used for groups beyond every tier.
        latency: Fixed cost per collective (s), added once to each
            collective's ring cost; used for groups beyond every tier.
        collectives: Optional ``{kind: {"latency": s, "alpha": s, "beta":
            s/B}}`` per collective kind (``allreduce``, ``allgather``,
            ``alltoall``, ``broadcast``, ``p2p``) for groups beyond every tier,
            optionally with ``burst_bytes`` and ``stream_latency`` (module
            docstring); a kind not listed uses latency/alpha/beta. Tiers may
            carry their own.
        tiers: Optional alpha/beta by group span, sorted by ``max_ranks``.
        flop_rate: Sustained FLOP/s of one rank (needed unless ``layer_times``
            covers every layer).
        layer_times: Measured ``{layer_name: (forward_s, backward_s)}`` per
            sample; these override ``flop_rate`` for the layers they name.
        split_scales: Measured ``{layer_name: {"f4": share, "c2": share,
            "s2x2": share, ...}}``: the fraction of the layer's whole
            forward+backward time one rank pays when the layer is split k
            ways by output units (``f<k>``) or input channels (``c<k>``), or
            its spatial axes by a block grid (``s<ph>x<pw>``, trailing 1s
            dropped: ``s4`` is 4 ways along the first axis), timed at the split
            size by ``tfhybrid calibrate --model``. Small layers do not speed
            up k times (a small convolution split 4 ways by filters can take
            well over half its whole time, not 0.25: per-op overheads do not
            shrink with the split); without an
            entry the share is 1/k (f, c) or the block's fraction of the
            output (s).
        memory_bytes: Memory capacity of one rank (None: no memory limit).
        phi: Contention penalty: beta is multiplied by phi for the data-parallel
            gradient allreduce of hybrid strategies whose concurrent groups share
            links (ParaDL uses 2 for Data+Filter on ABCI).
        gamma: Memory reuse factor applied to the naive memory estimate.
        bytes_per_item: delta, bytes per value (4 for float32).
        step_overhead_s: Fixed framework cost per iteration (measured by
            calibration; 0 in the papers).
        compute_fixed_s: Forward+backward seconds per iteration that do not
            grow with the batch (per-op dispatch; the intercept of the
            model's time against its batch size, measured by calibration
            with ``--model``; 0 in the papers). ``layer_times`` are then the
            slope: seconds per additional sample. Added once per iteration
            on every rank, whatever the strategy.
        compute_slots: Ranks that can compute concurrently on one node without
            slowing each other (cores / threads per rank, or GPUs per node);
            None means never oversubscribed. When more ranks share a node,
            compute time is scaled by ``ranks_on_node / compute_slots``.
        compute_contention: Measured slowdown of compute when a number of
            ranks run at once on one node, ``{ranks_on_node: factor}`` (JSON
            keys may be strings): the slowest rank's forward+backward with
            every rank computing, over one rank computing alone. Calibration
            measures it at its own world size; where it names the ranks on
            the node it replaces the ``compute_slots`` model (which ignores
            memory bandwidth, Horovod's background threads and the
            scheduler).
        ranks_per_node: Ranks placed on one node (None: all ranks on one node).
        wu_flops_per_param: FLOPs of the weight update per parameter (SGD: 2).
        overlap: Fraction (0..1) of the weight-gradient allreduce that runs
            hidden behind back-propagation (Lee et al.'s overlap, R in their
            Eq. 11), at most the backward time. Measured by
            ``tfhybrid calibrate --model`` (a step with the reduction vs its
            compute and its reduction timed apart); 0 (the papers' Table 3:
            nothing hidden) when not measured.
        source: Free text saying where the numbers come from.

    Example:
        >>> Machine.from_dict({"alpha": 1e-5, "beta": 1e-9, "flop_rate": 1e10}).phi
        1.0
    """

    alpha: float
    beta: float
    latency: float = 0.0
    tiers: tuple = ()
    flop_rate: float | None = None
    layer_times: Mapping[str, tuple] | None = None
    split_scales: Mapping[str, Mapping[str, float]] | None = None
    memory_bytes: float | None = None
    phi: float = 1.0
    gamma: float = 1.0
    bytes_per_item: float = 4.0
    step_overhead_s: float = 0.0
    compute_slots: int | None = None
    ranks_per_node: int | None = None
    compute_contention: Mapping[int, float] | None = None
    wu_flops_per_param: float = 2.0
    compute_fixed_s: float = 0.0
    overlap: float = 0.0
    collectives: Mapping[str, Mapping[str, float]] | None = None
    source: str = ""

    def __post_init__(self):
        object.__setattr__(self, "collectives",
                           _check_collectives(self.collectives, "collectives"))
        for name in _NUMBER_FIELDS:
            optional = name in ("flop_rate", "memory_bytes", "compute_slots")
            _check_number(name, getattr(self, name), allow_zero=name not in (
                "flop_rate", "memory_bytes", "phi", "gamma", "bytes_per_item",
                "compute_slots"), allow_none=optional)
        if self.overlap > 1:
            raise ValueError(f"Received an invalid machine value `overlap`={self.overlap!r}; "
                             "expected a fraction between 0 and 1 (the share of the gradient "
                             "allreduce hidden behind back-propagation).")
        if self.flop_rate is None and not self.layer_times:
            raise ValueError("The machine needs `flop_rate` (FLOP/s per rank) or `layer_times` "
                             "(per-layer forward/backward seconds per sample); received neither. "
                             "Run `tfhybrid calibrate` or pass flop_rate=...")
        tiers = tuple(t if isinstance(t, Tier) else _tier_from(t) for t in self.tiers)
        object.__setattr__(self, "tiers", tuple(sorted(tiers, key=lambda t: t.max_ranks)))
        if self.layer_times is not None:
            object.__setattr__(self, "layer_times", _check_layer_times(self.layer_times))
        if self.split_scales is not None:
            object.__setattr__(self, "split_scales", _check_split_scales(self.split_scales))
        if self.compute_contention is not None:
            object.__setattr__(self, "compute_contention",
                               _check_contention(self.compute_contention))

    # -- construction ------------------------------------------------------
    @classmethod
    def from_dict(cls, spec: Mapping[str, Any]) -> "Machine":
        """Build from a dict of the documented keys; unknown keys raise ValueError.

        Example:
            >>> Machine.from_dict({"alpha": 0, "beta": 0, "flop_rate": 1e9}).flop_rate
            1000000000.0
        """
        if not isinstance(spec, Mapping):
            raise TypeError(f"`machine` must be a dict, a JSON path or a Machine; "
                            f"received {type(spec).__name__}.")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(spec) - known - {"_comment", "comment", "fits"})
        if unknown:
            raise ValueError(f"Unknown machine keys {unknown}; known keys: {sorted(known)}.")
        missing = [k for k in ("alpha", "beta") if k not in spec]
        if missing:
            raise ValueError(f"The machine spec lacks required keys {missing} "
                             "(latency alpha in s, inverse bandwidth beta in s/byte).")
        kwargs = {k: v for k, v in spec.items() if k in known}
        for k in ("flop_rate", "memory_bytes", "alpha", "beta", "latency"):
            if isinstance(kwargs.get(k), int) and not isinstance(kwargs.get(k), bool):
                kwargs[k] = float(kwargs[k])
        kwargs["tiers"] = tuple(kwargs.get("tiers") or ())
        return cls(**kwargs)

    @classmethod
    def load(cls, path: str | os.PathLike) -> "Machine":
        """Read a machine JSON file (the format ``tfhybrid calibrate`` writes)."""
        with open(path, encoding="utf-8") as fh:
            return cls.from_dict(json.load(fh))

    def to_dict(self) -> dict:
        """JSON-serialisable dict that :meth:`from_dict` reads back."""
        out = dataclasses.asdict(self)
        out["tiers"] = [dataclasses.asdict(t) for t in self.tiers]
        if self.layer_times is not None:
            out["layer_times"] = {k: list(v) for k, v in self.layer_times.items()}
        if self.compute_contention is not None:
            out["compute_contention"] = {str(k): v for k, v in self.compute_contention.items()}
        if self.split_scales is not None:
            out["split_scales"] = {k: dict(v) for k, v in self.split_scales.items()}
        return out

    def split_share(self, layer: str, how: str, k: int) -> float:
        """Fraction of ``layer``'s whole forward+backward seconds one rank pays
        when the layer is split ``k`` ways by output units (``how="f"``) or
        input channels (``"c"``): the calibrated ``split_scales`` entry, else 1/k.

        Example:
            >>> m = Machine(alpha=0, beta=0, flop_rate=1.0, split_scales={"conv": {"f4": 0.6}})
            >>> m.split_share("conv", "f", 4), m.split_share("conv", "c", 4), m.split_share("x", "f", 1)
            (0.6, 0.25, 1.0)
        """
        if k <= 1:
            return 1.0
        share = self._measured_share(layer, f"{how}{k}")
        return 1.0 / k if share is None else share

    def spatial_share(self, layer: str, grid, default: float) -> float | None:
        """Fraction of ``layer``'s whole forward+backward seconds one rank pays on
        its block of the spatial block grid ``grid`` (parts per spatial axis):
        the calibrated ``split_scales`` entry ``s<ph>x<pw>...``, else ``default``.

        Example:
            >>> m = Machine(alpha=0, beta=0, flop_rate=1.0, split_scales={"conv": {"s2x2": 0.4}})
            >>> m.spatial_share("conv", (2, 2), 0.25), m.spatial_share("conv", (4, 1), 0.25)
            (0.4, 0.25)
        """
        share = self._measured_share(layer, spatial_key(grid))
        return default if share is None else share

    def _measured_share(self, layer: str, key: str) -> float | None:
        """The ``split_scales`` entry ``key`` of ``layer``, or None."""
        return (self.split_scales or {}).get(layer, {}).get(key)

    def replace(self, **changes) -> "Machine":
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    # -- network -----------------------------------------------------------
    def alpha_beta(self, span: int) -> tuple:
        """(alpha, beta) of the first tier whose ``max_ranks`` >= ``span``."""
        return self._tier(span)[1:]

    def latency_of(self, span: int) -> float:
        """The fixed cost per collective (lambda) of groups spanning ``span`` ranks."""
        return self._tier(span)[0]

    def _span(self, p, span):
        """The tier key of a group of ``p`` ranks spanning ``span`` consecutive ranks:
        the span when the group may cross nodes, its size when the span fits in
        one node of ``ranks_per_node`` (no inter-node link is used)."""
        if span is None or (self.ranks_per_node and span <= self.ranks_per_node):
            return p
        return span

    def _entry(self, span, kind):
        """The tier holding a group of span ``span`` and its ``collectives[kind]``
        (None: not calibrated; p2p falls back to the alltoall's)."""
        owner = next((t for t in self.tiers if span <= t.max_ranks), self)
        table = owner.collectives or {}
        own = table.get(kind, table.get("alltoall") if kind == "p2p" else None) if kind \
            else None
        return owner, own

    @staticmethod
    def _numbers(owner, own, streamed):
        """(latency, alpha, beta) of a tier's entry ``own`` (None: the tier's own
        numbers); ``streamed``: the entry's ``stream_latency`` when it has one."""
        if own is None:
            return owner.latency, owner.alpha, owner.beta
        lat = own.get("stream_latency", own["latency"]) if streamed else own["latency"]
        return lat, own["alpha"], own["beta"]

    def _tier(self, span, kind=None, streamed=False):
        """(latency, alpha, beta) of collective ``kind`` (None: the generic
        numbers) for a group of span ``span``: the first tier holding it, its
        ``collectives[kind]`` when calibrated, else the tier's own numbers;
        ``streamed``: the entry's ``stream_latency`` when it has one."""
        return self._numbers(*self._entry(span, kind), streamed)

    def _cost(self, span, kind, messages, nbytes, streamed=False):
        """lambda + ``messages`` alpha + beta x the ``nbytes`` one rank sends beyond
        the kind's ``burst_bytes`` (none when ``streamed``: the transfer follows
        another, the burst is spent)."""
        owner, own = self._entry(span, kind)
        lat, a, b = self._numbers(owner, own, streamed)
        burst = 0.0 if streamed or own is None else own.get("burst_bytes", 0.0)
        return lat + messages * a + max(nbytes - burst, 0.0) * b

    def collective_cost(self, kind: str, span: int) -> tuple:
        """(latency, alpha, beta) a collective of ``kind`` pays in a group of
        span ``span`` (see the module docstring's collective kinds).

        Example:
            >>> m = Machine(alpha=0.0, beta=1e-9, flop_rate=1.0,
            ...             collectives={"allgather": {"latency": 1e-3, "alpha": 0, "beta": 2e-9}})
            >>> m.collective_cost("allgather", 8), m.collective_cost("allreduce", 8)
            ((0.001, 0.0, 2e-09), (0.0, 0.0, 1e-09))
        """
        if kind not in COLLECTIVE_KINDS:
            raise ValueError(f"Received kind={kind!r}; expected one of {COLLECTIVE_KINDS}.")
        return self._tier(span, kind)

    def t_p2p(self, nbytes: float, span: int = 2, streamed: bool = False) -> float:
        """Point-to-point message of ``nbytes``: lambda + alpha + m beta, with the
        ``p2p`` kind's numbers (else the alltoall's: tfhybrid sends one as an alltoall
        on the pair's process set). ``streamed``: the message follows another on the
        link (a pipeline's micro-batches), so lambda is the kind's ``stream_latency``
        when calibrated (see the module docstring).

        Example:
            >>> m = Machine(alpha=0.0, beta=1e-9, flop_rate=1.0, collectives={
            ...     "p2p": {"latency": 0.0, "alpha": 0.0, "beta": 1e-8, "stream_latency": 1e-3}})
            >>> m.t_p2p(1e5), m.t_p2p(1e5, streamed=True)
            (0.001, 0.002)
        """
        return self._cost(span, "p2p", 1, nbytes, streamed)

    def t_allreduce(self, p: int, nbytes: float, span: int | None = None, phi: float = 1.0):
        """Ring allreduce of ``nbytes`` over ``p`` ranks: 2(p-1)(alpha + m/p beta phi).

        Nothing to reduce (p <= 1 or 0 bytes) costs 0.
        """
        if p <= 1 or nbytes <= 0:
            return 0.0
        return self._cost(self._span(p, span), "allreduce", 2 * (p - 1),
                          2 * (p - 1) * nbytes / p * phi)

    def t_allgather(self, p: int, nbytes_per_rank: float, span: int | None = None):
        """Ring allgather, ``nbytes_per_rank`` from each rank: (p-1)(alpha + m beta)."""
        if p <= 1:
            return 0.0
        return self._cost(self._span(p, span), "allgather", p - 1, (p - 1) * nbytes_per_rank)

    def t_reducescatter(self, p: int, nbytes: float, span: int | None = None):
        """Ring reduce-scatter of ``nbytes`` (result m/p per rank): (p-1)(alpha + m/p beta)."""
        if p <= 1:
            return 0.0
        return self._cost(self._span(p, span), "alltoall", p - 1, (p - 1) * nbytes / p)

    def t_broadcast(self, p: int, nbytes: float, span: int | None = None):
        """Binomial-tree broadcast of ``nbytes`` from one rank: ceil(log2 p)(alpha + m beta)."""
        if p <= 1 or nbytes <= 0:
            return 0.0
        steps = math.ceil(math.log2(p))
        return self._cost(self._span(p, span), "broadcast", steps, steps * nbytes)

    def t_reduce(self, p: int, nbytes: float, span: int | None = None):
        """Direct rooted reduce of ``nbytes``: the root receives p-1 copies (tfhybrid's
        ``comm.broadcast`` backward, one alltoall): (p-1)(alpha + m beta)."""
        if p <= 1 or nbytes <= 0:
            return 0.0
        return self._cost(self._span(p, span), "alltoall", p - 1, (p - 1) * nbytes)

    def t_neighbours(self, p: int, nbytes_sent: float, span: int | None = None,
                     kind: str = "alltoall"):
        """One alltoall over ``p`` ranks in which the busiest rank sends
        ``nbytes_sent`` in all, to its neighbours only (tfhybrid's halo
        exchange): lambda + (p-1) alpha + m beta. Gloo's alltoall visits every
        peer in turn, empty splits included, so each costs alpha. ``kind="p2p"``:
        the data moves one way (the layer separation's transfers), at that kind's cost.

        Example:
            >>> Machine(alpha=1.0, beta=0.5, latency=0.25, flop_rate=1.0).t_neighbours(4, 8)
            7.25
        """
        if p <= 1:
            return 0.0
        return self._cost(self._span(p, span), kind, p - 1, nbytes_sent)

    def t_alltoall(self, p: int, nbytes: float, span: int | None = None):
        """Pairwise all-to-all of ``nbytes`` per rank: (p-1)(alpha + m/p beta)."""
        return self.t_reducescatter(p, nbytes, span)

    # -- compute -----------------------------------------------------------
    def oversubscription(self, p: int) -> float:
        """Compute slowdown of ``p`` ranks: the measured ``compute_contention``
        for the ranks on one node when calibration measured that count, else
        ``ranks_on_node / compute_slots`` (at least 1).

        Example:
            >>> m = Machine(alpha=0, beta=0, flop_rate=1.0, compute_slots=2)
            >>> m.oversubscription(4), m.replace(compute_contention={4: 2.5}).oversubscription(4)
            (2.0, 2.5)
        """
        on_node = min(p, self.ranks_per_node) if self.ranks_per_node else p
        if self.compute_contention and on_node in self.compute_contention:
            return self.compute_contention[on_node]
        if not self.compute_slots:
            return 1.0
        return max(1.0, on_node / self.compute_slots)


def _tier_from(t) -> Tier:
    if not isinstance(t, Mapping) \
            or set(t) - {"max_ranks", "alpha", "beta", "latency", "collectives"} \
            or not {"max_ranks", "alpha", "beta"} <= set(t):
        raise ValueError(f"Received an invalid tier {t!r}; expected "
                         "{'max_ranks': int, 'alpha': float, 'beta': float} and optionally "
                         "'latency': float and 'collectives': {kind: {latency, alpha, beta}}.")
    return Tier(int(t["max_ranks"]) if isinstance(t["max_ranks"], float)
                and t["max_ranks"].is_integer() else t["max_ranks"],
                float(t["alpha"]), float(t["beta"]), float(t.get("latency", 0.0)),
                t.get("collectives"))


def _check_collectives(table, where) -> dict | None:
    """``{kind: {"latency", "alpha", "beta"}}`` checked and copied (floats); None stays None."""
    if table is None:
        return None
    if not isinstance(table, Mapping):
        raise ValueError(f"`{where}` must map collective kinds to {{latency, alpha, beta}}; "
                         f"received {type(table).__name__}.")
    out = {}
    for kind, cost in table.items():
        if kind not in COLLECTIVE_KINDS:
            raise ValueError(f"`{where}` names kind {kind!r}; expected kinds of "
                             f"{COLLECTIVE_KINDS}.")
        if not isinstance(cost, Mapping) or not set(_COST_KEYS) <= set(cost) \
                or set(cost) - set(_COST_KEYS) - set(_OPTIONAL_COST_KEYS):
            raise ValueError(f"`{where}[{kind!r}]`={cost!r}; expected the keys "
                             f"{_COST_KEYS} (seconds, seconds, seconds per byte) and "
                             f"optionally {_OPTIONAL_COST_KEYS} (seconds, bytes).")
        keys = [k for k in (*_COST_KEYS, *_OPTIONAL_COST_KEYS) if k in cost]
        for key in keys:
            _check_number(f"{where}[{kind!r}].{key}", cost[key])
        out[kind] = {key: float(cost[key]) for key in keys}
    return out


def _check_layer_times(times) -> dict:
    if not isinstance(times, Mapping):
        raise ValueError(f"`layer_times` must map layer names to (forward_s, backward_s); "
                         f"received {type(times).__name__}.")
    out = {}
    for name, value in times.items():
        if not isinstance(value, (list, tuple)) or len(value) != 2:
            raise ValueError(f"`layer_times[{name!r}]`={value!r}; expected "
                             "(forward_s, backward_s) per sample.")
        for v in value:
            _check_number(f"layer_times[{name!r}]", v)
        out[str(name)] = (float(value[0]), float(value[1]))
    return out


_SPLIT_KEY = re.compile(r"^([fc][1-9][0-9]*|s[1-9][0-9]*(x[1-9][0-9]*)*)$")


def spatial_key(grid) -> str:
    """The ``split_scales`` key of a spatial block grid: ``s`` and the parts per
    axis joined by ``x``, trailing 1s dropped (``(4, 1)`` -> ``"s4"``, ``(2, 2)``
    -> ``"s2x2"``, ``(1, 4)`` -> ``"s1x4"``).

    Example:
        >>> spatial_key((4, 1)), spatial_key((1, 2, 1)), spatial_key((1, 1))
        ('s4', 's1x2', 's1')
    """
    parts = [int(g) for g in grid]
    while len(parts) > 1 and parts[-1] == 1:
        parts.pop()
    return "s" + "x".join(str(g) for g in parts)


def _check_split_scales(table) -> dict:
    if not isinstance(table, Mapping):
        raise ValueError(f"`split_scales` must map layer names to {{'f<k>'|'c<k>': share}}; "
                         f"received {type(table).__name__}.")
    out = {}
    for name, shares in table.items():
        if not isinstance(shares, Mapping):
            raise ValueError(f"`split_scales[{name!r}]`={shares!r}; expected a dict such as "
                             "{'f2': 0.6, 'c2': 0.7} (share of the whole layer's time).")
        row = {}
        for key, share in shares.items():
            if not _SPLIT_KEY.match(str(key)):
                raise ValueError(f"`split_scales[{name!r}]` key {key!r} is not 'f<k>' (split "
                                 "by output units k ways), 'c<k>' (by input channels) or "
                                 "'s<ph>x<pw>' (a spatial block grid).")
            _check_number(f"split_scales[{name!r}][{key!r}]", share, allow_zero=False)
            row[str(key)] = float(share)
        out[str(name)] = row
    return out


def _check_contention(table) -> dict:
    if not isinstance(table, Mapping):
        raise ValueError(f"`compute_contention` must map ranks on a node to a slowdown factor, "
                         f"e.g. {{'4': 2.3}}; received {type(table).__name__}.")
    out = {}
    for ranks, factor in table.items():
        try:
            n = int(ranks)
        except (TypeError, ValueError):
            n = 0
        if n < 1 or str(n) != str(ranks).strip():
            raise ValueError(f"`compute_contention` key {ranks!r} is not a positive rank count.")
        _check_number(f"compute_contention[{ranks!r}]", factor, allow_zero=False)
        out[n] = float(factor)
    return out


def as_machine(machine) -> Machine:
    """Accept a :class:`Machine`, a dict or a JSON path; anything else raises.

    Example:
        >>> as_machine({"alpha": 0, "beta": 0, "flop_rate": 1e9}).gamma
        1.0
    """
    if isinstance(machine, Machine):
        return machine
    if isinstance(machine, (str, os.PathLike)):
        if not os.path.exists(machine):
            raise ValueError(f"Machine file {str(machine)!r} does not exist; create one with "
                             "`horovodrun -np N tfhybrid calibrate -o machine.json`.")
        return Machine.load(machine)
    if machine is None:
        raise ValueError("`machine` is required: pass a dict, a JSON path or a Machine "
                         "(see tfhybrid.oracle.default_machine_path() for this box's "
                         "calibrated spec).")
    return Machine.from_dict(machine)


def cluster_machine_path() -> str:
    """Path of the shipped GPU-cluster machine: ParaDL's ABCI platform (V100
    16 GB, 7.8 TFLOP/s, 4 GPUs per node) with its per-tier alpha/beta. The
    default of ``tfhybrid plan`` when no ``--machine`` is given.
    """
    return os.path.join(os.path.dirname(__file__), "machines", "abci_v100.json")


def default_machine_path() -> str:
    """Path of the calibrated machine JSON shipped for the development CPU box
    (2 cores, 4 ranks; see its ``comment`` and ``source``).

    ``tfhybrid.transform(model, "auto", batch_size=...)`` uses it when no
    ``machine=`` is given; ``tfhybrid plan`` uses it only with
    ``--machine`` (its default is ParaDL's ABCI platform). Calibrate your
    own with ``tfhybrid calibrate``.
    """
    return os.path.join(os.path.dirname(__file__), "machines", "cpu_box.json")


def allreduce_link(path, p: int, span: int) -> tuple:
    """(fixed seconds, seconds per payload byte) of an allreduce over ``p`` ranks
    spanning ``span`` on the machine file ``path`` (``DistributedOptimizer``'s
    ``bucket_bytes="auto"``).

    Raises:
        ValueError: the file cannot be read as a machine (named in the message).
    """
    try:
        m = Machine.load(path)
    except (OSError, ValueError, TypeError) as err:
        raise ValueError(f"TFHYBRID_MACHINE={path!r}: cannot read it as a machine file "
                         f"({err}); give the JSON `tfhybrid calibrate -o` wrote, or unset "
                         "TFHYBRID_MACHINE (buckets of 25 MiB).") from err
    if p <= 1:
        return 0.0, 0.0
    probe = float(2**20)
    one, more = m.t_allreduce(p, 1.0, span), m.t_allreduce(p, 1.0 + probe, span)
    per_byte = (more - one) / probe
    return max(one - per_byte, 0.0), per_byte
