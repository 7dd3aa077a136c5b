"""Strategies: which layers each strategy partitions, and how (pure Python).

A :class:`Strategy` checks the process grid and options, then assigns a
*kind* to every weighted layer call: ``replicate``, ``filter``,
``channel`` or ``spatial``. The registry :data:`STRATEGIES` maps the names
of :mod:`tfhybrid.strategy_names` (ParaDL's d/f/c/s/df/ds, SplitBrain's gmp) to these classes:

=======  ===================  ==========================================================
name     batch split          layers partitioned over the model group
=======  ===================  ==========================================================
d        world                none (weights replicated; the model axis is ignored)
f, df    data groups          every Dense/Conv2D/Conv3D filter-parallel, paired f -> c
c        data groups          every Dense/Conv2D/Conv3D channel-parallel
s, ds    data groups          leading Conv2D layers split over height/width
gmp      world                Dense layers with CCR >= ccr_threshold, filter-parallel
                              (paired f -> c) behind a ModuloLayer
=======  ===================  ==========================================================

f, c and s use every rank for one model (``tfhybrid.init(model_parallel=p)``);
df and ds add data groups. The spatial region of s/ds may start after
shape-only layers (padding, cropping, pooling) that run on the full input;
when it would hold no Conv2D, s/ds raise a ValueError naming the layer that
ends it and the fix (``strategy='d'``, another ``spatial`` grid).
"""
from __future__ import annotations

import math
import os
import sys
import warnings
from typing import Dict

from tfhybrid.oracle import formulas
from tfhybrid.transformer import rules
from tfhybrid.transformer.layouts import REPLICATED_ACTIVATION, ROWS, Layout
from tfhybrid.spatial_geometry import SPATIAL_AXES, default_spatial, spatial_grid

_OVERRIDE_KINDS = {"f": "filter", "c": "channel", "s": "spatial", "replicate": "replicate"}


def ccr(node) -> float:
    """SplitBrain's CCR of a Dense layer node (:func:`tfhybrid.oracle.formulas.splitbrain_ccr`).

    Example:
        >>> round(ccr(node_of(Dense(1024), in=4096)), 1)   # SplitBrain FC0
        1228.8
    """
    return formulas.splitbrain_ccr(node.in_channels or 0, node.attr("units") or 0)


class Strategy:
    """Base: data parallel over the data groups, nothing partitioned."""

    name = "?"
    batch_split = "data"
    layout = REPLICATED_ACTIVATION

    def context(self, grid, opts, graph=None) -> rules.Context:
        """Check the grid and options; return the rules' context (``graph``,
        the model's GraphSpec, tells image from volume models)."""
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

    def check(self, graph, kinds, ctx, opts):
        """Check the final kinds (after overrides and fallbacks); raise ValueError."""


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
    """f / df: every Dense/Conv2D/Conv3D filter-parallel, adjacent pairs as f -> c."""

    name = "df"

    def context(self, grid, opts, graph=None):
        if self.name == "f":
            _need_whole_world("f", grid)
        return super().context(grid, opts, graph)

    def default_kind(self, node, ctx, opts):
        return "filter" if node.cls in rules.LINEAR else None


class ChannelParallel(Strategy):
    """c: every Dense/Conv2D/Conv3D channel-parallel (input channels split)."""

    name = "c"

    def context(self, grid, opts, graph=None):
        _need_whole_world("c", grid)
        return super().context(grid, opts, graph)

    def default_kind(self, node, ctx, opts):
        return "channel" if node.cls in rules.LINEAR else None


