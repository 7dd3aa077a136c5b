"""The process grid: world = data x model, model-fastest (pure Python).

A world of ``p`` ranks is laid out as ``p_data`` model groups of ``p_model``
consecutive ranks each, so a model group sits inside one node on a real
cluster (ParaDL maps data parallelism inter-node)::

    rank = data_rank * p_model + model_rank

The *model group* of a rank is the ``p_model`` ranks that together hold one
model replica; its *data group* is the ``p_data`` ranks with the same
``model_rank`` (one per replica), over which gradients of sharded weights are
reduced. The model axis can be factored further (``subgroups``) for spatial
block grids (height x width) or Gholami's Pr x Pc grid.

Nothing here imports TensorFlow or Horovod.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Sequence, Tuple

GROUP_NAMES = ("world", "data", "model")


@dataclasses.dataclass(frozen=True)
class Group:
    """A set of ranks that run a collective together.

    Attributes:
        name: Axis name ("world", "data", "model", or a sub-axis name).
        ranks: Global ranks of the group in group order.
        index: This rank's position in ``ranks``.
    """

    name: str
    ranks: Tuple[int, ...]
    index: int

    @property
    def size(self) -> int:
        """Number of ranks in the group."""
        return len(self.ranks)

    def neighbour(self, offset: int):
        """Group index ``index + offset``, or None beyond the group's ends."""
        i = self.index + offset
        return i if 0 <= i < self.size else None


def _check_positive_int(value, what):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(
            f"Received an invalid value for `{what}`, expected a positive "
            f"integer. Received: {what}={value!r}")


@dataclasses.dataclass(frozen=True)
class ProcessGrid:
    """World = ``data_size`` x ``model_size``, model-fastest.

    Args:
        size: World size p.
        rank: This process's global rank.
        model_parallel: Model-group size p_model; must divide ``size``.

    Raises:
        ValueError: if ``model_parallel`` does not divide ``size`` or an
            argument is not a positive integer / a valid rank.

    Example:
        >>> g = ProcessGrid(size=8, rank=5, model_parallel=2)
        >>> (g.data_size, g.data_rank, g.model_size, g.model_rank)
        (4, 2, 2, 1)
        >>> g.group("model").ranks, g.group("data").ranks
        ((4, 5), (1, 3, 5, 7))
    """

    size: int
    rank: int
    model_parallel: int = 1

    def __post_init__(self):
        _check_positive_int(self.size, "size")
        _check_positive_int(self.model_parallel, "model_parallel")
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or not (
                0 <= self.rank < self.size):
            raise ValueError(f"Received an invalid value for `rank`: rank={self.rank!r}; "
                             f"expected 0 <= rank < size={self.size}.")
        if self.size % self.model_parallel:
            divisors = [d for d in range(1, self.size + 1) if self.size % d == 0]
            raise ValueError(
                f"Received: model_parallel={self.model_parallel}, world size "
                f"{self.size}; model_parallel must divide the world size "
                f"(valid values: {divisors}).")

    @property
    def model_size(self) -> int:
        return self.model_parallel

    @property
    def data_size(self) -> int:
        return self.size // self.model_parallel

    @property
    def model_rank(self) -> int:
        return self.rank % self.model_parallel

    @property
    def data_rank(self) -> int:
        return self.rank // self.model_parallel

    def model_group_ranks(self, data_rank: int) -> Tuple[int, ...]:
        """Global ranks of model group number ``data_rank``."""
        m = self.model_parallel
        return tuple(range(data_rank * m, (data_rank + 1) * m))

    def data_group_ranks(self, model_rank: int) -> Tuple[int, ...]:
        """Global ranks of the data group of ranks with ``model_rank``."""
        return tuple(range(model_rank, self.size, self.model_parallel))

    def group(self, name: str) -> Group:
        """This rank's group along axis ``name`` ("world", "data" or "model")."""
        if name == "world":
            return Group("world", tuple(range(self.size)), self.rank)
        if name == "model":
            return Group("model", self.model_group_ranks(self.data_rank), self.model_rank)
        if name == "data":
            return Group("data", self.data_group_ranks(self.model_rank), self.data_rank)
        raise ValueError(f"Received an invalid group name: {name!r}; expected one of "
                         f"{GROUP_NAMES} or a tfhybrid.process_grid.Group.")

    def all_groups(self) -> Tuple[Tuple[int, ...], ...]:
        """Every model and data group of the world (same order on all ranks).

        This is what every rank registers as Horovod process sets at init.
        """
        groups = [self.model_group_ranks(d) for d in range(self.data_size)]
        groups += [self.data_group_ranks(m) for m in range(self.model_size)]
        return tuple(groups)

    def subgroups(self, shape: Sequence[int], names: Sequence[str] = None) -> Tuple[Group, ...]:
        """Factor the model group row-major into a grid of ``shape``.

        Args:
            shape: Sizes of the sub-axes, e.g. ``(ph, pw)``; their product must
                equal ``model_size``.
            names: Optional names of the sub-axes (default ``axis0``, ...).

        Returns:
            One Group per sub-axis: the ranks of this model group that share
            every other sub-axis index with this rank.

        Example:
            >>> g = ProcessGrid(size=4, rank=3, model_parallel=4)
            >>> [s.ranks for s in g.subgroups((2, 2), ("h", "w"))]
            [(1, 3), (2, 3)]
        """
        shape = tuple(int(s) for s in shape)
        names = tuple(names) if names else tuple(f"axis{i}" for i in range(len(shape)))
        if len(names) != len(shape):
            raise ValueError(f"Received {len(names)} names for a grid of shape {shape}.")
        if math.prod(shape) != self.model_size:
            raise ValueError(
                f"Received: grid shape {shape} (product {math.prod(shape)}) for a "
                f"model group of size {self.model_size}; the product must equal "
                f"model_parallel.")
        coords = unravel(self.model_rank, shape)
        base = self.data_rank * self.model_size
        out = []
        for axis, name in enumerate(names):
            members = []
            for i in range(shape[axis]):
                c = list(coords)
                c[axis] = i
                members.append(base + ravel(c, shape))
            out.append(Group(name, tuple(members), coords[axis]))
        return tuple(out)

    def all_subgroups(self, shape: Sequence[int]) -> Tuple[Tuple[int, ...], ...]:
        """Every sub-axis group of every model group, in the same order on all ranks."""
        shape = tuple(int(s) for s in shape)
        result = []
        for r in range(self.size):
            g = ProcessGrid(self.size, r, self.model_parallel)
            for sub in g.subgroups(shape):
                if sub.ranks not in result:
                    result.append(sub.ranks)
        return tuple(result)


def unravel(index, shape):
    """The coordinates of ``index`` in a row-major grid of ``shape`` (last axis fastest)."""
    coords = []
    for s in reversed(shape):
        coords.append(index % s)
        index //= s
    return tuple(reversed(coords))


def ravel(coords, shape):
    """The row-major index of ``coords`` in a grid of ``shape`` (inverse of :func:`unravel`)."""
    index = 0
    for c, s in zip(coords, shape):
        index = index * s + c
    return index
