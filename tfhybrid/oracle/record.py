"""The :class:`Prediction` record and the per-layer cost context of one question.

A prediction is for **one iteration** (one global batch of ``B`` samples on
``p`` ranks). Communication is split by phase:

* ``FB-allgather``: allgathers of activations in forward/backward (and their
  adjoint reduce-scatters, same ring cost; the broadcasts and rooted reduces
  of SplitBrain's "B" scheme),
* ``FB-allreduce``: allreduces of activations or of their gradients,
* ``halo``: spatial halo exchanges (peer to peer),
* ``GE-allreduce``: the weight-gradient exchange,
* ``p2p``: pipeline / layer-separation activations sent peer to peer.

Example:
    >>> p = Prediction("d", 2, 8, 0.5, {"GE-allreduce": 0.1}, 0.0, 1e6, {}, True, ())
    >>> round(p.total_s, 3), p.per_epoch(80)["total_s"]
    (0.6, 6.0)
"""
from __future__ import annotations

import dataclasses
import math
from typing import Mapping

PHASES = ("FB-allgather", "FB-allreduce", "halo", "GE-allreduce", "p2p")


@dataclasses.dataclass(frozen=True)
class Prediction:
    """Predicted time and memory of one strategy for one iteration.

    Attributes:
        strategy: Strategy name (``d``, ``df``, ...).
        p: World size.
        batch: Global mini-batch B.
        compute_s: Forward + backward + weight-update time of the slowest rank.
        comm_s: Communication seconds by phase (every phase of ``PHASES``).
        overhead_s: Fixed per-iteration framework cost (machine.step_overhead_s).
        memory_bytes: Maximum memory of one rank.
        options: Choices the oracle made (grid, n_f, partitioned layers, ...).
        feasible: False when a limit is violated; ``reasons`` say which.
        reasons: Human-readable violated limits (empty when feasible).
        hidden_s: Communication seconds hidden behind computation (the
            machine's measured ``overlap`` of the gradient allreduce with
            back-propagation); subtracted once in ``total_s``.

    Example:
        >>> Prediction("serial", 1, 4, 1.0, {}, 0.0, 0, {}, True, ()).comm_total_s
        0.0
    """

    strategy: str
    p: int
    batch: int
    compute_s: float
    comm_s: Mapping[str, float]
    overhead_s: float
    memory_bytes: float
    options: Mapping
    feasible: bool
    reasons: tuple
    hidden_s: float = 0.0

    def __post_init__(self):
        comm = {ph: float(self.comm_s.get(ph, 0.0)) for ph in PHASES}
        extra = set(self.comm_s) - set(PHASES)
        if extra:
            raise ValueError(f"Unknown communication phases {sorted(extra)}; use {PHASES}.")
        object.__setattr__(self, "comm_s", comm)
        object.__setattr__(self, "reasons", tuple(self.reasons))

    @property
    def comm_total_s(self) -> float:
        return sum(self.comm_s.values())

    @property
    def total_s(self) -> float:
        """compute + all communication phases - hidden communication + overhead."""
        return self.compute_s + self.comm_total_s - self.hidden_s + self.overhead_s

    @property
    def throughput(self) -> float:
        """Samples per second."""
        return self.batch / self.total_s if self.total_s > 0 else float("inf")

    def per_epoch(self, dataset_size: int) -> dict:
        """Seconds per epoch of ``dataset_size`` samples (D/B iterations, as ParaDL).

        Example:
            >>> Prediction("d", 2, 10, 1.0, {}, 0.0, 0, {}, True, ()).per_epoch(100)["compute_s"]
            10.0
        """
        if dataset_size <= 0:
            raise ValueError(f"Received dataset_size={dataset_size!r}; expected a positive "
                             "number of samples.")
        it = dataset_size / self.batch
        out = {"iterations": it, "compute_s": self.compute_s * it,
               "comm_s": {k: v * it for k, v in self.comm_s.items()},
               "overhead_s": self.overhead_s * it, "hidden_s": self.hidden_s * it}
        out["comm_total_s"] = self.comm_total_s * it
        out["total_s"] = self.total_s * it
        return out

    def to_dict(self) -> dict:
        """JSON-friendly dict (adds total_s and comm_total_s)."""
        out = dataclasses.asdict(self)
        out["comm_s"] = dict(self.comm_s)
        out["reasons"] = list(self.reasons)
        out["total_s"] = self.total_s
        out["comm_total_s"] = self.comm_total_s
        return out


