"""The planner: from a :class:`GraphSpec`, a strategy and the grid to a
:class:`Plan` (pure Python; no Keras layer is built here).

Three passes over the layer calls in topological order:

1. **assign** — the strategy's kinds, then per-layer overrides, then a
   feasibility check of every partitioned layer (group size divides
   units/filters/channels/height; ``fallback`` decides between an error and
   replication), a check that no weighted layer the strategy would
   partition lacks a rule, and the strategy's own check of the result
   (s/ds: at least one layer is spatial, else the strategy would only
   replicate).
2. **pair** — a filter-parallel layer whose output reaches exactly one
   Dense/Conv2D through channel-preserving layers keeps its output split
   and that consumer becomes channel-parallel on the split input (one
   all-reduce per pair instead of a gather per layer; concepts.md#the-collective-algebra).
3. **propagate** — each layer's :class:`~tfhybrid.transformer.rules.Rule`
   states the input layouts it needs; a boundary (ModuloLayer, spatial
   scatter/gather, ...) is planned wherever a producer's layout differs.

Example:
    >>> plan = make_plan(describe_graph(model), make_options("df"), grid)
    >>> [(n.name, n.kind) for n in plan.nodes if n.kind != "replicate"]
    [('fc1', 'filter'), ('fc2', 'channel')]
"""
from __future__ import annotations

import dataclasses
from typing import Dict, Optional, Tuple

from tfhybrid.transformer import rules
from tfhybrid.transformer.layouts import Layout, convert
from tfhybrid.transformer.strategies import _OVERRIDE_KINDS, strategy_for

_PAIR_THROUGH = tuple(c for c in rules.ELEMENTWISE if c != "Softmax") + (
    "Activation", "MaxPooling2D", "AveragePooling2D", "GlobalAveragePooling2D",
    "GlobalMaxPooling2D", "MaxPooling3D", "AveragePooling3D", "GlobalAveragePooling3D",
    "GlobalMaxPooling3D")


@dataclasses.dataclass(frozen=True)
class NodePlan:
    """How one layer call is rebuilt.

    Attributes:
        name, cls: The original layer's name and class.
        kind: "replicate", "filter", "channel", "spatial" or "syncbn".
        conversions: Per input, the boundary inserted before it (or None).
        inputs: Layouts the layer sees (after the boundaries).
        output: Layout of its output.
        params: Rebuild arguments (layouts, split, bn_groups).
    """

    name: str
    cls: str
    kind: str
    conversions: Tuple[Optional[str], ...]
    inputs: Tuple[Layout, ...]
    output: Layout
    params: Dict[str, object]


@dataclasses.dataclass(frozen=True)
class Plan:
    """The rewrite of a whole model.

    Attributes:
        strategy: Strategy name.
        batch_split: "world" (d, gmp) or "data": how tfhybrid.data.shard
            splits a global batch.
        context: The rules' context (group sizes, spatial grid).
        nodes: One NodePlan per layer call, in topological order.
        outputs: Per model output, the boundary inserted before it (or None).
        split_outputs: Per model output, True when it stays split into
            spatial blocks (a per-voxel output of s/ds: its labels are
            split the same way and the loss is averaged over the group).
    """

    strategy: str
    batch_split: str
    context: rules.Context
    nodes: Tuple[NodePlan, ...]
    outputs: Tuple[Optional[str], ...]
    split_outputs: Tuple[bool, ...] = ()

    def node(self, name: str) -> NodePlan:
        for n in self.nodes:
            if n.name == name:
                return n
        raise KeyError(name)