class SpatialParallel(Strategy):
    """s / ds: leading Conv2D (Conv3D) layers split over height/width (and depth
    for volumes), with halo exchange."""

    name = "ds"

    def context(self, grid, opts, graph=None):
        if self.name == "s":
            _need_whole_world("s", grid)
        split = spatial_grid(opts.spatial, grid.model_size, self.name, model_ndim(graph))
        return rules.Context(self.name, grid.model_size, grid.data_size, split)

    def kinds(self, graph, ctx, opts):
        if opts.spatial_layers is None:
            return {name: "spatial" for name in _default_region(graph, ctx, opts)}
        return {name: "spatial" for name in _explicit_region(graph, ctx, opts)}

    def check(self, graph, kinds, ctx, opts):
        """Raise when overrides leave no layer spatial (the strategy would only replicate)."""
        if any(kind == "spatial" for kind in kinds.values()):
            return
        region = [name for name, kind in self.kinds(graph, ctx, opts).items()
                  if kind == "spatial"]
        raise ValueError(empty_region_message(graph, ctx, opts, None, overridden=region))


class GroupModelParallel(Strategy):
    """gmp (SplitBrain): conv layers DP over the world, FC layers with high
    CCR partitioned within model groups of ``mp`` behind a ModuloLayer."""

    name = "gmp"
    batch_split = "world"
    layout = ROWS

    def context(self, grid, opts, graph=None):
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
        return super().context(grid, opts, graph)

    def default_kind(self, node, ctx, opts):
        if node.cls == "Dense" and ctx.model_size > 1 and formulas.splitbrain_partitions(ccr(node), opts.ccr_threshold):
            return "filter"
        return None


def model_ndim(graph) -> int:
    """Spatial axes of the model's convolutions: 3 when it has a Conv3D (or a
    5-D input), else 2."""
    if graph is None:
        return 2
    for node in graph.nodes:
        if node.cls in rules.SPATIAL_CONVS:
            return rules.spatial_ndim(node)
    for node in graph.nodes:
        if node.in_shapes and len(node.in_shapes[0]) == 5:
            return 3
    return 2


_SPATIAL_PASS = rules.ELEMENTWISE + rules.MERGES + ("Activation", "BatchNormalization")


def _spatial_capable(node):
    """Layers that run on spatial blocks (rules.runs_on_blocks: element-wise, merges,
    BatchNormalization, softmax over channels, Concatenate along channels, nearest
    UpSampling)."""
    return rules.runs_on_blocks(node)


def _before_region(node, region):
    """Layers before the first spatial convolution run on the full input, the
    blocks are cut after them: shape-only and Keras preprocessing layers
    (Normalization, RandomFlip, Resizing: augmentation at the model's input),
    and any other layer making an image or volume there (a
    ``Lambda(lambda t: t / 127.5 - 1)``, a Reshape of flat rows): every rank
    holds the whole input, so running it replicated is exact."""
    return not region and len(node.out_shape) in (4, 5) and not node.attr("nested_model")


def _conv_problem(node, ctx):
    """Why a Conv2D/Conv3D cannot be split spatially on ``ctx.spatial`` (None: it can)."""
    if node.attr("groups", 1) != 1:
        return (f"it is a grouped convolution (groups={node.attr('groups')}), which "
                "tfhybrid does not split spatially")
    return rules.spatial_problem(node, ctx.spatial)


def _stop_reason(node, ctx):
    """Why a layer that is not a convolution cannot run on spatial blocks."""
    if node.cls in rules.SPATIAL_WINDOWED:
        return rules.spatial_problem(node, ctx.spatial)
    if node.attr("nested_model"):
        return "it is a nested model." + rules.nested_model_hint(node)
    return (f"a {node.cls} has no spatial rule (it needs the whole "
            f"{' and '.join(SPATIAL_AXES[len(ctx.spatial)])} of its input)")


def _region_walk(graph, ctx):
    """(default region, (node, reason) that ends it or None at the end of the model).

    The region holds every Conv2D before the first layer that cannot run on
    spatial blocks; pooling/padding/cropping layers that split, and
    element-wise layers, do not end it, nor (once the region has a
    convolution) a layer from which no convolution follows (a classification
    head beside a U-Net's decoder: its input is gathered).
    """
    region = []
    for node in graph.nodes:
        if node.cls in rules.SPATIAL_WEIGHTED:
            problem = _conv_problem(node, ctx)
            if problem:
                return region, (node, problem)
            region.append(node.name)
        elif not (rules.spatial_window(node, ctx.spatial) or _spatial_capable(node)
                  or _before_region(node, region)):
            if region and not _feeds_conv(graph, node):   # a side head (e.g. a classifier
                continue                                   # beside a U-Net decoder) gathers
            return region, (node, _stop_reason(node, ctx))
    return region, None


