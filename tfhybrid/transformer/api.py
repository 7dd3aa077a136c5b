"""Building the parallel model of a strategy (``tfhybrid.transform`` builds with
:func:`build`, then installs the guards: :mod:`tfhybrid.compose`).

Reads the model's graph (:mod:`.graph`), plans layouts and boundaries
(:mod:`.planner`), builds the parallel model (:mod:`.rewrite`) and records
on it what :func:`tfhybrid.gather`, :func:`tfhybrid.describe` and
:func:`tfhybrid.data.shard` need.
"""
from __future__ import annotations

import dataclasses

from tfhybrid import runtime
from tfhybrid.layout import layout_of, set_layout
from tfhybrid.optimizer import averaging
from tfhybrid.oracle import formulas
from tfhybrid.transformer.graph import as_functional, describe_graph, weighted_leaves
from tfhybrid.transformer.options import make_options
from tfhybrid.transformer.parts import PartModel
from tfhybrid.transformer.planner import make_plan
from tfhybrid.transformer.rewrite import find_layer, rewrite
from tfhybrid.transformer.root_weights import root_weights
from tfhybrid.transformer.source import record as record_source

INFO_ATTR = "_tfhybrid_transform"
BATCH_SPLIT_ATTR = "_tfhybrid_batch_split"


class TransformInfo:
    """What a transformed model remembers about its origin (not tracked by Keras).

    Attributes:
        plan: The :class:`~tfhybrid.transformer.planner.Plan` it was built from.
        graph: The original model's :class:`~tfhybrid.transformer.graph.GraphSpec`.
        source: JSON of the original model's Keras serialization (architecture only).
        grid: The :class:`tfhybrid.process_grid.ProcessGrid` it was built for.
        objects: Live classes/functions ``source`` needs in this process
            (unregistered custom layers, Lambda functions; see :mod:`.source`).
    """

    def __init__(self, plan, graph, source, grid, objects=None):
        self.plan, self.graph, self.source, self.grid = plan, graph, source, grid
        self.objects = dict(objects or {})
        self.auto = None   # the AutoChoice record of strategy="auto" (tfhybrid.transformer.auto)


def _refuse_pairs_in_elastic_runs(strategy):
    """``p`` and ``ls`` transfer between pairs of ranks, which elastic runs
    cannot issue (there every group collective runs over the whole world and
    the groups of one collective must partition it: tfhybrid/comm/backend.py)."""
    from tfhybrid.comm import backend
    if backend.groups_over_world():
        raise ValueError(
            f"Received strategy={strategy!r} in an elastic run (horovodrun --min-np, or "
            "TFHYBRID_GROUPS_OVER_WORLD=1); its transfers between pairs of ranks cannot run "
            "without Horovod process sets. Use d, f, c, s, df, ds or gmp for elastic runs, "
            "or launch without --min-np/--max-np.")


def build(model, strategy="d", **options):
    """Build the hybrid-parallel counterpart of an unmodified Keras model.

    What :func:`tfhybrid.transform` (:mod:`tfhybrid.compose`) builds before it
    installs the guards: the parallel model of ``strategy`` on the current
    grid, holding this rank's part of global rank 0's weights (collective).
    Arguments and errors: :func:`tfhybrid.compose.transform`.

    Returns:
        An uncompiled, unguarded model: a Functional model, or a
        :class:`~tfhybrid.transformer.parts.PartModel` for ``p`` and ``ls``.
    """
    _refuse_transformed(model)
    opts = make_options(strategy, **options)
    grid = runtime.current_grid()
    if opts.strategy in ("ls", "p"):
        _refuse_pairs_in_elastic_runs(opts.strategy)
    if opts.strategy == "ls":     # ranks run different layers: tfhybrid/transformer/layer_separation.py
        from tfhybrid.transformer import layer_separation
        return _remember_source(model, layer_separation.build(
            model, grid, opts.fc_workers, opts.machine, opts.batch_size))
    if opts.strategy == "p":      # pipeline stages: tfhybrid/transformer/pipeline.py
        from tfhybrid.transformer import pipeline
        return _remember_source(model, pipeline.build(
            model, grid, opts.stages, opts.micro_batches, opts.machine,
            getattr(opts, "batch_norm", "sync")))
    functional = as_functional(model, flatten=True)     # nested models inlined
    graph = describe_graph(functional)
    auto_choice = None
    if opts.strategy == "auto":
        from tfhybrid.transformer import auto
        opts, auto_choice = auto.choose(model, graph, grid, options)
        grid = runtime.current_grid()      # auto may have re-formed it
    plan = make_plan(graph, opts, grid)
    source, objects = record_source(model)   # what gather needs; raises before any collective
    with root_weights(model):     # slice every block from global rank 0's weights
        new = rewrite(functional, plan, grid, opts.scheme)
    if plan.batch_split == "data" and grid.model_size > 1:
        _reduce_replicas_over_data(new)
    if opts.strategy == "gmp" and opts.average_every > 1:   # SplitBrain §4 (approximate)
        mark_model(new, periodic_layers(plan, graph, opts.ccr_threshold),
                   opts.average_every, opts.averaging)
    info = TransformInfo(plan, graph, source, grid, objects)
    info.auto = auto_choice
    object.__setattr__(new, INFO_ATTR, info)
    object.__setattr__(new, BATCH_SPLIT_ATTR, plan.batch_split)
    return _remember_source(model, new)


