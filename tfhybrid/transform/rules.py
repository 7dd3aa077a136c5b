"""Layer rules: how each kind of Keras layer treats activation layouts
(pure Python; generalises SplitBrain's Listing 1).

A :class:`Rule` answers, for one layer call and the layouts of its inputs,
which layouts the layer needs (the planner inserts boundary layers where
they differ), how the layer is rewritten (its *kind*) and the layout of its
output. Rules are small classes in a registry keyed by Keras class name:

* :class:`Elementwise` (ReLU, Dropout, ...): any layout passes through.
* :class:`Channelwise` (pooling, padding): keep ``channel`` splits; a
  ``space`` split becomes a spatial pooling / zero-padding layer or is
  gathered first.
* :class:`Merge` (Add, Multiply, ...): inputs share one layout.
* :class:`BatchNorm`: ``SyncBatchNormalization`` over every rank that holds
  part of the same batch statistics.
* :class:`Linear` (Dense, Conv2D): replicated, filter-, channel- or
  spatially-parallel, as the strategy assigned.
* :class:`FullInput` (Flatten, Reshape, anything unknown): needs every
  feature of its rows, so split inputs are gathered first.

Example:
    >>> rule_for("Dense").plan(node, [REPLICATED], "filter", ctx).output
    Layout(kind='replicated', grouped=False)
"""
from __future__ import annotations

import dataclasses
from typing import Dict, Optional, Tuple

from tfhybrid.transform.layouts import Layout

# Layers computed independently per element (or per example): any layout passes.
ELEMENTWISE = ("ReLU", "LeakyReLU", "ELU", "Dropout", "GaussianNoise", "GaussianDropout",
               "AlphaDropout", "Identity", "Rescaling", "ActivityRegularization", "Softmax")
# Channel-mixing activations (need all features).
CHANNEL_MIXING = ("softmax", "log_softmax")
CHANNELWISE = ("MaxPooling2D", "AveragePooling2D", "GlobalAveragePooling2D",
               "GlobalMaxPooling2D", "ZeroPadding2D", "Cropping2D", "UpSampling2D")
SPATIAL_POOLS = ("MaxPooling2D", "AveragePooling2D")
# Shape-only layers with a spatial counterpart (pooling; ZeroPadding2D padding the global border).
SPATIAL_WINDOWED = SPATIAL_POOLS + ("ZeroPadding2D",)
MERGES = ("Add", "Subtract", "Multiply", "Average", "Maximum", "Minimum")
LINEAR = ("Dense", "Conv2D")
# Layers with weights that are correct replicated on full rows (no partitioning needed).
REPLICABLE = ("BatchNormalization", "LayerNormalization", "GroupNormalization",
              "Normalization", "PReLU")


@dataclasses.dataclass(frozen=True)
class Context:
    """What a rule needs to know about the run (pure data).

    Attributes:
        strategy: Strategy name.
        model_size: K, ranks of a model group.
        data_size: Number of model groups.
        spatial: (ph, pw) spatial grid of s/ds, else None.
    """

    strategy: str
    model_size: int
    data_size: int
    spatial: Optional[Tuple[int, int]] = None


@dataclasses.dataclass(frozen=True)
class Decision:
    """A rule's answer for one layer call.

    Attributes:
        needs: Per input, the layout kind the layer needs (None: as is).
        kind: How the layer is rebuilt: "replicate", "filter", "channel",
            "spatial", "syncbn".
        output: Layout of the output (given ``needs`` are met).
        params: Extra rebuild arguments (``input_layout``, ``output_layout``,
            ``bn_groups``, ``split``).
    """

    needs: Tuple[Optional[str], ...]
    kind: str
    output: Layout
    params: Dict[str, object] = dataclasses.field(default_factory=dict)


def _full(layout: Layout) -> Optional[str]:
    """The kind a FullInput layer needs for ``layout`` (None if already full)."""
    return None if layout.full else "replicated"


class Rule:
    """Base rule: the layer needs full inputs and keeps their row layout."""

    def plan(self, node, layouts, kind, ctx) -> Decision:
        needs = tuple(_full(lay) for lay in layouts)
        first = layouts[0] if layouts else Layout("replicated")
        out = first if first.full else first.with_kind("replicated")
        return Decision(needs, "replicate", out)


class FullInput(Rule):
    """Flatten, Reshape, Concatenate, unknown layers: gather split inputs."""


class Elementwise(Rule):
    """Per-element layers: the output has the input's layout."""

    def plan(self, node, layouts, kind, ctx):
        act = node.attr("activation")
        if node.cls == "Softmax" or (node.cls == "Activation" and act in CHANNEL_MIXING):
            return super().plan(node, layouts, kind, ctx)
        return Decision((None,) * len(layouts), "replicate", layouts[0])


class Channelwise(Rule):
    """Pooling/padding: channel splits pass; space splits use spatial pooling."""

    def plan(self, node, layouts, kind, ctx):
        lay = layouts[0]
        if lay.kind != "space":
            return Decision((None,), "replicate", lay)
        if spatial_window(node, ctx.spatial):
            return Decision((None,), "spatial", lay, {"split": ctx.spatial})
        return Decision(("replicated",), "replicate", lay.with_kind("replicated"))