def _feeds_conv(graph, node):
    """True when ``node``'s output reaches a convolution (Conv2D/3D or transposed)."""
    seen, todo = set(), [node.output]
    while todo:
        for consumer in graph.consumers(todo.pop()):
            if consumer.cls in rules.SPATIAL_WEIGHTED:
                return True
            if consumer.name not in seen:
                seen.add(consumer.name)
                todo.append(consumer.output)
    return False


def _default_region(graph, ctx, opts):
    region, stop = _region_walk(graph, ctx)
    if not region:
        raise ValueError(empty_region_message(graph, ctx, opts, stop))
    if stop is not None and _feeds_conv(graph, stop[0]):
        _warn_early_stop(graph, ctx, opts, region, stop)
    return region


def _warn_early_stop(graph, ctx, opts, region, stop):
    """Warn (rank 0) that convolutions after the spatial region run replicated:
    a U-Net whose pooled size stops splitting evenly would otherwise run its
    decoder at full resolution on every rank without a word."""
    from tfhybrid import runtime

    if not runtime.is_root():
        return
    node, reason = stop
    after = [n.name for n in graph.nodes if n.cls in rules.SPATIAL_WEIGHTED
             and n.name not in region]
    shown = ", ".join(repr(n) for n in after[:3]) + (", ..." if len(after) > 3 else "")

    def fits(other):
        found, _ = _region_walk(graph, other)
        return len(found) > len(region)

    fixes = ([f"use an input size whose split axes still divide at {node.name!r}"]
             if node.cls in rules.SPATIAL_WINDOWED + rules.SPATIAL_WEIGHTED else [])
    grids = _other_grids(ctx, opts, fits)[len(", or "):]
    fixes += [grids] if grids else []
    advice = f" To keep them on blocks, {' or '.join(fixes)}." if fixes else ""
    warnings.warn(
        f"tfhybrid.transform(strategy={ctx.strategy!r}, {_grid_text(ctx, opts)}): the spatial "
        f"region ends at layer {node.name!r} ({node.cls}): {reason}. The {len(after)} "
        f"convolution(s) after it ({shown}) run replicated on the whole "
        f"{'image' if len(ctx.spatial) == 2 else 'volume'} on every rank: no speed-up and "
        f"no memory saving for them.{advice} tfhybrid.describe(model) shows the layout.",
        UserWarning, stacklevel=_caller_level())


