"""Layer rules: how each kind of Keras layer treats activation layouts
(pure Python; generalises SplitBrain's Listing 1).

A :class:`Rule` answers, for one layer call and the layouts of its inputs,
which layouts the layer needs (the planner inserts boundary layers where
they differ), how the layer is rewritten (its *kind*) and the layout of its
output. Rules are small classes in a registry keyed by Keras class name:

* :class:`Elementwise` (ReLU, Dropout, ...): any layout passes through.
* :class:`Channelwise` (pooling, padding, cropping): keep ``channel``
  splits; a ``space`` split becomes a spatial pooling / zero-padding /
  cropping layer or is gathered first.
* :class:`Merge` (Add, Multiply, ...): inputs share one layout.
* :class:`BatchNorm`: ``SyncBatchNormalization`` over every rank that holds
  part of the same batch statistics.
* :class:`Linear` (Dense, Conv2D, Conv3D): replicated, filter-, channel- or
  spatially-parallel, as the strategy assigned.
* :class:`FullInput` (Flatten, Reshape, anything unknown): needs every
  feature of its rows, so split inputs are gathered first.
* :class:`Concat` (Concatenate along channels), :class:`UpSampling`
  (nearest): ``space`` blocks pass (a U-Net's skips and decoder run on
  blocks); :class:`Linear` also rebuilds Conv2DTranspose/Conv3DTranspose
  as spatial layers.

Example:
    >>> rule_for("Dense").plan(node, [REPLICATED_ACTIVATION], "filter", ctx).output
    Layout(kind='replicated', grouped=False)
"""
from __future__ import annotations

import dataclasses
from typing import Dict, Optional, Tuple

from tfhybrid.spatial_geometry import (SPATIAL_AXES, AxisGeometry, TransposeGeometry,
                                       window_output)
from tfhybrid.transformer.layouts import Layout

# Layers computed independently per element (or per example): any layout passes.
ELEMENTWISE = ("ReLU", "LeakyReLU", "ELU", "Dropout", "GaussianNoise", "GaussianDropout",
               "AlphaDropout", "Identity", "Rescaling", "ActivityRegularization", "Softmax",
               "SpatialDropout1D", "SpatialDropout2D", "SpatialDropout3D")
# Channel-mixing activations (need all features).
CHANNEL_MIXING = ("softmax", "log_softmax")
CHANNELWISE = ("MaxPooling2D", "AveragePooling2D", "GlobalAveragePooling2D",
               "GlobalMaxPooling2D", "ZeroPadding2D", "Cropping2D", "UpSampling2D",
               "MaxPooling3D", "AveragePooling3D", "GlobalAveragePooling3D",
               "GlobalMaxPooling3D", "ZeroPadding3D", "Cropping3D", "UpSampling3D")