class Merge(Rule):
    """Add/Multiply/...: equal layouts pass; replicated inputs joining space-split
    ones are scattered (no communication); other mixes are made full."""

    def plan(self, node, layouts, kind, ctx):
        if all(lay == layouts[0] for lay in layouts):
            return Decision((None,) * len(layouts), "replicate", layouts[0])
        kinds = {lay.kind for lay in layouts}
        if kinds == {"space", "replicated"}:
            needs = tuple(None if lay.kind == "space" else "space" for lay in layouts)
            space = next(lay for lay in layouts if lay.kind == "space")
            return Decision(needs, "replicate", space)
        return super().plan(node, layouts, kind, ctx)


class BatchNorm(Rule):
    """BatchNormalization -> SyncBatchNormalization over the ranks sharing its statistics.

    Rows split over the world (``rows``) or space split over the model group
    (``space``) sync over data and model groups; replicated rows sync over
    the data groups only. With one rank in that set it stays a plain layer.
    """

    def plan(self, node, layouts, kind, ctx):
        lay = layouts[0]
        if lay.kind == "channel":
            lay = lay.with_kind("replicated")
        needs = ("replicated",) if layouts[0].kind == "channel" else (None,)
        if lay.kind in ("rows", "space"):
            groups, n = ("data", "model"), ctx.data_size * ctx.model_size
        else:
            groups, n = ("data",), ctx.data_size
        if n == 1:
            return Decision(needs, "replicate", lay)
        return Decision(needs, "syncbn", lay, {"bn_groups": groups})


class Linear(Rule):
    """Dense/Conv2D, rebuilt as the strategy assigned (``kind``).

    Kinds: ``replicate`` (full input), ``filter`` (replicated input; output
    ``channel`` when paired with a following channel layer, else
    replicated), ``channel`` (replicated or, when paired, ``channel`` input;
    replicated output), ``spatial`` (``space`` in and out).
    """

    def plan(self, node, layouts, kind, ctx):
        lay = layouts[0]
        if kind == "replicate":
            return super().plan(node, layouts, kind, ctx)
        rows = Layout("replicated", lay.grouped or lay.kind == "rows")
        if kind == "spatial":
            return Decision(("space",), "spatial", lay.with_kind("space"), {"split": ctx.spatial})
        if kind in ("filter", "filter_split"):
            split = kind == "filter_split"
            out = rows.with_kind("channel") if split else rows
            return Decision(("replicated",), "filter", out,
                            {"output_layout": "split" if split else "replicated"})
        paired = kind == "channel_split" and lay.kind == "channel"
        return Decision(("channel" if paired else "replicated",), "channel", rows,
                        {"input_layout": "split" if paired else "replicated"})


def spatial_window(node, spatial) -> bool:
    """True when a pooling or ZeroPadding2D layer can run on ``spatial`` blocks.

    Its input and output height/width must split evenly; for zero padding,
    the rows by which the border padding shifts the block boundaries must
    also fit in one block (they come from the neighbour).

    Example:
        >>> spatial_window(node_of(ZeroPadding2D(3), in_hw=(32, 32)), (2, 1))
        True
    """
    if node.cls not in SPATIAL_WINDOWED or not _space_divisible(node, spatial):
        return False
    if node.cls != "ZeroPadding2D":
        return True
    pads = node.attr("padding")
    for axis, parts in zip((1, 2), spatial):
        (lo, hi), size = pads[axis - 1], node.in_shapes[0][axis]
        if _reblock_rows(size, parts, lo, hi) > size // parts:
            return False
    return True


def _reblock_rows(size, parts, lo, hi) -> int:
    """Most rows a rank receives from a neighbour when padding (lo, hi) re-blocks an axis."""
    n, m = size // parts, (size + lo + hi) // parts
    before = [i * n - (i * m - lo) for i in range(1, parts)]
    after = [(i + 1) * m - lo - (i + 1) * n for i in range(parts - 1)]
    return max([0] + before + after)


def _space_divisible(node, spatial) -> bool:
    """True when the node's input and output height/width split over ``spatial``."""
    if not spatial:
        return False
    for shape in (node.in_shapes[0], node.out_shape):
        for axis, parts in zip((1, 2), spatial):
            size = shape[axis] if len(shape) > axis else None
            if size is None or size % parts:
                return False
    return True


_RULES = {}
for _names, _rule in ((ELEMENTWISE + ("Activation",), Elementwise()), (CHANNELWISE, Channelwise()),
                      (MERGES, Merge()), (("BatchNormalization",), BatchNorm()),
                      (LINEAR, Linear())):
    for _name in _names:
        _RULES[_name] = _rule
_DEFAULT = FullInput()


def rule_for(cls_name: str) -> Rule:
    """The rule of a Keras layer class (FullInput for unknown classes)."""
    return _RULES.get(cls_name, _DEFAULT)


def space_divisible(node, spatial) -> bool:
    """Public form of the spatial divisibility test (used by strategies)."""
    return _space_divisible(node, spatial)
