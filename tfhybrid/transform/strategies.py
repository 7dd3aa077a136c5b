"""Strategies: which layers each strategy partitions, and how (pure Python).

A :class:`Strategy` checks the process grid and options, then assigns a
*kind* to every weighted layer call: ``replicate``, ``filter``,
``channel`` or ``spatial``. The registry :data:`STRATEGIES` maps the names
of DESIGN.md (ParaDL's d/f/c/s/df/ds, SplitBrain's gmp) to these classes:

=======  ===================  ==========================================================
name     batch split          layers partitioned over the model group
=======  ===================  ==========================================================
d        world                none (weights replicated; the model axis is ignored)
f, df    data groups          every Dense/Conv2D filter-parallel, paired f -> c
c        data groups          every Dense/Conv2D channel-parallel
s, ds    data groups          leading Conv2D layers split over height/width
gmp      world                Dense layers with CCR >= ccr_threshold, filter-parallel
                              (paired f -> c) behind a ModuloLayer
=======  ===================  ==========================================================

f, c and s use every rank for one model (``tfhybrid.init(model_parallel=p)``);
df and ds add data groups.
"""
from __future__ import annotations

from typing import Dict

from tfhybrid.transform import rules
from tfhybrid.transform.layouts import REPLICATED, ROWS, Layout
from tfhybrid.transform.options import spatial_grid

_OVERRIDE_KINDS = {"f": "filter", "c": "channel", "s": "spatial", "replicate": "replicate"}


def ccr(node) -> float:
    """Computation-to-communication ratio of a Dense layer (SplitBrain's CCR).

    FLOPs per example of forward and backward (6 x in x out) over the bytes
    per example a partitioned layer moves (float32 input and output
    activations, 4 x (in + out)).

    Example:
        >>> round(ccr(node_of(Dense(1024), in=4096)), 1)   # SplitBrain FC0
        1228.8
    """
    n_in, n_out = node.in_channels or 0, node.attr("units") or 0
    if not n_in or not n_out:
        return 0.0
    return 6.0 * n_in * n_out / (4.0 * (n_in + n_out))


class Strategy:
    """Base: data parallel over the data groups, nothing partitioned."""

    name = "?"
    batch_split = "data"
    layout = REPLICATED

    def context(self, grid, opts) -> rules.Context:
        """Check the grid and options; return the rules' context."""
        return rules.Context(self.name, grid.model_size, grid.data_size)

    def kinds(self, graph, ctx, opts) -> Dict[str, str]:
        """Kind of each layer the strategy partitions (absent: replicate)."""
        out = {}
        for node in graph.nodes:
            kind = self.default_kind(node, ctx, opts)
            if kind:
                out[node.name] = kind
        return out

    def default_kind(self, node, ctx, opts):
        """The kind this strategy gives ``node`` before overrides (or None)."""
        return None


def _need_whole_world(strategy, grid):
    if grid.data_size != 1:
        raise ValueError(
            f"Strategy {strategy!r} partitions the model over all {grid.size} ranks, but the "
            f"grid has model_parallel={grid.model_size}. Call tfhybrid.init(model_parallel="
            f"{grid.size}), or use strategy={'d' + strategy!r} for data groups x "
            f"{strategy} groups.")


class DataParallel(Strategy):
    """d: every rank trains a replica on its own rows (batch split over the world)."""

    name = "d"
    batch_split = "world"
    layout = ROWS


class FilterParallel(Strategy):
    """f / df: every Dense/Conv2D filter-parallel, adjacent pairs as f -> c."""

    name = "df"

    def context(self, grid, opts):
        if self.name == "f":
            _need_whole_world("f", grid)
        return super().context(grid, opts)

    def default_kind(self, node, ctx, opts):
        return "filter" if node.cls in rules.LINEAR else None


class ChannelParallel(Strategy):
    """c: every Dense/Conv2D channel-parallel (input channels split)."""

    name = "c"

    def context(self, grid, opts):
        _need_whole_world("c", grid)
        return super().context(grid, opts)

    def default_kind(self, node, ctx, opts):
        return "channel" if node.cls in rules.LINEAR else None