SPATIAL_POOLS = ("MaxPooling2D", "AveragePooling2D", "MaxPooling3D", "AveragePooling3D")
# Layers that add (padding) or remove (cropping) rows at the global border, then re-block.
SPATIAL_BORDER = ("ZeroPadding2D", "Cropping2D", "ZeroPadding3D", "Cropping3D")
# Convolutions with a spatially parallel counterpart (SpatialConv2D / SpatialConv3D /
# SpatialDepthwiseConv2D / SpatialSeparableConv2D).
SPATIAL_CONVS = ("Conv2D", "Conv3D", "DepthwiseConv2D", "SeparableConv2D")
# Transposed convolutions with one (SpatialConv2DTranspose / SpatialConv3DTranspose).
SPATIAL_TRANSPOSED = ("Conv2DTranspose", "Conv3DTranspose")
# Every layer with weights that s/ds split spatially (the region's convolutions).
SPATIAL_WEIGHTED = SPATIAL_CONVS + SPATIAL_TRANSPOSED
# Nearest-neighbour up-sampling: block i of the input makes block i of the output.
SPATIAL_UPSAMPLING = ("UpSampling2D", "UpSampling3D")
# Shape-only layers with a spatial counterpart (pooling, padding and cropping the global border).
SPATIAL_WINDOWED = SPATIAL_POOLS + SPATIAL_BORDER
MERGES = ("Add", "Subtract", "Multiply", "Average", "Maximum", "Minimum")
# Layers with a filter-/channel-parallel counterpart (f, c, df, gmp).
LINEAR = ("Dense", "Conv2D", "Conv3D")
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
        spatial: Block grid of s/ds, one part per spatial axis of the
            model: (ph, pw) for images, (pd, ph, pw) for volumes; else None.
        batch_norm: ``"sync"`` (SyncBatchNormalization over the ranks
            sharing the statistics) or ``"local"`` (plain per-rank
            BatchNormalization, Horovod's behaviour).
    """

    strategy: str
    model_size: int
    data_size: int
    spatial: Optional[Tuple[int, int]] = None
    batch_norm: str = "sync"


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
        mixing = node.cls == "Softmax" or (node.cls == "Activation" and act in CHANNEL_MIXING)
        if mixing and not (layouts[0].kind == "space" and channels_last_axis(node)):
            return super().plan(node, layouts, kind, ctx)
        return Decision((None,) * len(layouts), "replicate", layouts[0])


def channels_last_axis(node) -> bool:
    """True when a Softmax/Concatenate acts along the last (channel) axis only."""
    axis = node.attr("axis", -1)
    rank = len(node.out_shape)
    return axis in (-1, rank - 1) if isinstance(axis, int) else tuple(axis) in ((-1,), (rank - 1,))


class Channelwise(Rule):
    """Pooling/padding: channel splits pass; space splits use spatial pooling."""

    def plan(self, node, layouts, kind, ctx):
        lay = layouts[0]
        if lay.kind != "space":
            return Decision((None,), "replicate", lay)
        if spatial_window(node, ctx.spatial):
            return Decision((None,), "spatial", lay, {"split": ctx.spatial,
                                                      **_folded_params(node)})
        if spatial_global_pool(node):   # the blocks' sums or maxima combined: no gather
            return Decision((None,), "spatial", lay.with_kind("replicated"),
                            {"split": ctx.spatial})
        return Decision(("replicated",), "replicate", lay.with_kind("replicated"))


class Merge(Rule):
    """Add/Multiply/...: equal layouts pass; replicated inputs joining space-split
    ones are scattered (no communication); other mixes are made full."""

    def plan(self, node, layouts, kind, ctx):
        kinds = {lay.kind for lay in layouts}
        if "space" in kinds and len({self._joined_shape(s) for s in node.in_shapes}) > 1:
            # a broadcast (a squeeze-excitation's (B, 1, 1, C) gate times the
            # (B, H, W, C) map): the block of one input is not the other's block
            return super().plan(node, layouts, kind, ctx)
        if all(lay == layouts[0] for lay in layouts):
            return Decision((None,) * len(layouts), "replicate", layouts[0])
        if kinds == {"space", "replicated"}:
            needs = tuple(None if lay.kind == "space" else "space" for lay in layouts)
            space = next(lay for lay in layouts if lay.kind == "space")
            return Decision(needs, "replicate", space)
        return super().plan(node, layouts, kind, ctx)

    @staticmethod
    def _joined_shape(shape):
        """The part of an input's shape the inputs share (all of it)."""
        return tuple(shape)


class Concat(Merge):
    """Concatenate along channels: ``space`` blocks (a U-Net's skip joining the
    decoder) and equal row layouts pass like :class:`Merge`; channel splits
    and concatenation along other axes need full inputs."""

    def plan(self, node, layouts, kind, ctx):
        if not channels_last_axis(node) or any(lay.kind == "channel" for lay in layouts):
            return Rule.plan(self, node, layouts, kind, ctx)
        return super().plan(node, layouts, kind, ctx)

    @staticmethod
    def _joined_shape(shape):
        """All but the channels, along which the inputs are joined."""
        return tuple(shape)[:-1]


class UpSampling(Channelwise):
    """UpSampling2D/3D: nearest-neighbour up-sampling of a ``space`` block is
    the block of the up-sampled tensor (no communication); bilinear
    UpSampling2D needs one row of each neighbour (SpatialUpSampling2D); the
    other interpolations gather first."""

    def plan(self, node, layouts, kind, ctx):
        if layouts[0].kind == "space" and spatial_local(node):
            return Decision((None,), "replicate", layouts[0])
        if layouts[0].kind == "space" and spatial_bilinear(node):
            return Decision((None,), "spatial", layouts[0], {"split": ctx.spatial})
        return super().plan(node, layouts, kind, ctx)


def spatial_bilinear(node) -> bool:
    """True for bilinear UpSampling2D (channels_last): on ``space`` blocks with a
    one-row halo (SpatialUpSampling2D)."""
    return node.cls == "UpSampling2D" and node.attr("interpolation", "nearest") == "bilinear" \
        and node.attr("data_format", "channels_last") == "channels_last"


def spatial_local(node) -> bool:
    """True for layers that compute a ``space`` block from the same block alone:
    nearest UpSampling2D/3D (block boundaries scale by the factor)."""
    return node.cls in SPATIAL_UPSAMPLING and \
        node.attr("interpolation", "nearest") == "nearest" and \
        node.attr("data_format", "channels_last") == "channels_last"


def per_voxel(node) -> bool:
    """True for layers with weights that act on each voxel of an image or volume
    alone: Dense on a (batch, spatial..., channels) tensor (a 1x1 convolution)
    and LayerNormalization over channels. On ``space`` blocks they run
    unchanged; their weight gradients are the blocks' shares (partial)."""
    shape = node.in_shapes[0] if node.in_shapes else ()
    if len(shape) not in (4, 5):
        return False
    if node.cls == "Dense":
        return True
    return node.cls == "LayerNormalization" and channels_last_axis(node)


def prelu_on_blocks(node) -> bool:
    """True for a PReLU on an image or volume whose ``alpha`` is shared along every
    spatial axis (``shared_axes=[1, 2]`` / ``[1, 2, 3]``, V-Net's): one slope per
    channel, the same on every block. A per-position ``alpha`` (the default) needs
    the whole image."""
    shape = node.in_shapes[0] if node.in_shapes else ()
    if node.cls != "PReLU" or len(shape) not in (4, 5):
        return False
    shared = node.attr("shared_axes") or ()
    shared = {int(a) for a in (shared if isinstance(shared, (list, tuple)) else (shared,))}
    return all(a in shared for a in range(1, len(shape) - 1))


class PReLU(Rule):
    """PReLU with one slope per channel: ``space`` blocks pass (partial ``alpha``:
    each block's gradient share, summed over the group)."""

    def plan(self, node, layouts, kind, ctx):
        if layouts[0].kind == "space" and prelu_on_blocks(node):
            return Decision((None,), "replicate", layouts[0], {"weights": "partial"})
        return super().plan(node, layouts, kind, ctx)


class PerVoxel(Rule):
    """LayerNormalization over channels: ``space`` blocks pass (partial weights)."""

    def plan(self, node, layouts, kind, ctx):
        if layouts[0].kind == "space" and per_voxel(node):
            return Decision((None,), "replicate", layouts[0], {"weights": "partial"})
        return super().plan(node, layouts, kind, ctx)


class GroupNorm(Rule):
    """GroupNormalization over channels (last axis): on ``space`` blocks it sums
    each sample's moments over the group (SpatialGroupNormalization); other
    layouts need full inputs."""

    def plan(self, node, layouts, kind, ctx):
        if layouts[0].kind == "space" and channels_last_axis(node):
            return Decision((None,), "spatial", layouts[0], {"split": ctx.spatial})
        return super().plan(node, layouts, kind, ctx)


def runs_on_blocks(node) -> bool:
    """True for layers that compute a ``space`` block from that block alone (they
    do not end the spatial region of s/ds): element-wise layers and merges,
    BatchNormalization (synchronised), softmax over channels, Concatenate
    along channels, nearest UpSampling2D/3D and bilinear UpSampling2D (a one-row
    halo), Dense and LayerNormalization per voxel, PReLU with one slope per channel,
    GroupNormalization over channels (moments summed over the blocks).

    Example:
        >>> runs_on_blocks(node_of(keras.layers.Concatenate()))
        True
    """
    if node.attr("operation") == "concat":   # keras.ops.concatenate
        return channels_last_axis(node)
    if node.attr("operation"):     # keras.ops: x / 255.0, a + b of one shape
        return node.attr("operation") in ("elementwise", "merge")
    if node.attr("folded_into"):   # a padding its convolution applies (fold_padding)
        return True
    if node.cls == "Softmax" or (node.cls == "Activation" and
                                 node.attr("activation") in CHANNEL_MIXING):
        return channels_last_axis(node)
    if node.cls in ("Concatenate", "GroupNormalization"):
        return channels_last_axis(node)
    if spatial_local(node) or spatial_bilinear(node) or per_voxel(node) or prelu_on_blocks(node):
        return True
    return node.cls in ELEMENTWISE + MERGES + ("Activation", "BatchNormalization") and \
        node.attr("activation") not in CHANNEL_MIXING


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
        if ctx.batch_norm == "local":     # Horovod's per-rank statistics (not exact)
            params = {"batch_norm": "local"} if n > 1 else {}
            if lay.kind == "space":       # gamma/beta gradients: the blocks' shares
                params["weights"] = "partial"
            return Decision(needs, "replicate", lay, params)
        if n == 1:
            return Decision(needs, "replicate", lay)
        return Decision(needs, "syncbn", lay, {"bn_groups": groups})


class Linear(Rule):
    """Dense/Conv2D/Conv3D, rebuilt as the strategy assigned (``kind``).

    Kinds: ``replicate`` (full input), ``filter`` (replicated input; output
    ``channel`` when paired with a following channel layer, else
    replicated), ``channel`` (replicated or, when paired, ``channel`` input;
    replicated output), ``spatial`` (``space`` in and out).
    """

    def plan(self, node, layouts, kind, ctx):
        lay = layouts[0]
        if kind == "replicate":
            if lay.kind == "space" and per_voxel(node):   # a Dense head on blocks
                return Decision((None,), "replicate", lay, {"weights": "partial"})
            return super().plan(node, layouts, kind, ctx)
        rows = Layout("replicated", lay.grouped or lay.kind == "rows")
        if kind == "spatial":
            params = {"split": ctx.spatial}
            if node.attr("folded_padding"):     # it pads at the border itself
                params.update(_folded_params(node))
            return Decision(("space",), "spatial", lay.with_kind("space"), params)
        if kind in ("filter", "filter_split"):
            split = kind == "filter_split"
            out = rows.with_kind("channel") if split else rows
            return Decision(("replicated",), "filter", out,
                            {"output_layout": "split" if split else "replicated"})
        paired = kind == "channel_split" and lay.kind == "channel"
        return Decision(("channel" if paired else "replicated",), "channel", rows,
                        {"input_layout": "split" if paired else "replicated"})


GLOBAL_POOLS = ("GlobalAveragePooling2D", "GlobalAveragePooling3D", "GlobalMaxPooling2D",
                "GlobalMaxPooling3D")


def spatial_global_pool(node) -> bool:
    """True for a channels-last GlobalAveragePooling2D/3D or GlobalMaxPooling2D/3D:
    on ``space`` blocks it pools each block and combines the blocks' sums
    (all-reduce) or maxima (all-gather) into a replicated output
    (:mod:`tfhybrid.layers.spatial.global_pool`), without gathering the feature map.

    Example:
        >>> spatial_global_pool(node_of(keras.layers.GlobalAveragePooling3D()))
        True
    """
    return node.cls in GLOBAL_POOLS and \
        node.attr("data_format", "channels_last") == "channels_last"


def spatial_window(node, spatial) -> bool:
    """True when a pooling, ZeroPadding2D or Cropping2D/3D layer can run on ``spatial`` blocks.

    Its input and output sizes along every split axis must split evenly, and the rows a
    block needs from a neighbour (a pooling window's halo; the rows by
    which padding or cropping at the global border shifts the block
    boundaries) must fit in one block.

    Example:
        >>> spatial_window(node_of(ZeroPadding2D(3), in_hw=(32, 32)), (2, 1))
        True
    """
    return node.cls in SPATIAL_WINDOWED and spatial_problem(node, spatial) is None


def border_rows(node):
    """Rows per spatial axis ((top, bottom), (left, right)) a padding (+) or
    cropping (-) layer adds."""
    if node.cls.startswith("Cropping"):
        return tuple((-int(lo), -int(hi)) for lo, hi in node.attr("cropping"))
    return tuple((int(lo), int(hi)) for lo, hi in node.attr("padding"))


def _per_axis(value, default, ndim):
    value = default if value is None else value
    return tuple(value) if isinstance(value, (tuple, list)) else (value,) * ndim


def spatial_ndim(node) -> int:
    """Spatial axes of a layer: 3 for the *3D layers (NDHWC, Conv3DTranspose too), else 2."""
    return 3 if node.cls.endswith("3D") or node.cls.endswith("3DTranspose") else 2


def window_specs(node):
    """Per spatial axis ((depth,) height, width): (window, stride, padding) of a
    sliding-window layer."""
    if node.cls in SPATIAL_BORDER:
        return [(1, 1, rows) for rows in border_rows(node)]
    n = spatial_ndim(node)
    if node.cls in SPATIAL_WEIGHTED:
        sizes = [d * (k - 1) + 1 for k, d in zip(_per_axis(node.attr("kernel_size"), 1, n),
                                                 _per_axis(node.attr("dilation_rate"), 1, n))]
        strides = _per_axis(node.attr("strides"), 1, n)
    else:
        sizes = _per_axis(node.attr("pool_size"), 2, n)
        strides = _per_axis(node.attr("strides"), sizes, n)
    rows = node.attr("border_padding")      # a folded ZeroPadding (fold_padding)
    if rows:
        return [(w, s, tuple(r)) for w, s, r in zip(sizes, strides, rows)]
    return [(w, s, node.attr("padding", "valid")) for w, s in zip(sizes, strides)]


def spatial_problem(node, spatial) -> Optional[str]:
    """Why a Conv2D/Conv3D, pooling, padding or cropping layer cannot run on
    ``spatial`` blocks of its input ((ph, pw) for images, (pd, ph, pw) for
    volumes), or None when it can.

    Uses the geometry of the spatial layers
    (:class:`tfhybrid.spatial_geometry.AxisGeometry`): both sizes of
    every split axis divide, and the halo fits in one block.

    Example:
        >>> conv = node_of(Conv2D(8, 3, padding="same"), in_hw=(6, 6))
        >>> spatial_problem(conv, (4, 1)).split(": ")[-1]
        'along height, size 6 does not split evenly over 4 ranks'
        >>> spatial_problem(conv, (2, 2)) is None
        True
    """
    if not spatial:
        return "the strategy has no spatial grid"
    shape_in, shape_out = node.in_shapes[0], node.out_shape
    ndim = len(spatial)
    names = SPATIAL_AXES[ndim]
    head = (f"its input {_hw(shape_in, ndim)} / output {_hw(shape_out, ndim)} "
            f"({' x '.join(names)}) do not split over the "
            f"{'x'.join(map(str, spatial))} spatial grid")
    if len(shape_in) != ndim + 2 or len(shape_out) != ndim + 2 or spatial_ndim(node) != ndim:
        kind = "an image-shaped (NHWC)" if ndim == 2 else "a volume-shaped (NDHWC)"
        return f"{head}: it is not {kind} layer"
    if node.attr("data_format", "channels_last") != "channels_last":
        return f"data_format={node.attr('data_format')!r} (channels_last needed)"
    transposed = node.cls in SPATIAL_TRANSPOSED
    if transposed and (node.attr("output_padding") is not None or any(
            v != 1 for v in _per_axis(node.attr("dilation_rate"), 1, ndim))):
        return f"{head}: output_padding or dilation_rate is set (spatial: neither)"
    for d, (axis, parts, (window, stride, padding)) in enumerate(zip(names, spatial,
                                                                     window_specs(node))):
        size = shape_in[d + 1]
        if size is None:
            return f"{head}: its {axis} is unknown (None)"
        geometry = (TransposeGeometry if transposed else AxisGeometry)(size, parts, window,
                                                                       stride, padding)
        problem = geometry.problem()
        if problem is None and geometry.out_size != shape_out[d + 1]:
            problem = "tfhybrid's geometry does not reproduce its output size"
        if problem:
            return f"{head}: along {axis}, {problem}"
    return None


def _hw(shape, ndim=2):
    return "x".join(str(v) for v in shape[1:ndim + 1]) if len(shape) >= ndim + 1 else str(shape)


def _same_pads(size, window, stride):
    """TensorFlow's ``same`` padding (before, after) of one axis."""
    out, before = window_output(size, window, stride, "same")
    return before, max((out - 1) * stride + window - size, 0) - before


# valid window layers whose spatial counterpart pads a folded ZeroPadding itself
# (``border_padding``: zeros at the global border only)
BORDER_PADDED = ("Conv2D", "Conv3D") + SPATIAL_POOLS


def fold_padding(graph, spatial=None):
    """``graph`` (a GraphSpec) with each ``ZeroPadding`` that only feeds a
    ``valid`` convolution or pooling described as part of that layer, so that
    spatial strategies split the unpadded tensor and the layer pads at the
    global border only.

    * Padding exactly as the convolution's ``same`` padding would (Keras
      applications' ``correct_pad`` before a stride-2 convolution: MobileNetV2,
      EfficientNet): the convolution gets ``padding="same"``.
    * Other padding before a ``Conv2D/3D`` or a pooling layer (ResNet's
      ``ZeroPadding2D(3)`` before its 7x7 stride-2 stem and ``ZeroPadding2D(1)``
      before its first max pooling): the layer gets ``attrs["border_padding"]``,
      the rows per axis, when ``spatial`` (the block grid, per spatial axis) is
      None or splits the unpadded sizes evenly. E.g. ResNet-50 at 224x224 on a
      4x1 grid: the padded 230 rows do not split over 4 ranks, the 224 do.

    The padding node keeps its name and class, with ``attrs["folded_into"]``
    (the layer) and its input shape as output shape; the layer gets
    ``attrs["folded_padding"]`` and that input shape.

    Example:
        >>> [n.attr("padding") for n in fold_padding(spec).nodes][:2]
        [((0, 1), (0, 1)), 'same']
    """
    nodes = list(graph.nodes)
    index = {n.name: i for i, n in enumerate(nodes)}
    for i, pad in enumerate(graph.nodes):
        if not pad.cls.startswith("ZeroPadding") or pad.output in graph.outputs:
            continue
        users = graph.consumers(pad.output)
        if len(users) != 1 or users[0].cls not in SPATIAL_CONVS + SPATIAL_POOLS:
            continue
        layer, shape = users[0], pad.in_shapes[0]
        ndim = spatial_ndim(pad)
        if str(layer.attr("padding", "valid")).lower() != "valid" or len(shape) != ndim + 2 \
                or spatial_ndim(layer) != ndim \
                or layer.attr("data_format", "channels_last") != "channels_last":
            continue
        sizes = shape[1:ndim + 1]
        if any(n is None for n in sizes):
            continue
        rows = tuple(tuple(int(v) for v in r) for r in pad.attr("padding"))
        same = layer.cls in SPATIAL_CONVS and all(
            r == _same_pads(n, window, stride)
            for r, n, (window, stride, _) in zip(rows, sizes, window_specs(layer)))
        if same:
            folded = {"padding": "same"}
        elif layer.cls in BORDER_PADDED and (spatial is None or len(spatial) != ndim or all(
                n % parts == 0 for n, parts in zip(sizes, spatial))):
            folded = {"border_padding": rows}
        else:
            continue
        j = index[layer.name]
        nodes[j] = dataclasses.replace(nodes[j], in_shapes=(tuple(shape),),
                                       attrs={**nodes[j].attrs, **folded,
                                              "folded_padding": pad.name})
        # a pooling runs on blocks when its input does and it fits the grid (no kind
        # of its own): the padding records whether it fits (FoldedPadding.plan)
        fits = layer.cls in SPATIAL_POOLS and spatial is not None and \
            spatial_problem(nodes[j], spatial) is None
        nodes[i] = dataclasses.replace(pad, out_shape=tuple(shape),
                                       attrs={**pad.attrs, "folded_into": layer.name,
                                              "folded_pool_fits": fits})
    return dataclasses.replace(graph, nodes=tuple(nodes))


def _folded_params(node):
    """The rebuild arguments of a layer a ZeroPadding folded into (fold_padding)."""
    if not node.attr("folded_padding"):
        return {}
    if node.attr("border_padding"):
        return {"border_padding": node.attr("border_padding")}
    return {"padding": "same"}


class FoldedPadding(Rule):
    """A ZeroPadding that its spatial convolution or pooling applies
    (:func:`~tfhybrid.transformer.rules.fold_padding`): with kind ``spatial``
    (its convolution's), or on blocks before a pooling that fits the grid, it
    takes blocks and passes them through (``fold``); otherwise it pads the
    whole input, as the layer does."""

    def plan(self, node, layouts, kind, ctx):
        pool = node.attr("folded_pool_fits") and layouts[0].kind == "space"
        if kind == "spatial" or pool:   # its convolution/pooling runs on blocks: split here
            return Decision(("space",), "fold", layouts[0].with_kind("space"))
        if layouts[0].kind == "space":
            return super().plan(node, layouts, "replicate", ctx)     # gathers the blocks
        return rule_for(node.cls).plan(node, layouts, "replicate", ctx)


_FOLDED = FoldedPadding()
_RULES = {}
for _names, _rule in ((ELEMENTWISE + ("Activation",), Elementwise()), (CHANNELWISE, Channelwise()),
                      (MERGES, Merge()), (("BatchNormalization",), BatchNorm()),
                      (LINEAR + SPATIAL_WEIGHTED, Linear()), (("Concatenate",), Concat()),
                      (SPATIAL_UPSAMPLING, UpSampling()), (("LayerNormalization",), PerVoxel()),
                      (("GroupNormalization",), GroupNorm()), (("PReLU",), PReLU())):
    for _name in _names:
        _RULES[_name] = _rule
_DEFAULT = FullInput()


_OPERATIONS = {"elementwise": Elementwise(), "merge": Merge(), "concat": Concat(),
               "full": _DEFAULT}


def rule_for(cls_name: str) -> Rule:
    """The rule of a Keras layer class (FullInput for unknown classes)."""
    return _RULES.get(cls_name, _DEFAULT)


def rule_of(node) -> Rule:
    """The rule of one node: by layer class, or for a ``keras.ops`` operation
    (``x / 255.0``) by the kind :func:`~tfhybrid.transformer.graph.operation_kind`
    recorded in ``attrs["operation"]``."""
    if node.attr("folded_into"):
        return _FOLDED
    kind = node.attr("operation")
    return _OPERATIONS[kind] if kind else rule_for(node.cls)


def nested_model_hint(node) -> str:
    """The fix for a nested model (a Keras model called as a layer of the outer
    one, as in transfer learning), which tfhybrid sees as one layer; '' otherwise."""
    if not node.attr("nested_model"):
        return ""
    return (f" {node.name!r} is a model used as a layer ({node.cls}): tfhybrid partitions "
            "the outer model's own layers and cannot look inside it. Build the model flat: "
            "call the inner model's layers on your tensors (x = inp; for layer in "
            f"{node.name}.layers: x = layer(x), for a Sequential), or for "
            "keras.applications pass input_tensor=inp and build the head on its output.")