class Context:
    """Per-layer seconds of one (profile, machine, batch) question.

    ``fw[i]``/``bw[i]`` are seconds per sample of row i on one rank (from
    ``machine.layer_times`` when it names the layer, else FLOPs / flop_rate);
    ``wu[i]`` is the weight-update seconds per iteration.
    """

    def __init__(self, prof, machine, batch: int):
        self.prof, self.m, self.B = prof, machine, batch
        self.rows = prof.rows
        self.delta = machine.bytes_per_item
        self.fw, self.bw, self.wu = [], [], []
        times = machine.layer_times or {}
        for r in self.rows:
            if r.name in times:
                fw, bw = times[r.name]
            elif machine.flop_rate:
                fw, bw = r.fwd_flops / machine.flop_rate, r.bwd_flops / machine.flop_rate
            else:
                raise ValueError(f"machine.layer_times has no entry for layer {r.name!r} and "
                                 "the machine has no flop_rate to fall back on; add one.")
            self.fw.append(fw)
            self.bw.append(bw)
            rate = machine.flop_rate
            self.wu.append(machine.wu_flops_per_param * r.params / rate if rate else 0.0)
        self.fb = [f + b for f, b in zip(self.fw, self.bw)]
        self.split = getattr(prof, "split", None)

    def split_share(self, i: int, how: str, k: int) -> float:
        """Share of row i's per-sample seconds one rank pays when the row is split
        ``k`` ways by output units (``how="f"``) or input channels (``"c"``):
        the machine's calibrated ``split_scales``, else 1/k."""
        return self.m.split_share(self.rows[i].name, how, k)

    def spatial_share(self, i: int, grid) -> float:
        """Share of row i's per-sample seconds one rank pays on its block of the
        spatial block grid ``grid``: the machine's calibrated ``split_scales``,
        else the block's fraction of the row's output (ceil(e / parts) / e per
        split axis)."""
        r, frac = self.rows[i], 1.0
        for axis, parts in enumerate(grid):
            if parts > 1 and axis < len(r.spatial_out):
                e = r.spatial_out[axis]
                frac *= math.ceil(e / parts) / e
        return self.m.spatial_share(r.name, grid, frac)

    def batch_norm_sync_s(self, group: int) -> float:
        """Seconds of the moment allreduces of every BatchNormalization row over
        ``group`` ranks: sums and count (C + 1 items), then squared deviations
        (C), forward, and their adjoints backward (0 when ``group`` is 1)."""
        if group <= 1:
            return 0.0
        total = 0.0
        for r in self.rows:
            if getattr(r, "batch_stats", False):
                c = r.channels
                total += 2 * (self.m.t_allreduce(group, (c + 1) * self.delta)
                              + self.m.t_allreduce(group, c * self.delta))
        return total

    def backward_share(self) -> float:
        """Backward share of the forward+backward seconds (0 for an empty model)."""
        total = sum(self.fb)
        return sum(self.bw) / total if total > 0 else 0.0

    def mem(self, terms) -> float:
        """gamma delta sum(2 nb (x + y)/a + 2 w/wd + bi) over (row, nb, a, wd) terms."""
        total = 0.0
        for r, nb, a, wd in terms:
            total += 2 * nb * (r.x + r.y) / a + 2 * r.weights / wd + r.biases
        return self.m.gamma * self.delta * total

    def weighted(self):
        """Indices of rows with weights (conv / dense), limited by a layer configuration."""
        return [i for i, r in enumerate(self.rows) if r.kind in ("conv", "dense") and r.weights
                and (self.split is None or self.split[i])]

    def spatial_prefix(self):
        """Indices of the leading rows whose output keeps spatial axes."""
        out = []
        for i, r in enumerate(self.rows):
            if r.kind == "dense" or not r.spatial_out:
                break
            if self.split is None or self.split[i]:
                out.append(i)
        return out

    def first_dense(self):
        """Index of the first dense row (len(rows) when none)."""
        for i, r in enumerate(self.rows):
            if r.kind == "dense":
                return i
        return len(self.rows)

    def memory_reasons(self, mem) -> list:
        cap = self.m.memory_bytes
        if cap and mem > cap:
            return [f"memory per rank {mem / 1e9:.3g} GB exceeds the machine's "
                    f"memory_bytes {cap / 1e9:.3g} GB"]
        return []


def divisors(n: int):
    """Positive divisors of n in increasing order."""
    return [d for d in range(1, n + 1) if n % d == 0]