def make_plan(graph, opts, grid) -> Plan:
    """Plan the rewrite of ``graph`` under ``opts`` on ``grid``.

    Args:
        graph: :class:`~tfhybrid.transformer.graph.GraphSpec` of the model.
        opts: :class:`~tfhybrid.transformer.options.TransformOptions`.
        grid: :class:`tfhybrid.process_grid.ProcessGrid` (only its sizes are read).

    Returns:
        The :class:`Plan`.

    Raises:
        ValueError: the strategy does not fit the grid, a layer cannot be
            partitioned (and ``fallback="error"``), or an override is invalid.
    """
    strategy = strategy_for(opts.strategy)
    # the context reads the graph's spatial rank only, which folding keeps
    ctx = dataclasses.replace(strategy.context(grid, opts, graph), batch_norm=opts.batch_norm)
    if strategy.name in ("s", "ds"):     # ZeroPadding + valid conv/pool -> one layer
        graph = rules.fold_padding(graph, ctx.spatial)
    kinds = strategy.kinds(graph, ctx, opts)
    kinds = _apply_overrides(graph, kinds, opts, ctx)
    kinds = _check_feasible(graph, kinds, opts, ctx)
    kinds = _fold_kinds(graph, kinds)
    _check_rules(graph, kinds, opts, ctx)
    strategy.check(graph, kinds, ctx, opts)
    kinds = _pair(graph, kinds, set(opts.layers), ctx)
    nodes, layouts = _propagate(graph, kinds, strategy.layout, ctx)
    # per-voxel outputs of s/ds stay in blocks (no full-resolution gather)
    split = tuple(layouts[t].kind == "space" for t in graph.outputs)
    outputs = tuple(None if keep else convert(layouts[t], strategy.layout.kind)[0]
                    for t, keep in zip(graph.outputs, split))
    return Plan(strategy.name, strategy.batch_split, ctx, nodes, outputs, split)


# -- pass 1: assign -------------------------------------------------------------

def _fold_kinds(graph, kinds):
    """A folded ZeroPadding takes its convolution's kind: ``spatial`` when the
    convolution runs on blocks (the padding is then its ``same`` padding),
    else none (the convolution, region end or override, gets the padded input)."""
    kinds = dict(kinds)
    for node in graph.nodes:
        conv = node.attr("folded_into")
        if conv and kinds.get(conv) == "spatial":
            kinds[node.name] = "spatial"
        elif conv:
            kinds.pop(node.name, None)
    return kinds


def _apply_overrides(graph, kinds, opts, ctx):
    kinds = dict(kinds)
    names = graph.names()
    for name, short in opts.layers.items():
        if name not in names:
            raise ValueError(f"Received layers={{{name!r}: {short!r}}} for strategy "
                             f"{ctx.strategy!r}, but the model has no layer {name!r}; its "
                             f"layers are {list(names)}.")
        node, kind = graph.node(name), _OVERRIDE_KINDS[short]
        allowed = rules.SPATIAL_WEIGHTED if kind == "spatial" else rules.LINEAR
        if kind != "replicate" and node.cls not in allowed:
            raise ValueError(f"Received layers={{{name!r}: {short!r}}}: layer {name!r} is a "
                             f"{node.cls}; {short!r} applies to {' and '.join(allowed)} "
                             f"layers only. Use {name!r}: 'replicate' or remove the override.")
        if kind == "spatial" and ctx.spatial is None:
            raise ValueError(f"Received layers={{{name!r}: 's'}} under strategy "
                             f"{ctx.strategy!r}; spatial layers need strategy 's' or 'ds'.")
        if kind in ("filter", "channel") and ctx.strategy == "d":
            raise ValueError(f"Received layers={{{name!r}: {short!r}}} under strategy 'd', "
                             "which keeps every layer replicated; use strategy 'df' or 'gmp'.")
        kinds[name] = kind
    return kinds


def _check_feasible(graph, kinds, opts, ctx):
    out = dict(kinds)
    for node in graph.nodes:
        kind = kinds.get(node.name, "replicate")
        problem = _infeasible(node, kind, ctx)
        if problem is None:
            continue
        if opts.fallback == "replicate" and node.name not in opts.layers:
            out[node.name] = "replicate"
            continue
        if node.name in opts.layers:
            raise ValueError(problem + _override_fix(node, kind, ctx, opts))
        raise ValueError(problem + _fix(node, kind, ctx))
    return out


def _infeasible(node, kind, ctx) -> Optional[str]:
    k = ctx.model_size
    head = f"Layer {node.name!r} ({node.cls}) cannot be made {kind}-parallel under strategy " \
           f"{ctx.strategy!r}"
    if kind in ("filter", "channel", "spatial") and node.attr("groups", 1) != 1:
        return f"{head}: it is a grouped convolution (groups={node.attr('groups')})."
    if kind in ("filter", "channel") and node.attr("data_format", "channels_last") != \
            "channels_last":
        return f"{head}: data_format={node.attr('data_format')!r} (channels_last needed)."
    if kind == "filter":
        what = "units" if node.cls == "Dense" else "filters"
        n = node.attr(what)
        if n % k:
            return f"{head}: {what}={n} is not divisible by the model group size {k}."
    if kind == "channel" and (node.in_channels or 0) % k:
        return (f"{head}: its {node.in_channels} input channels are not divisible by the "
                f"model group size {k}.")
    if kind == "spatial":
        problem = rules.spatial_problem(node, ctx.spatial)
        return f"{head}: {problem}." if problem else None
    return None


