"""``tfhybrid.describe``: what a transformed model does on this rank.

Per layer: the kind it was rebuilt as, its local weight shapes, the
collectives one training step issues for it (forward, backward and the
optimizer's gradient reduction) with their payload bytes, and its per-rank
parameter bytes. Collective sizes are analytic (from the layer shapes, the
plan's layouts and the batch size), counting each collective's payload once
per rank (what this rank contributes or receives, not link traffic).
"""
from __future__ import annotations

import dataclasses
import math
from typing import List, Tuple

import numpy as np

from tfhybrid.optimizer.reduction import reduction_of
from tfhybrid.spatial_geometry import TransposeGeometry
from tfhybrid.transformer import rules
from tfhybrid.transformer.api import info_of
from tfhybrid.transformer.parts import PartModel
from tfhybrid.transformer.rewrite import find_layer

_F32 = 4


@dataclasses.dataclass(frozen=True)
class LayerRow:
    """One line of :func:`describe`.

    Attributes:
        name, cls, kind: Layer name, original class, rebuilt kind.
        weight_shapes: Local (this rank's) weight shapes.
        collectives: (phase, op, group, bytes) per collective per step.
        param_bytes: Bytes of this rank's trainable weights.
    """

    name: str
    cls: str
    kind: str
    weight_shapes: Tuple[tuple, ...]
    collectives: Tuple[Tuple[str, str, str, int], ...]
    param_bytes: int


@dataclasses.dataclass(frozen=True)
class Description:
    """Result of :func:`describe`: rows, totals and the printed table.

    ``region_rows``: rows of activations a rank's model-parallel region
    (gmp) holds at a time (K*B under scheme "BK", B under "B" and "B/K" with
    recomputation; 0 without a region).
    """

    strategy: str
    rows: Tuple[LayerRow, ...]
    param_bytes: int
    comm_bytes: int
    text: str
    region_rows: int = 0

    def __str__(self):
        return self.text


def describe(model, batch_size=None, print_fn=print) -> Description:
    """Print and return the per-layer parallel layout of a transformed model.

    Args:
        model: A model returned by :func:`tfhybrid.transform`.
        batch_size: Global batch size used for activation collectives
            (default: one example per model group).
        print_fn: Called with the table (``None`` to print nothing).

    Returns:
        A :class:`Description` (``.param_bytes`` is this rank's parameter
        bytes, ``.rows`` the per-layer details).

    Raises:
        ValueError: if ``model`` was not returned by tfhybrid.transform.

    Example:
        >>> d = tfhybrid.describe(pmodel, batch_size=64)
        >>> d.param_bytes          # this rank's trainable parameter bytes
    """
    if print_fn is not None and not callable(print_fn):
        raise TypeError(f"Received an invalid `print_fn`: {print_fn!r}; expected a callable "
                        "such as print, or None to print nothing.")
    described = _describe(model, batch_size)
    line = _placement_line(model)
    if line:
        described = dataclasses.replace(described, text=described.text + "\n" + line)
    if print_fn is not None:
        print_fn(described.text)
    return described


def _placement_line(model):
    """Where each model group lives (multi-process jobs only)."""
    from tfhybrid import runtime

    if not runtime.is_initialized() or runtime.size() == 1:
        return ""
    from tfhybrid.transformer.api import INFO_ATTR

    grid = getattr(getattr(model, INFO_ATTR, None), "grid", None)   # p and ls: the job's grid
    return runtime.placement(grid if grid is not None and grid.size == runtime.size() else None)


def _describe(model, batch_size):
    if isinstance(model, PartModel):     # p, ls: pipeline.py, layer_separation.py
        return model.describe_parts(batch_size, Description)
    info = info_of(model)
    if batch_size is not None and (isinstance(batch_size, bool) or not isinstance(
            batch_size, int) or batch_size < 1):
        raise ValueError(f"Received an invalid value for `batch_size`: batch_size="
                         f"{batch_size!r}; expected the global batch size (a positive "
                         "integer) or None.")
    plan, grid = info.plan, info.grid
    rows_per_rank = _rows(batch_size, plan, grid)
    modulo = _modulo(model)
    out, graded = [], _tensors_with_gradient(info.graph)
    for np_ in plan.nodes:
        node = info.graph.node(np_.name)
        layer = find_layer(model, np_.name)
        comms = _activation_comms(np_, node, rows_per_rank, plan.context,
                                  _boundary_comms(modulo))
        if modulo is not None:
            comms = _recomputed(comms, np_, modulo)
        if not any(t in graded for t in node.inputs):   # back-propagation stops here
            comms = [c for c in comms if c[0] != "bwd"]
        weights = getattr(layer, "weights", ())     # none on a keras.ops operation
        if weights:
            comms += _gradient_comms(layer, grid)
        shapes = tuple(tuple(int(d) for d in w.shape) for w in weights)
        pbytes = int(sum(_bytes(w) for w in getattr(layer, "trainable_weights", ())))
        out.append(LayerRow(np_.name, np_.cls, _kind_label(np_), shapes, tuple(comms), pbytes))
    total = sum(r.param_bytes for r in out)
    comm = sum(c[3] for r in out for c in r.collectives)
    text = _table(plan, grid, out, total, comm, batch_size)
    region = 0
    if modulo is not None:
        region, note = _region_note(modulo, rows_per_rank, batch_size)
        text += "\n" + note
    if getattr(info, "auto", None) is not None:   # strategy="auto": the choice and why
        text += "\n" + info.auto.summary()
    return Description(plan.strategy, tuple(out), total, comm, text, region)


