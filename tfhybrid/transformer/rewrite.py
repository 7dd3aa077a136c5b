"""Build the parallel Keras model of a :class:`~tfhybrid.transformer.planner.Plan`.

The original Functional graph is re-run node by node
(``Functional._run_through_graph``, the walk ``keras.models.clone_model``
uses) with two hooks: each layer is rebuilt by the builder of its planned
kind (:data:`BUILDERS`: a copy with the original weights, a
filter/channel-parallel layer holding this rank's slice, a spatial layer,
a SyncBatchNormalization), and each call first passes its inputs through
the planned boundary layers (:data:`BOUNDARIES`: ModuloLayer and its inverse,
SpatialScatter/SpatialGather). The original model is not modified.
"""
from __future__ import annotations

import zlib

import keras

from tfhybrid import layers as P
from tfhybrid.layers.partitioned import IO_PARTIAL_GRAD, IO_REPLICATED
from tfhybrid.layout import VariableLayout, set_layout
from tfhybrid.spatial_geometry import SPATIAL_AXES
from tfhybrid.transformer.graph import is_operation
from tfhybrid.transformer.source import copy_layer, finalize_states

GROUP = "model"


def _split_arg(split):
    """The spatial layers' ``split`` argument for a block grid: the axis name
    when one axis is split ((2, 1) -> "height", (1, 1, 2) -> "width"), else
    the grid itself."""
    names = SPATIAL_AXES[len(split)]
    split_axes = [name for name, parts in zip(names, split) if parts > 1]
    if len(split_axes) == 1:
        return split_axes[0]
    if not split_axes:
        return names[0]
    return tuple(split)


def _entry_partial(np) -> bool:
    """True when a ModuloLayer feeds a partitioned layer that leaves its input gradient P."""
    return np.kind in ("filter", "channel") and np.conversions[:1] == ("modulo",) and \
        np.params.get("input_layout", IO_REPLICATED) == IO_REPLICATED


# -- builders: original layer + NodePlan -> new layer ------------------------------

def _copy(layer, np, grid):
    config = layer.get_config()
    if np.cls == "Dropout" or np.cls.startswith("SpatialDropout"):
        config["seed"] = _dropout_seed(layer, np, grid)
    return copy_layer(layer, config)    # a Lambda keeps its live function


def _dropout_seed(layer, np, grid):
    """Same seed on the ranks holding the same tensor (R), distinct otherwise. A
    SpatialDropout on spatial blocks draws one channel mask per sample: the same
    seed on the blocks of a sample (its model group), so they drop the same channels."""
    base = layer.seed if layer.seed is not None else zlib.crc32(layer.name.encode()) % 10007
    shared = np.inputs[0].kind == "replicated" or (
        np.cls.startswith("SpatialDropout") and np.inputs[0].kind == "space")
    member = grid.data_rank if shared else grid.rank
    return int(base) + 7919 * member


# The filter- and channel-parallel class of each rules.LINEAR layer.
_FILTER = {"Dense": P.FilterParallelDense, "Conv2D": P.FilterParallelConv2D,
           "Conv3D": P.FilterParallelConv3D}
_CHANNEL = {"Dense": P.ChannelParallelDense, "Conv2D": P.ChannelParallelConv2D,
            "Conv3D": P.ChannelParallelConv3D}


def _filter(layer, np, grid):
    cls = _FILTER[np.cls]
    inp = IO_PARTIAL_GRAD if _entry_partial(np) else IO_REPLICATED
    return cls.from_layer(layer, group=GROUP, input_layout=inp,
                          output_layout=np.params["output_layout"])


def _channel(layer, np, grid):
    cls = _CHANNEL[np.cls]
    inp = np.params["input_layout"]
    if _entry_partial(np):
        inp = IO_PARTIAL_GRAD
    return cls.from_layer(layer, group=GROUP, input_layout=inp, output_layout=IO_REPLICATED)


_SPATIAL_POOLS = {"MaxPooling2D": "SpatialMaxPooling2D", "AveragePooling2D": "SpatialAveragePooling2D",
                  "MaxPooling3D": "SpatialMaxPooling3D", "AveragePooling3D": "SpatialAveragePooling3D"}