def _remember_source(source, new):
    """Record ``(weak reference, path)`` of ``source``'s variables on ``new``,
    so an optimizer configured with ``source``'s variables before
    ``transform`` (``exclude_from_weight_decay(var_list=...)``, which keys
    variables by object) is translated to ``new``'s variables of the same path
    at compile (see :func:`tfhybrid.guards.carry_weight_decay_exclusions`),
    and ``source``'s layers with their ``trainable`` flags, so that flags a
    script changes on them after ``transform`` (``base_model.trainable =
    True``) reach ``new`` at its next compile (see
    :func:`tfhybrid.guards.follow_source_flags`)."""
    import weakref

    object.__setattr__(new, "_tfhybrid_source_variables",
                       [(weakref.ref(v), v.path) for v in source.variables])
    object.__setattr__(new, "_tfhybrid_source_layers",
                       {layer.name: [weakref.ref(layer), layer.trainable]
                        for layer in weighted_leaves(source)})
    return new


def _refuse_transformed(model):
    """A transformed model (or one built from tfhybrid layers) is not transformed again."""
    info = getattr(model, INFO_ATTR, None)
    if info is not None:
        raise ValueError(
            f"Received model {getattr(model, 'name', model)!r}, which tfhybrid.transform "
            f"already returned (strategy {info.plan.strategy!r}): it is already transformed. "
            "Transform the original Keras model, or tfhybrid.gather(model) first to get the "
            "plain Keras model back and transform that.")
    for layer in getattr(model, "layers", None) or ():
        if type(layer).__module__.startswith("tfhybrid."):
            raise ValueError(
                f"Received model {getattr(model, 'name', model)!r} with tfhybrid layer "
                f"{layer.name!r} ({type(layer).__name__}): it is already transformed (or built "
                "from tfhybrid.layers by hand). Transform the original Keras model, or "
                "tfhybrid.gather(model) first to get the plain Keras model back.")


def _reduce_replicas_over_data(model):
    """Tag replicated weights: their gradient is identical within a model group.

    With the batch split over the data axis only, every rank of a model group
    computes on the same rows and replicated layers see replicated
    activations, so averaging their gradients over the data group suffices
    (the model axis would average identical copies).
    """
    for w in model.trainable_weights:
        layout = layout_of(w)
        if layout.kind == "replicated":
            set_layout(w, dataclasses.replace(layout, group="data"))


def info_of(model) -> TransformInfo:
    """The :class:`TransformInfo` of a transformed model.

    Raises:
        ValueError: if ``model`` was not returned by :func:`transform`.
    """
    info = getattr(model, INFO_ATTR, None)
    if info is None:
        raise ValueError(f"Received model {getattr(model, 'name', model)!r}, which was not "
                         "returned by tfhybrid.transform; pass the transformed model.")
    return info


def strategy_of(model) -> str:
    """The strategy a transformed model was built for."""
    if isinstance(model, PartModel):
        return model.tfhybrid_strategy
    return info_of(model).plan.strategy


def periodic_layers(plan, graph, ccr_threshold) -> tuple:
    """Names of the layers whose variables gmp averages periodically.

    The layers of the model-parallel region (their input holds the group's
    rows); without one (``mp=1``), the first Dense layer whose CCR reaches
    ``ccr_threshold`` and every layer that reads its output, directly or not.
    """
    region = tuple(n.name for n in plan.nodes if n.inputs and n.inputs[0].grouped)
    if region or plan.context.model_size > 1:
        return region
    tainted, names = set(), []
    for node in graph.nodes:
        first = not tainted and node.cls == "Dense" and formulas.splitbrain_partitions(
            formulas.splitbrain_ccr(node.in_channels or 0, node.attr("units") or 0),
            ccr_threshold)
        if first or any(t in tainted for t in node.inputs):
            tainted.add(node.output)
            names.append(node.name)
    return tuple(names)


def mark_model(model, names, every: int, method: str) -> int:
    """Mark the trainable variables of ``model``'s layers ``names`` (found inside
    ModuloLayer bodies too); returns the number marked."""
    marked = 0
    for name in names:
        for v in find_layer(model, name).trainable_variables:
            averaging.mark_periodic(v, every, method)
            marked += 1
    return marked