def _modulo(model):
    """The ModuloLayer of a gmp model (None without a model-parallel region)."""
    from tfhybrid.layers.splitbrain import ModuloLayer

    for layer in model.layers:
        if isinstance(layer, ModuloLayer) and layer.comm_group.size > 1:
            return layer
    return None


def _boundary_comms(modulo):
    """The boundary collectives for the ModuloLayer's scheme.

    "B": the entry is K broadcasts of one rank's B rows forward and K rooted
    reduces of their gradient backward (none when the consumer's gradient is
    R), the exit K broadcasts of the outputs' gradient (none when it is P):
    the bytes of BK's allgathers (K rounds of B rows).
    """
    if modulo is None or modulo.scheme != "B":
        return _BOUNDARY_COMMS
    from tfhybrid.layers.partitioned import IO_PARTIAL_GRAD

    entry = (("fwd", "broadcast", "model"),)
    if modulo.output_layout == IO_PARTIAL_GRAD:
        entry += (("bwd", "reduce", "model"),)
    leave = () if modulo.inverse_input_layout == IO_PARTIAL_GRAD else \
        (("bwd", "broadcast", "model"),)
    return {**_BOUNDARY_COMMS, "modulo": entry, "unmodulo": leave}


def _recomputed(comms, np_, modulo):
    """"B" and "B/K" with recomputation run each forward collective of the region
    (and the entry's) again in the backward pass: phase "recompute"."""
    if modulo.scheme == "BK" or not modulo.recompute:
        return comms
    inside = (bool(np_.inputs) and np_.inputs[0].grouped) or "modulo" in np_.conversions
    out = []
    for c in comms:
        out.append(c)
        if inside and c[0] == "fwd":
            out.append(("recompute",) + tuple(c[1:]))
    return out


def _region_note(modulo, rows, batch_size):
    """(rows the region holds at a time, the line describe prints about it)."""
    k = modulo.comm_group.size
    held = rows * k if modulo.scheme == "BK" or not modulo.recompute else rows
    how = {"BK": f"one pass on the group's K*B = {k * rows} rows (all-gathered)",
           "B": f"K = {k} rounds, rank k's B = {rows} rows broadcast in round k",
           "B/K": f"K = {k} micro-steps of B/K = {rows / k:g} rows from each rank"}
    unit = "" if batch_size else " (per row of the local batch B)"
    return held, (f"model-parallel region: scheme {modulo.scheme!r}, {how[modulo.scheme]}; "
                  f"activations held at a time: {held} rows{unit}"
                  + (", each round/micro-step recomputed in the backward pass"
                     if modulo.scheme != "BK" and modulo.recompute else ""))


def _tensors_with_gradient(graph):
    """Ids of the tensors that depend on a trainable weight: only those get a
    gradient in training (the tape never back-propagates into the inputs)."""
    graded = set()
    for node in graph.nodes:
        if node.param_bytes or any(t in graded for t in node.inputs):
            graded.add(node.output)
    return graded