class SpatialParallel(Strategy):
    """s / ds: leading Conv2D layers split over height/width (halo exchange)."""

    name = "ds"

    def context(self, grid, opts):
        if self.name == "s":
            _need_whole_world("s", grid)
        split = spatial_grid(opts.spatial, grid.model_size, self.name)
        return rules.Context(self.name, grid.model_size, grid.data_size, split)

    def kinds(self, graph, ctx, opts):
        if opts.spatial_layers is None:
            return {name: "spatial" for name in _default_region(graph, ctx)}
        return {name: "spatial" for name in _explicit_region(graph, ctx, opts.spatial_layers)}


class GroupModelParallel(Strategy):
    """gmp (SplitBrain): conv layers DP over the world, FC layers with high
    CCR partitioned within model groups of ``mp`` behind a ModuloLayer."""

    name = "gmp"
    batch_split = "world"
    layout = ROWS

    def context(self, grid, opts):
        mp = opts.mp if opts.mp is not None else grid.model_size
        if grid.size % mp:
            raise ValueError(
                f"Received mp={mp} for strategy 'gmp' on {grid.size} ranks; mp must divide "
                f"the world size: use mp in {_divisors(grid.size)}.")
        if mp != grid.model_size:
            raise ValueError(
                f"Received mp={mp} for strategy 'gmp', but the grid's model groups have "
                f"{grid.model_size} ranks; call tfhybrid.init(model_parallel={mp}) before "
                "transform (gmp's MP groups are the grid's model groups).")
        return super().context(grid, opts)

    def default_kind(self, node, ctx, opts):
        if node.cls == "Dense" and ctx.model_size > 1 and ccr(node) >= opts.ccr_threshold:
            return "filter"
        return None


_SPATIAL_PASS = rules.ELEMENTWISE + rules.MERGES + ("Activation", "BatchNormalization")


def _spatial_capable(node):
    return node.cls in _SPATIAL_PASS and node.attr("activation") not in rules.CHANNEL_MIXING


def _default_region(graph, ctx):
    """Conv2D layers before the first layer that cannot run on a spatial block."""
    region = []
    for node in graph.nodes:
        divisible = rules.space_divisible(node, ctx.spatial)
        if node.cls == "Conv2D" and divisible and node.attr("groups", 1) == 1:
            region.append(node.name)
        elif rules.spatial_window(node, ctx.spatial):
            continue
        elif not _spatial_capable(node):
            break
    return region


def _explicit_region(graph, ctx, count):
    """The first ``count`` Conv2D layers; every layer before the last must be spatial."""
    region = []
    for node in graph.nodes:
        if len(region) == count:
            return region
        if node.cls == "Conv2D":
            if not rules.space_divisible(node, ctx.spatial):
                raise ValueError(_space_message(node, ctx, count))
            region.append(node.name)
        elif not (_spatial_capable(node) or node.cls in rules.SPATIAL_WINDOWED):
            raise ValueError(
                f"Layer {node.name!r} ({node.cls}) comes before Conv2D layer number "
                f"{len(region) + 1} of spatial_layers={count} under strategy {ctx.strategy!r}, "
                f"but has no spatial rule. Use spatial_layers={len(region) or 1} or fewer.")
    if len(region) < count:
        raise ValueError(f"Received spatial_layers={count} under strategy {ctx.strategy!r}, "
                         f"but the model has {len(region)} Conv2D layers in its spatial "
                         f"part; use spatial_layers<={len(region)}.")
    return region


def _space_message(node, ctx, count):
    ph, pw = ctx.spatial
    h, w = node.in_shapes[0][1:3]
    oh, ow = node.out_shape[1:3]
    return (f"Layer {node.name!r} (Conv2D) cannot be split spatially under strategy "
            f"{ctx.strategy!r}: its input {h}x{w} / output {oh}x{ow} (height x width) do not "
            f"divide over the {ph}x{pw} spatial grid. Use a smaller spatial_layers (now "
            f"{count}), another split (spatial='height'/'width'), or a larger input.")


def _divisors(n):
    return [d for d in range(1, n + 1) if n % d == 0]


def _named(cls, name):
    obj = cls()
    obj.name = name
    return obj


STRATEGIES = {
    "d": DataParallel(), "f": _named(FilterParallel, "f"), "df": FilterParallel(),
    "c": ChannelParallel(), "s": _named(SpatialParallel, "s"), "ds": SpatialParallel(),
    "gmp": GroupModelParallel(),
}


def strategy_for(name: str) -> Strategy:
    """The registered :class:`Strategy` called ``name``."""
    return STRATEGIES[name]


__all__ = ["Strategy", "STRATEGIES", "strategy_for", "ccr", "Layout"]
