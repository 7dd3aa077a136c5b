"""Collectives over the process grid: the only package that imports Horovod.

Public primitives (the collective algebra, concepts.md#the-collective-algebra),
each differentiable with an explicit backward and taking
``group="model"|"data"|"world"`` or a :class:`tfhybrid.process_grid.Group`:

``split, gather, shard, reduce, copy, halo_exchange, batch_gather,
batch_scatter, broadcast, to_root``; and, for ranks that run different
layers (``tfhybrid.comm.p2p``: point-to-point and rooted row transfers),
``send_recv, gather_to, scatter_from`` with their helpers ``anchor_like``
and ``token``.

``register_groups`` registers extra groups (e.g. spatial sub-grids) as
Horovod process sets, collectively on every rank.
"""
from tfhybrid.comm.backend import barrier, register_groups
from tfhybrid.comm.halo import halo_exchange
from tfhybrid.comm.p2p import anchor_like, gather_to, scatter_from, send_recv, token
from tfhybrid.comm.primitives import (batch_gather, batch_scatter, broadcast, copy, gather,
                                      reduce, resolve_group, shard, split, to_root)

__all__ = ["split", "gather", "shard", "reduce", "copy", "halo_exchange", "batch_gather",
           "batch_scatter", "broadcast", "to_root", "send_recv", "gather_to", "scatter_from",
           "anchor_like", "token", "register_groups", "resolve_group", "barrier"]