def _rows(batch_size, plan, grid):
    """Rows one rank holds outside a model-parallel region."""
    if batch_size is None:
        return 1
    parts = grid.size if plan.batch_split == "world" else grid.data_size
    return max(1, batch_size // parts)


def _bytes(w):
    return int(np.prod(w.shape)) * np.dtype(w.dtype).itemsize


def _kind_label(np_):
    extra = ""
    if np_.kind == "filter" and np_.params.get("output_layout") == "split":
        extra = " (split out)"
    if np_.kind == "channel" and np_.params.get("input_layout") == "split":
        extra = " (split in)"
    if np_.output.kind == "space" and np_.kind == "replicate":   # runs on its own block
        return "spatial (local)"
    if np_.output.kind == "space" and np_.kind == "syncbn":
        extra = " (spatial)"
    return np_.kind + extra


def _elems(shape):
    return int(np.prod([d for d in shape[1:] if d is not None]))


def _activation_comms(np_, node, rows, ctx, boundary=None):
    k = ctx.model_size
    group_rows = rows * (k if (np_.inputs and np_.inputs[0].grouped) else 1)
    x = group_rows * _elems(node.in_shapes[0]) * _F32 if node.in_shapes else 0
    y = group_rows * _elems(node.out_shape) * _F32
    boundary = _BOUNDARY_COMMS if boundary is None else boundary
    out = [(*c, rows * _elems(node.in_shapes[i]) * _F32 * (k if c[1] in _K_ROWS else 1))
           for i, conv in enumerate(np_.conversions) if conv
           for c in boundary.get(conv, ())]
    if k == 1:
        return []
    entry = np_.conversions[:1] == ("modulo",)   # the ModuloLayer reduce-scatters instead
    if np_.kind == "filter":
        if np_.params.get("output_layout") != "split":
            out.append(("fwd", "allgather", "model", y))
        if not entry:
            out.append(("bwd", "allreduce", "model", x))
    elif np_.kind == "channel":
        out.append(("fwd", "allreduce", "model", y))
        if np_.params.get("input_layout") != "split" and not entry:
            out.append(("bwd", "allgather", "model", x))
    elif np_.kind == "spatial" and np_.cls in rules.SPATIAL_WEIGHTED:
        halo = _halo_bytes(node, group_rows, ctx)
        out += [("fwd", "halo", "model", halo), ("bwd", "halo", "model", halo)]
    elif np_.kind == "spatial" and rules.spatial_global_pool(node):
        c = node.out_shape[-1]
        if node.cls.startswith("GlobalAverage"):   # the blocks' sums and voxel count
            out.append(("fwd", "allreduce", "model", group_rows * (c + 1) * _F32))
        else:      # the blocks' maxima; backward, their tie counts
            out += [("fwd", "allgather", "model", group_rows * c * _F32),
                    ("bwd", "allreduce", "model", group_rows * c * _F32)]
    elif np_.kind == "syncbn":
        c = node.out_shape[-1] * _F32
        out += [("fwd", "allreduce", "+".join(np_.params["bn_groups"]), 3 * c),
                ("bwd", "allreduce", "+".join(np_.params["bn_groups"]), 3 * c)]
    return out


_K_ROWS = ("allgather", "broadcast", "reduce")   # boundary ops moving the group's K*B rows
_BOUNDARY_COMMS = {
    "modulo": (("fwd", "allgather", "model"), ("bwd", "reducescatter", "model")),
    "unmodulo": (("bwd", "allgather", "model"),),
    "space_scatter": (("bwd", "allgather", "model"),),
    "space_gather": (("fwd", "allgather", "model"),),
}


def _halo_bytes(node, rows, ctx):
    """Bytes a rank sends per halo exchange of a spatial Conv2D/Conv3D: per split
    axis, (window - 1) slices of the local block's other axes (the window is
    dilation * (kernel - 1) + 1, :func:`rules.window_specs`)."""
    halos = [window - 1 for window, _, _ in rules.window_specs(node)]
    sizes, c = node.in_shapes[0][1:len(halos) + 1], node.in_shapes[0][-1]
    local = [size // parts for size, parts in zip(sizes, ctx.spatial)]
    if node.cls in rules.SPATIAL_TRANSPOSED:   # rows whose contributions reach a neighbour
        halos = [sum(TransposeGeometry(size, parts, *spec).exchange())
                 for size, parts, spec in zip(sizes, ctx.spatial, rules.window_specs(node))]
    halo = 0
    for d, parts in enumerate(ctx.spatial):
        if parts > 1:
            halo += halos[d] * math.prod(local[:d] + local[d + 1:])
    return rows * halo * c * _F32


def _gradient_comms(layer, grid) -> List[tuple]:
    """The DistributedOptimizer's reduction of each weight's gradient."""
    out = []
    for w in layer.trainable_weights:
        ranks = reduction_of(w, grid).ranks
        if len(ranks) > 1:
            group = "world" if len(ranks) == grid.size else "data"
            out.append(("grad", "allreduce", group, _bytes(w)))
    return out


def _table(plan, grid, rows, total, comm, batch_size):
    head = (f"tfhybrid.describe: strategy={plan.strategy!r} rank {grid.rank}/{grid.size} "
            f"(data {grid.data_rank}/{grid.data_size}, model {grid.model_rank}/"
            f"{grid.model_size}), batch split over {plan.batch_split}, "
            f"global batch {batch_size or '(not given: one row per rank)'}")
    lines = [head, f"{'layer':<24}{'kind':<20}{'local weights':<34}{'param bytes':>12}  "
             "collectives per step (phase op group bytes)"]
    for r in rows:
        shapes = " ".join("x".join(map(str, s)) or "()" for s in r.weight_shapes) or "-"
        comms = ", ".join(f"{p} {op}[{g}] {b}" for p, op, g, b in r.collectives) or "-"
        lines.append(f"{r.name[:23]:<24}{r.kind:<20}{shapes[:33]:<34}{r.param_bytes:>12}  "
                     f"{comms}")
    lines.append(f"per-rank parameter bytes: {total}   collective bytes per step: {comm}")
    return "\n".join(lines)