def _caller_level():
    """The ``warnings.warn`` stacklevel of the first frame outside tfhybrid (the
    user's call), seen from the function calling this one."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
    frame, level = sys._getframe(2), 2
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(package):
        frame, level = frame.f_back, level + 1
    return level


def _explicit_walk(graph, ctx, count):
    """(the first ``count`` Conv2D layers or fewer, (node, reason) that stops them or None)."""
    region = []
    for node in graph.nodes:
        if len(region) == count:
            break
        if node.cls in rules.SPATIAL_WEIGHTED:
            problem = _conv_problem(node, ctx)
            if problem:
                return region, (node, problem)
            region.append(node.name)
        elif not (_spatial_capable(node) or node.cls in rules.SPATIAL_WINDOWED
                  or _before_region(node, region)):
            return region, (node, _stop_reason(node, ctx))
    return region, None


def _explicit_region(graph, ctx, opts):
    """The first ``spatial_layers`` Conv2D layers; every layer before the last must be spatial."""
    count = opts.spatial_layers
    region, stop = _explicit_walk(graph, ctx, count)
    if stop and not region:
        raise ValueError(empty_region_message(graph, ctx, opts, stop))
    if stop:
        raise ValueError(_explicit_message(graph, stop, region, ctx, opts))
    if not region:
        raise ValueError(empty_region_message(graph, ctx, opts, None))
    if len(region) < count:
        raise ValueError(f"Received spatial_layers={count} under strategy {ctx.strategy!r}, "
                         f"but the model has only {len(region)} Conv2D layer(s) in its "
                         f"spatial part ({', '.join(map(repr, region))}); use spatial_layers="
                         f"{len(region)} or fewer, or omit spatial_layers.")
    return region


def _explicit_message(graph, stop, region, ctx, opts):
    node, problem = stop
    count = opts.spatial_layers
    what = (f"Layer {node.name!r} ({node.cls}) cannot be split spatially"
            if node.cls in rules.SPATIAL_CONVS
            else f"Layer {node.name!r} ({node.cls}) cannot run on spatial blocks")

    def fits(other):
        found, blocked = _explicit_walk(graph, other, count)
        return blocked is None and len(found) == count

    return (f"{what} under strategy {ctx.strategy!r} ({_grid_text(ctx, opts)}): {problem}. "
            f"spatial_layers={count} asks for {count} Conv2D layers and it comes after "
            f"number {len(region)} ({region[-1]!r}). Use spatial_layers={len(region)} or "
            f"fewer{_other_grids(ctx, opts, fits)}.")


def empty_region_message(graph, ctx, opts, stop, overridden=()):
    """ValueError text for s/ds when no layer would be spatially parallel.

    Args:
        graph: The model's GraphSpec.
        ctx: The rules' context (strategy, spatial grid).
        opts: The TransformOptions.
        stop: (node, reason) of the layer that ended the spatial region before
            any Conv2D, or None when the model has no Conv2D to split.
        overridden: Names of region layers that ``layers=`` set to replicate.
    """
    head = (f"Strategy {ctx.strategy!r} would split no layer spatially "
            f"({_grid_text(ctx, opts)})")
    if overridden:
        why = (f"layers= keeps every Conv2D of the spatial region replicated "
               f"({', '.join(repr(n) for n in overridden)})")
        fix = "remove those overrides, or use strategy='d' (data parallelism)"
    else:
        if stop is None:
            why = "the model has no Conv2D layer to split"
        else:
            node, reason = stop
            why = (f"the first {node.cls}, {node.name!r}, cannot be split: {reason}"
                   if node.cls in rules.SPATIAL_CONVS else
                   f"layer {node.name!r} ({node.cls}) comes before any Conv2D and cannot run "
                   f"on spatial blocks: {reason}")
        fix = "use strategy='d' (data parallelism)" + _other_grids(
            ctx, opts, lambda other: bool(_region_walk(graph, other)[0]))
        if stop is not None and stop[0].attr("data_format") == "channels_first":
            fix = ("build the model channels_last (Keras' default: data_format="
                   "'channels_last', inputs (batch, spatial..., channels)), or " + fix)
    return (f"{head}: {why}. Every rank would compute the whole model on the same rows "
            f"(replicated, no speed-up). To fix, {fix}.")


def _grid_text(ctx, opts):
    name = opts.spatial if opts.spatial is not None else default_spatial(len(ctx.spatial))
    return f"spatial={name!r}, a {'x'.join(map(str, ctx.spatial))} grid"


def _other_grids(ctx, opts, fits):
    """", or spatial=...": the other grids of the same group that ``fits(context)``."""
    k = ctx.model_size
    found = []
    ndim = len(ctx.spatial)
    for spatial in list(SPATIAL_AXES[ndim]) + _block_grids(k, ndim):
        grid = spatial_grid(spatial, k, ctx.strategy, ndim)
        if grid == ctx.spatial:
            continue
        if fits(rules.Context(ctx.strategy, k, ctx.data_size, grid)):
            found.append(f"spatial={spatial!r}")
    return f", or {' or '.join(found)}" if found else ""


def _block_grids(k, ndim):
    """Grids of ``k`` ranks over ``ndim`` axes with at least two split axes."""
    grids = [(a,) for a in _divisors(k)]
    for _ in range(ndim - 1):
        grids = [g + (b,) for g in grids for b in _divisors(k // math.prod(g))]
    return [g for g in grids if math.prod(g) == k and sum(p > 1 for p in g) >= 2]


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
