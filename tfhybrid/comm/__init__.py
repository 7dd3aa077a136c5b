"""Collectives over the process grid: the only package that imports Horovod.

Public primitives (the collective algebra, concepts.md#the-collective-algebra),
each differentiable with an explicit backward and taking
``group="model"|"data"|"world"`` or a :class:`tfhybrid.process_grid.Group`:

``split, gather, shard, reduce, copy, halo_exchange, batch_gather,
batch_scatter, broadcast, to_root``.

``register_groups`` registers extra groups (e.g. spatial sub-grids) as
Horovod process sets, collectively on every rank.
"""
from tfhybrid.comm.backend import barrier, register_groups
from tfhybrid.comm.halo import halo_exchange
from tfhybrid.comm.primitives import (batch_gather, batch_scatter, broadcast, copy, gather,
                                      reduce, resolve_group, shard, split, to_root)

__all__ = ["split", "gather", "shard", "reduce", "copy", "halo_exchange", "batch_gather",
           "batch_scatter", "broadcast", "to_root", "register_groups", "resolve_group", "barrier"]