# Layers with a from_layer constructor (same arguments and name as the original).
_SPATIAL_COPIES = {"Conv2D": P.SpatialConv2D, "DepthwiseConv2D": P.SpatialDepthwiseConv2D,
                   "SeparableConv2D": P.SpatialSeparableConv2D, "ZeroPadding2D": P.SpatialZeroPadding2D,
                   "Cropping2D": P.SpatialCropping2D, "Conv3D": P.SpatialConv3D,
                   "ZeroPadding3D": P.SpatialZeroPadding3D, "Cropping3D": P.SpatialCropping3D,
                   "Conv2DTranspose": P.SpatialConv2DTranspose,
                   "Conv3DTranspose": P.SpatialConv3DTranspose,
                   "GroupNormalization": P.SpatialGroupNormalization,
                   "UpSampling2D": P.SpatialUpSampling2D,
                   "GlobalAveragePooling2D": P.SpatialGlobalAveragePooling2D,
                   "GlobalAveragePooling3D": P.SpatialGlobalAveragePooling3D,
                   "GlobalMaxPooling2D": P.SpatialGlobalMaxPooling2D,
                   "GlobalMaxPooling3D": P.SpatialGlobalMaxPooling3D}


def _spatial(layer, np, grid):
    split = _split_arg(np.params["split"])
    if np.cls in _SPATIAL_COPIES:
        return _SPATIAL_COPIES[np.cls].from_layer(layer, split=split, group=GROUP,
                                                  **_folded(np))
    config = {k: v for k, v in layer.get_config().items() if k != "data_format"}
    return getattr(P, _SPATIAL_POOLS[np.cls])(split=split, group=GROUP, **config, **_folded(np))


def _folded(np):
    """The padding a folded ZeroPadding hands its layer (rules.fold_padding)."""
    return {k: np.params[k] for k in ("padding", "border_padding") if k in np.params}


def _syncbn(layer, np, grid):
    groups = np.params["bn_groups"]
    spatial = GROUP if np.inputs[0].kind == "space" else None
    return P.SyncBatchNormalization.from_layer(layer, groups=groups, spatial_group=spatial)


def _fold(layer, np, grid):
    """A ZeroPadding its spatial convolution applies ('same'): the blocks pass."""
    return keras.layers.Identity(name=layer.name)


BUILDERS = {"replicate": _copy, "filter": _filter, "channel": _channel, "spatial": _spatial,
            "syncbn": _syncbn, "fold": _fold}
_COPIES_WEIGHTS_AFTER_CALL = ("replicate",)


# -- boundaries: (conversion, consumer plan, ctx) -> layer -----------------------

def _modulo(np, ctx, name):
    out = IO_PARTIAL_GRAD if np is not None and _entry_partial(np) else IO_REPLICATED
    return P.ModuloLayer("BK", group=GROUP, output_layout=out, name=name)


def _unmodulo(np, ctx, name):
    return P.ModuloInverseLayer(group=GROUP, input_layout=IO_REPLICATED, name=name)


def _space_scatter(np, ctx, name):
    return P.SpatialScatter(split=_split_arg(ctx.spatial), group=GROUP, name=name)


def _space_gather(np, ctx, name):
    return P.SpatialGather(split=_split_arg(ctx.spatial), group=GROUP, name=name)


BOUNDARIES = {"modulo": _modulo, "unmodulo": _unmodulo, "space_scatter": _space_scatter,
              "space_gather": _space_gather}


def _boundary(conversion, np, ctx, name):
    if conversion not in BOUNDARIES:
        raise ValueError(f"tfhybrid.transform: no boundary layer for conversion "
                         f"{conversion!r} before {name!r} (internal planning error).")
    return BOUNDARIES[conversion](np, ctx, name)


# -- the walk -------------------------------------------------------------------------

