"""Gradient reduction plan: which ranks reduce each gradient, by what factor,
and how gradients are packed into fusion buckets.

The rule follows each variable's :class:`tfhybrid.layout.VariableLayout`
(see :mod:`tfhybrid.layout`), so that after reduction every gradient equals
the single-process gradient of the mean loss over the global batch:

=============  ===================================  ==========================
kind           ranks that reduce (sum)              factor after the sum
=============  ===================================  ==========================
replicated     world                                1 / p
  group="data" this rank's data group                 1 / p_data
partial        world                                K / p (K: the layout group)
sharded        this rank's data group               1 / p_data
=============  ===================================  ==========================

then x ``grad_scale``; ``op="sum"`` multiplies by ``p_data`` (the number of
model replicas). Variables whose gradient is already global (Lee et al.'s
replicated FC gradients, marked by :func:`mark_prereduced`) are not
communicated at all. Group-local variables (gmp's periodic model averaging,
:mod:`tfhybrid.optimizer.averaging`) are reduced within their model group
only (partial: summed; otherwise not at all), x ``grad_scale``.

Buckets (Lee et al.'s gradient chunks, generalised): gradients are visited in
reverse forward order (the order back-propagation produces them) and packed,
per set of ranks, into buckets of at most ``bucket_bytes`` (a larger tensor
gets a bucket of its own). One grouped allreduce is issued per bucket. The
planning functions here are pure Python so they are unit-tested without
Horovod.
"""
from __future__ import annotations

import dataclasses
from typing import List, Sequence, Tuple

from tfhybrid.process_grid import Group, ProcessGrid
from tfhybrid.layout import layout_of
from tfhybrid.optimizer.averaging import local_reduction, periodic_of

_PREREDUCED = "_tfhybrid_prereduced"


def mark_prereduced(variable):
    """Mark ``variable``: its gradient is already the global gradient."""
    setattr(variable, _PREREDUCED, True)
    return variable


def is_prereduced(variable) -> bool:
    """True when ``variable``'s gradient needs no communication."""
    return bool(getattr(variable, _PREREDUCED, False))


@dataclasses.dataclass(frozen=True)
class Reduction:
    """How one gradient is reduced: sum over ``ranks``, then x ``factor``."""

    ranks: Tuple[int, ...]
    factor: float


def _group_size(group, grid: ProcessGrid, variable) -> int:
    if isinstance(group, Group):
        return group.size
    if group in ("model", "data", "world"):
        return grid.group(group).size
    raise ValueError(
        f"Variable {getattr(variable, 'path', variable)!r} has a 'partial' layout over "
        f"group={group!r}, which the DistributedOptimizer cannot size. Use 'model', "
        "'data', 'world' or a tfhybrid.process_grid.Group as the layout's group.")


def reduction_of(variable, grid: ProcessGrid, op: str = "average") -> Reduction:
    """The :class:`Reduction` of ``variable``'s gradient on ``grid``.

    Example:
        >>> g = ProcessGrid(size=4, rank=1, model_parallel=2)
        >>> reduction_of(v_sharded, g)        # doctest: +SKIP
        Reduction(ranks=(1, 3), factor=0.5)
    """
    layout = layout_of(variable)
    world = tuple(range(grid.size))
    if periodic_of(variable) is not None:   # updated with its own group's gradient
        ranks, factor = local_reduction(variable, grid, op)
        return Reduction(ranks, factor)
    if is_prereduced(variable):
        ranks, factor = (), 1.0
    elif layout.kind == "replicated" and layout.group == "data":
        ranks, factor = grid.group("data").ranks, 1.0 / grid.data_size
    elif layout.kind == "replicated":
        ranks, factor = world, 1.0 / grid.size
    elif layout.kind == "partial":
        ranks, factor = world, _group_size(layout.group, grid, variable) / grid.size
    else:  # sharded
        ranks, factor = grid.group("data").ranks, 1.0 / grid.data_size
    factor *= layout.grad_scale
    if op == "sum":
        factor *= grid.data_size
    if len(ranks) <= 1:
        ranks = ()
    return Reduction(tuple(ranks), float(factor))


@dataclasses.dataclass
class Bucket:
    """Gradients reduced by one grouped allreduce.

    Attributes:
        ranks: The ranks that take part (one process set).
        indices: Positions of the gradients in the ``apply`` list.
        nbytes: Payload bytes on the wire (after compression).
    """

    ranks: Tuple[int, ...]
    indices: List[int]
    nbytes: int = 0

    def ring_bytes(self) -> float:
        """Bytes each rank sends for this bucket with a ring allreduce."""
        k = len(self.ranks)
        return 2.0 * (k - 1) / k * self.nbytes if k > 1 else 0.0


def plan_buckets(items: Sequence[Tuple[Tuple[int, ...], int]], bucket_bytes: int,
                 at_least: bool = False, min_last: int = 0) -> List[Bucket]:
    """Pack gradients into buckets.

    Args:
        items: ``(ranks, nbytes)`` per gradient in *forward* order; entries
            with empty ``ranks`` (no communication) are skipped.
        bucket_bytes: Upper bound of a bucket's payload; a gradient larger
            than this gets a bucket of its own.
        at_least: Make ``bucket_bytes`` a lower bound instead: a bucket closes
            once it holds ``bucket_bytes`` (the last one of a group may hold
            less). No bucket then holds only the small gradients (biases)
            between two large ones, each paying a collective's fixed cost.
        min_last: With ``at_least``: a group's last bucket (the first layers'
            gradients, which back-propagation finishes last) that holds less
            than this joins the bucket before it. It is issued when the backward
            pass ends, behind that bucket's transfer: on its own it would add a
            collective's latency to the step for a few bytes.

    Returns:
        Buckets in issue order: the last layers' gradients first.

    Example:
        >>> [b.indices for b in plan_buckets([((0, 1), 8), ((0, 1), 8), ((0, 1), 8)], 16)]
        [[2, 1], [0]]
        >>> items = [((0, 1), 2), ((0, 1), 64), ((0, 1), 2), ((0, 1), 64)]
        >>> [b.indices for b in plan_buckets(items, 16)]
        [[3], [2], [1], [0]]
        >>> [b.indices for b in plan_buckets(items, 16, at_least=True)]
        [[3], [2, 1], [0]]
        >>> [b.indices for b in plan_buckets(items, 64, at_least=True, min_last=64)]
        [[3], [2, 1, 0]]
    """
    open_buckets, done = {}, []
    for index in reversed(range(len(items))):
        ranks, nbytes = items[index]
        if not ranks:
            continue
        bucket = open_buckets.get(ranks)
        if bucket is not None and not at_least and bucket.nbytes + nbytes > bucket_bytes:
            done.append(bucket)
            bucket = None
        if bucket is None:
            bucket = open_buckets[ranks] = Bucket(ranks, [])
        bucket.indices.append(index)
        bucket.nbytes += nbytes
        if at_least and bucket.nbytes >= bucket_bytes:
            done.append(open_buckets.pop(ranks))
    for ranks, rest in open_buckets.items():
        before = next((b for b in reversed(done) if b.ranks == ranks), None)
        if at_least and before is not None and rest.nbytes < min_last:
            before.indices.extend(rest.indices)
            before.nbytes += rest.nbytes
        else:
            done.append(rest)
    return sorted(done, key=lambda b: -max(b.indices))