def _override_fix(node, kind, ctx, opts) -> str:
    """The fix for an explicitly overridden layer (``fallback`` does not apply to it)."""
    return (f" Remove the override layers={{{node.name!r}: {opts.layers[node.name]!r}}} or "
            f"set it to 'replicate' (fallback='replicate' does not apply to layers named in "
            f"layers=){_size_hint(node, kind, ctx)}.")


def _fix(node, kind, ctx) -> str:
    return (f" Use fallback='replicate' (or layers={{{node.name!r}: 'replicate'}}) to keep "
            f"it replicated{_size_hint(node, kind, ctx)}.")


def _size_hint(node, kind, ctx) -> str:
    """", or use mp=2": model group sizes that divide the size the layer splits."""
    if kind not in ("filter", "channel") or node.attr("groups", 1) != 1:
        return ""
    n = node.in_channels if kind == "channel" else node.attr("units") or node.attr("filters")
    world = ctx.model_size * ctx.data_size
    good = " or ".join(str(m) for m in range(2, world + 1) if world % m == 0 and n
                       and n % m == 0 and m != ctx.model_size)
    if not good:
        return ""
    if ctx.strategy == "gmp":
        return f", or use mp={good}"
    if ctx.strategy in ("f", "c"):   # every rank in one model group
        return f", or run on {good} ranks" + (
            f" (or strategy='df' with model_parallel={good})" if ctx.strategy == "f" else "")
    return f", or use model_parallel={good}"


_NO_RULE_STRATEGIES = ("f", "df", "c")


def _check_rules(graph, kinds, opts, ctx):
    """Weighted layers f/df/c would partition but have no rule for."""
    if ctx.strategy not in _NO_RULE_STRATEGIES or opts.fallback == "replicate":
        return
    for node in graph.nodes:
        if node.n_params and node.cls not in rules.LINEAR + rules.REPLICABLE \
                and node.name not in opts.layers:
            raise ValueError(
                f"Layer {node.name!r} ({node.cls}) has weights but tfhybrid has no rule to "
                f"partition a {node.cls} under strategy {ctx.strategy!r}. Use fallback="
                f"'replicate' or layers={{{node.name!r}: 'replicate'}} to keep it replicated."
                + rules.nested_model_hint(node))


# -- pass 2: pair f -> c ------------------------------------------------------------

def _pair(graph, kinds, explicit, ctx):
    kinds = dict(kinds)
    for node in graph.nodes:
        if kinds.get(node.name) != "filter" or node.attr("activation") in rules.CHANNEL_MIXING:
            continue
        nxt = _next_linear(graph, node)
        if nxt is None or kinds.get(nxt.name) not in ("filter", "channel"):
            continue
        if nxt.name in explicit and kinds[nxt.name] == "filter":
            continue
        if (nxt.in_channels or 0) % ctx.model_size:
            continue
        kinds[node.name], kinds[nxt.name] = "filter_split", "channel_split"
    return kinds


def _next_linear(graph, node):
    """The single Dense/Conv2D fed by ``node`` through channel-preserving layers."""
    tensor = node.output
    while tensor not in graph.outputs:
        consumers = graph.consumers(tensor)
        if len(consumers) != 1:
            return None
        nxt = consumers[0]
        if nxt.cls in rules.LINEAR:
            return nxt
        through = nxt.cls in _PAIR_THROUGH or nxt.attr("operation") == "elementwise"
        if not through or nxt.attr("activation") in rules.CHANNEL_MIXING:
            return None
        tensor = nxt.output
    return None


# -- pass 3: propagate layouts ------------------------------------------------------

def _propagate(graph, kinds, input_layout, ctx):
    layouts = {t: input_layout for t in graph.inputs}
    nodes = []
    for node in graph.nodes:
        given = [layouts[t] for t in node.inputs]
        decision = rules.rule_of(node).plan(node, given, kinds.get(node.name, "replicate"),
                                                 ctx)
        conversions, seen = [], []
        for lay, need in zip(given, decision.needs):
            name, lay = convert(lay, need) if need else (None, lay)
            conversions.append(name)
            seen.append(lay)
        nodes.append(NodePlan(node.name, node.cls, decision.kind, tuple(conversions),
                              tuple(seen), decision.output, dict(decision.params)))
        layouts[node.output] = decision.output
    return tuple(nodes), layouts