class _Rewriter:
    """Holds the maps between original layers, new layers and node plans."""

    def __init__(self, model, plan, grid, scheme="BK"):
        self.model, self.plan, self.grid, self.scheme = model, plan, grid, scheme
        self.by_name = {np.name: np for np in plan.nodes}
        self.source = {}    # id(new layer) -> (original layer, NodePlan)

    def clone(self, layer):
        np = self.by_name[layer.name]
        # a keras.ops operation (x / 255.0) holds no state: the new graph calls it as is
        new = layer if is_operation(layer) else BUILDERS[np.kind](layer, np, self.grid)
        self.source[id(new)] = (layer, np)
        return new

    def call(self, new, *args, **kwargs):
        layer, np = self.source[id(new)]
        counter = iter(range(len(np.conversions)))

        def convert(x):
            if not isinstance(x, keras.KerasTensor):
                return x
            i = next(counter)
            conv = np.conversions[i]
            return x if conv is None else _boundary(conv, np, self.plan.context,
                                                    f"{np.name}_{conv}_{i}")(x)

        args, kwargs = keras.tree.map_structure(convert, (args, kwargs))
        out = new(*args, **kwargs)
        if np.output.kind == "space":   # its own losses are its block's (split outputs)
            object.__setattr__(new, "_tfhybrid_on_blocks", True)
        if np.kind in _COPIES_WEIGHTS_AFTER_CALL and getattr(layer, "weights", None):
            new.set_weights(layer.get_weights())
            finalize_states(new)             # an adapted Normalization's mean/variance
        if np.params.get("weights") == "partial":
            # a per-voxel layer (Dense head, local BatchNormalization) on a spatial block:
            # its weight gradients are the blocks' shares, summed over the group
            for w in new.trainable_weights:
                set_layout(w, VariableLayout("partial", GROUP))
        return out

    def build(self):
        inputs = [keras.Input(batch_shape=x.shape, dtype=x.dtype, name=x.name)
                  for x in self.model.inputs]
        outputs = self.model._run_through_graph(inputs, operation_fn=self.clone,
                                                call_fn=self.call)
        outputs = keras.tree.flatten(outputs)
        final = []
        for i, (y, conv) in enumerate(zip(outputs, self.plan.outputs)):
            final.append(y if conv is None else
                         _boundary(conv, None, self.plan.context, f"output{i}_{conv}")(y))
        structure = self.model._outputs_struct
        final = keras.tree.pack_sequence_as(structure, final)
        inputs = inputs[0] if len(inputs) == 1 else inputs
        new = keras.Model(inputs, final, name=self.model.name)
        if any(self.plan.split_outputs):   # per-voxel outputs stay in spatial blocks
            from tfhybrid.layers.spatial.output import install_split_outputs
            install_split_outputs(new, self.plan.split_outputs, self.plan.context.spatial)
        else:                              # activity losses of layers on blocks: whole value
            from tfhybrid.layers.spatial.output import install_block_losses
            install_block_losses(new)
        return new if self.scheme == "BK" else _micro_steps(new, self.plan, self.scheme)


def _micro_steps(model, plan, scheme="B/K"):
    """``model`` with ModuloLayer("BK") -> region -> ModuloInverseLayer replaced by
    ModuloLayer(scheme, body=region): SplitBrain's K micro-steps of B/K rows per
    rank ("B/K") or K broadcast rounds of one rank's B rows ("B")."""
    entries = [layer for layer in model.layers if isinstance(layer, P.ModuloLayer)]
    exits = [layer for layer in model.layers if isinstance(layer, P.ModuloInverseLayer)]
    head = f"scheme={scheme!r} under strategy {plan.strategy!r} for model {model.name!r}"
    if not entries:   # nothing model parallel (mp=1, or no FC layer above ccr_threshold)
        return model
    if len(entries) != 1 or len(exits) != 1 or len(model.outputs) != 1 or \
            exits[0].output is not model.outputs[0]:
        raise ValueError(f"{head}: {scheme!r} needs a single model-parallel region that ends at "
                         f"the model's single output; found {len(entries)} ModuloLayer(s) and "
                         f"{len(model.outputs)} output(s). Use scheme='BK'.")
    entry, leave = entries[0], exits[0]
    try:
        body = keras.Model(entry.output, leave.input, name=f"{entry.name}_region")
    except ValueError as err:
        raise ValueError(f"{head}: the model-parallel region after {entry.name!r} reads "
                         f"tensors from before it ({err}). Use scheme='BK'.") from None
    out = P.ModuloLayer(scheme, group=GROUP, body=body, output_layout=entry.output_layout,
                        inverse_input_layout=leave.input_layout, name=entry.name)(entry.input)
    return keras.Model(model.inputs[0] if len(model.inputs) == 1 else model.inputs, out,
                       name=model.name)


def find_layer(model, name):
    """Layer ``name`` of a transformed model, also inside a ModuloLayer's ``body``
    (or its ``keras.ops`` operation of that name: no weights).

    Raises:
        ValueError: if no such layer exists.
    """
    try:
        return model.get_layer(name)
    except ValueError:
        for op in getattr(model, "operations", ()):   # a keras.ops operation (x / 255.0)
            if op.name == name and is_operation(op):
                return op
        for layer in model.layers:
            body = getattr(layer, "body", None)
            if isinstance(body, keras.Model):
                try:
                    return find_layer(body, name)
                except ValueError:
                    pass
        raise


def rewrite(model, plan, grid, scheme="BK"):
    """The parallel counterpart of Functional ``model`` under ``plan``.

    Args:
        model: A built Functional model (see ``graph.as_functional``).
        plan: Its :class:`~tfhybrid.transformer.planner.Plan`.
        grid: This rank's :class:`tfhybrid.process_grid.ProcessGrid`.
        scheme: ``"BK"``, ``"B"`` or ``"B/K"``: the scheme of gmp's ModuloLayer.

    Returns:
        A new Functional model whose layers hold this rank's part of the
        original weights.
    """
    return _Rewriter(model, plan, grid, scheme).build()
