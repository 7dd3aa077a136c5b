"""``tfhybrid.describe``: what a transformed model does on this rank.

Per layer: the kind it was rebuilt as, its local weight shapes, the
collectives one training step issues for it (forward, backward and the
optimizer's gradient reduction) with their payload bytes, and its per-rank
parameter bytes. Collective sizes are analytic (from the layer shapes, the
plan's layouts and the batch size), counting each collective's payload once
per rank (what this rank contributes or receives, not link traffic).

``sent_bytes`` is the other figure: the bytes this rank puts on the wire per
step, i.e. what its network interface sends (less TCP/IP headers and
Horovod's own negotiation). It follows how tfhybrid issues each collective
under Horovod with Gloo on a group of ``k`` ranks: an allreduce is a ring,
``2(k-1)/k`` of the tensor; an allgather sends this rank's block to the
``k-1`` others in a ring, ``(k-1)`` blocks; a reduce-scatter is an alltoall
(:func:`tfhybrid.comm.backend.reducescatter`), ``(k-1)/k`` of the tensor
reduced; a halo exchange is an alltoall that sends only the rows a real
neighbour's window reads (none past the group's ends), and its backward
sends back the gradients of the rows received. Rooted ops (SplitBrain's
"B" scheme) are averaged over the group. It also counts the collectives
``comm_bytes`` leaves out: the model outputs' boundaries (gmp's
ModuloInverseLayer, whose backward all-gathers the output gradient) and the
halos of spatial pooling and border (padding/cropping) layers.
``.wire`` lists every transfer with both figures. For p and ls,
``comm_bytes`` already is the bytes sent per rank, and ``sent_bytes``
equals it. Not modelled: gradient compression (fp16 halves the gradient
reduction), up-sampling halos, spatial group normalization statistics.
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
        wire: (phase, op, group, counted, sent) per collective per step:
            ``counted`` the bytes of ``collectives`` (0 for a collective
            ``collectives`` does not list), ``sent`` the bytes this rank
            sends for it (see the module docstring).
    """

    name: str
    cls: str
    kind: str
    weight_shapes: Tuple[tuple, ...]
    collectives: Tuple[Tuple[str, str, str, int], ...]
    param_bytes: int
    wire: Tuple[Tuple[str, str, str, int, int], ...] = ()


@dataclasses.dataclass(frozen=True)
class Description:
    """Result of :func:`describe`: rows, totals and the printed table.

    ``comm_bytes``: the sum of the rows' collective payloads (see the module
    docstring: not link traffic). ``sent_bytes``: the bytes this rank sends
    per step, what its network interface carries (less protocol headers);
    ``wire``: (layer, phase, op, group, counted, sent) per transfer, the
    rows' and the model outputs' boundaries.

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
    sent_bytes: int = 0
    wire: Tuple[Tuple[str, str, str, str, int, int], ...] = ()

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
        bytes, ``.comm_bytes`` the collectives' payload bytes per step,
        ``.sent_bytes`` the bytes this rank sends per step, ``.rows`` the
        per-layer details).

    Raises:
        ValueError: if ``model`` was not returned by tfhybrid.transform.

    Example:
        >>> d = tfhybrid.describe(pmodel, batch_size=64)
        >>> d.param_bytes          # this rank's trainable parameter bytes
        >>> d.sent_bytes           # bytes this rank's network interface sends per step
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
        parts = model.describe_parts(batch_size, Description)   # bytes sent per rank
        return dataclasses.replace(parts, sent_bytes=parts.comm_bytes)
    info = info_of(model)
    if batch_size is not None and (isinstance(batch_size, bool) or not isinstance(
            batch_size, int) or batch_size < 1):
        raise ValueError(f"Received an invalid value for `batch_size`: batch_size="
                         f"{batch_size!r}; expected the global batch size (a positive "
                         "integer) or None.")
    plan, grid = info.plan, info.grid
    rows_per_rank = _rows(batch_size, plan, grid)
    modulo = _modulo(model)
    boundary = _boundary_comms(modulo)
    where = _Where(grid.model_rank, _halo_method())
    out, graded = [], _tensors_with_gradient(info.graph)
    for np_ in plan.nodes:
        node = info.graph.node(np_.name)
        layer = find_layer(model, np_.name)
        comms = _activation_comms(np_, node, rows_per_rank, plan.context, boundary, where)
        if modulo is not None:
            comms = _recomputed(comms, np_, modulo)
        if not any(t in graded for t in node.inputs):   # back-propagation stops here
            comms = [c for c in comms if c[0] != "bwd"]
        weights = getattr(layer, "weights", ())     # none on a keras.ops operation
        if weights:
            comms += _gradient_comms(layer, grid)
        shapes = tuple(tuple(int(d) for d in w.shape) for w in weights)
        pbytes = int(sum(_bytes(w) for w in getattr(layer, "trainable_weights", ())))
        listed = tuple(c[:4] for c in comms if c[3] is not None)
        wire = tuple((*c[:3], c[3] or 0, c[4]) for c in comms)
        out.append(LayerRow(np_.name, np_.cls, _kind_label(np_), shapes, listed, pbytes,
                            wire))
    outputs = _output_comms(info.graph, plan, rows_per_rank, boundary, graded)
    total = sum(r.param_bytes for r in out)
    comm = sum(c[3] for r in out for c in r.collectives)
    wire = tuple((r.name, *c) for r in out for c in r.wire) + outputs
    sent = sum(c[5] for c in wire)
    text = _table(plan, grid, out, total, comm, batch_size, outputs, sent)
    region = 0
    if modulo is not None:
        region, note = _region_note(modulo, rows_per_rank, batch_size)
        text += "\n" + note
    if getattr(info, "auto", None) is not None:   # strategy="auto": the choice and why
        text += "\n" + info.auto.summary()
    return Description(plan.strategy, tuple(out), total, comm, text, region, sent, wire)


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


def _activation_comms(np_, node, rows, ctx, boundary=None, where=None):
    """(phase, op, group, counted, sent) per activation collective of a layer:
    ``counted`` the payload ``collectives`` lists (None: not listed there),
    ``sent`` the bytes this rank sends (the module docstring)."""
    k = ctx.model_size
    where = _Where(0, "neighbour") if where is None else where
    group_rows = rows * (k if (np_.inputs and np_.inputs[0].grouped) else 1)
    x = group_rows * _elems(node.in_shapes[0]) * _F32 if node.in_shapes else 0
    y = group_rows * _elems(node.out_shape) * _F32
    boundary = _BOUNDARY_COMMS if boundary is None else boundary
    out = []
    for i, conv in enumerate(np_.conversions):
        for c in boundary.get(conv, ()) if conv else ():
            full = rows * _elems(node.in_shapes[i]) * _F32
            out.append((*c, full * (k if c[1] in _K_ROWS else 1),
                        _boundary_sent(conv, full, k, ctx)))
    if k == 1:     # nothing split over a model group; a SyncBatchNormalization over
        return _syncbn_comms(np_, node, ctx, listed=False)   # the data group still syncs
    entry = np_.conversions[:1] == ("modulo",)   # the ModuloLayer reduce-scatters instead
    if np_.kind == "filter":
        if np_.params.get("output_layout") != "split":    # comm.gather of the blocks
            out.append(("fwd", "allgather", "model", y, (k - 1) * y // k))
        if not entry:                                     # comm.copy's backward
            out.append(("bwd", "allreduce", "model", x, _ring(x, k)))
    elif np_.kind == "channel":
        out.append(("fwd", "allreduce", "model", y, _ring(y, k)))
        if np_.params.get("input_layout") != "split" and not entry:   # comm.split's backward
            out.append(("bwd", "allgather", "model", x, (k - 1) * x // k))
    elif np_.kind == "spatial" and np_.cls in rules.SPATIAL_WEIGHTED:
        halo = _halo_bytes(node, group_rows, ctx)
        fwd, bwd = _halo_sent(node, group_rows, ctx, where)
        out += [("fwd", "halo", "model", halo, fwd), ("bwd", "halo", "model", halo, bwd)]
    elif np_.kind == "spatial" and np_.cls in rules.SPATIAL_POOLS + rules.SPATIAL_BORDER:
        fwd, bwd = _halo_sent(node, group_rows, ctx, where)   # not in `collectives`
        out += [(phase, "halo", "model", None, b) for phase, b in (("fwd", fwd), ("bwd", bwd))
                if b]
    elif np_.kind == "spatial" and rules.spatial_global_pool(node):
        c = node.out_shape[-1]
        if node.cls.startswith("GlobalAverage"):   # the blocks' sums and voxel count
            m = group_rows * (c + 1) * _F32
            out.append(("fwd", "allreduce", "model", m, _ring(m, k)))
        else:      # the blocks' maxima; backward, their tie counts
            m = group_rows * c * _F32
            out += [("fwd", "allgather", "model", m, (k - 1) * m),
                    ("bwd", "allreduce", "model", m, _ring(m, k))]
    elif np_.kind == "syncbn":
        out += _syncbn_comms(np_, node, ctx, listed=True)
    return out


def _syncbn_comms(np_, node, ctx, listed):
    """SyncBatchNormalization: per group of ``bn_groups`` of more than one rank,
    an allreduce of the sums and count (c + 1) and one of the squared deviations
    (c), forward and backward (:mod:`tfhybrid.layers.sync_bn`). ``collectives``
    lists them (when a model group exists) as 3c per phase."""
    if np_.kind != "syncbn":
        return []
    groups = np_.params["bn_groups"]
    c = node.out_shape[-1]
    sizes = {"model": ctx.model_size, "data": ctx.data_size,
             "world": ctx.model_size * ctx.data_size}
    sent = sum(_ring((2 * c + 1) * _F32, sizes.get(g, 1)) for g in groups)
    counted = 3 * c * _F32 if listed else None
    if not listed and not sent:
        return []
    return [(phase, "allreduce", "+".join(groups), counted, sent) for phase in ("fwd", "bwd")]


def _ring(nbytes, k):
    """Bytes each rank sends in a ring allreduce of ``nbytes`` over ``k`` ranks."""
    return 2 * (k - 1) * nbytes // k if k > 1 else 0


def _boundary_sent(conv, full, k, ctx):
    """Bytes this rank sends in one boundary collective.

    ``full``: for gmp's (un)modulo, this rank's B rows of the tensor; every op
    moves (k-1) blocks of B rows per rank: the allgather its own rows to the
    k-1 others, the reduce-scatter (an alltoall) (k-1)/k of the K*B rows'
    gradient, the "B" scheme's K broadcast rounds (K rooted reduces) on
    average (exactly) (k-1) blocks. For space_gather/space_scatter, the whole
    tensor: allgathers along each split axis in turn (the scatter's backward
    in reverse order), each rank sending (parts-1) of its growing block.
    """
    if conv not in ("space_gather", "space_scatter"):
        return (k - 1) * full
    parts = [p for p in (ctx.spatial or ()) if p > 1]
    if conv == "space_scatter":
        parts = parts[::-1]
    block, sent = full // max(1, math.prod(parts)), 0
    for p in parts:
        sent += (p - 1) * block
        block *= p
    return sent


@dataclasses.dataclass(frozen=True)
class _Where:
    """This rank's index in the spatial (model) group and the halo method."""

    index: int
    method: str


def _halo_method():
    """The halo method spatial layers trace with (:func:`tfhybrid.comm.halo.halo_method`)."""
    try:
        from tfhybrid.comm.halo import halo_method
        return halo_method()
    except ValueError:     # an invalid TFHYBRID_HALO: the layers raise when traced
        return "neighbour"


def _halo_sent(node, rows, ctx, where):
    """(forward, backward) bytes this rank sends in a spatial window layer's halo
    exchange: only towards the block grid's neighbours that exist.

    "neighbour"/"pairs" (:func:`tfhybrid.comm.halo.block_halo_exchange`): the
    forward sends the rows each neighbour's window reads (corners included),
    the backward returns the gradients of the rows received. "axis"
    (:func:`tfhybrid.comm.halo_exchange` per split axis in turn): each axis's
    slices span the axes exchanged before at their halo-extended size.
    """
    from tfhybrid.comm import halo
    from tfhybrid.process_grid import unravel
    from tfhybrid.spatial_geometry import AxisGeometry

    spatial = tuple(ctx.spatial or ())
    if not any(p > 1 for p in spatial) or not node.in_shapes:
        return 0, 0
    shape_in = node.in_shapes[0]
    sizes, c = shape_in[1:len(spatial) + 1], shape_in[-1]
    if any(v is None for v in sizes) or c is None:
        return 0, 0
    geometry = TransposeGeometry if node.cls in rules.SPATIAL_TRANSPOSED else AxisGeometry
    geos = [geometry(int(n), p, *spec)
            for n, p, spec in zip(sizes, spatial, rules.window_specs(node))]
    widths = [g.exchange() for g in geos]
    blocks = [g.block for g in geos]
    index = where.index % math.prod(spatial)
    unit = rows * int(c) * _F32
    if where.method == "axis":
        coords = unravel(index, spatial)
        fwd = bwd = 0
        for d, ((lo, hi), parts, i) in enumerate(zip(widths, spatial, coords)):
            if parts == 1 or not (lo or hi):
                continue
            # axes before d are halo-extended already (need may crop: n + lo + hi)
            others = math.prod([blocks[e] + sum(geos[e].need(coords[e])) if e < d
                                else blocks[e] for e in range(len(spatial)) if e != d])
            prev, nxt = i > 0, i < parts - 1
            fwd += (hi * prev + lo * nxt) * others
            bwd += (lo * prev + hi * nxt) * others
        return unit * fwd, unit * bwd
    fwd, bwd = halo.halo_items(halo.block_neighbours(index, spatial, widths, sending=True),
                               halo.block_neighbours(index, spatial, widths), widths, blocks)
    return unit * fwd, unit * bwd


def _output_comms(graph, plan, rows, boundary, graded):
    """(layer, phase, op, group, 0, sent) for the boundaries before the model's
    outputs (gmp's ModuloInverseLayer: its backward all-gathers the output's
    gradient; ``collectives`` does not list them)."""
    k = plan.context.model_size
    if k == 1:
        return ()
    out = []
    for i, (tensor, conv) in enumerate(zip(graph.outputs, plan.outputs)):
        if not conv:
            continue
        node = next(n for n in graph.nodes if n.output == tensor)
        full = rows * _elems(node.out_shape) * _F32
        for phase, op, group in boundary.get(conv, ()):
            if phase == "bwd" and tensor not in graded:
                continue
            out.append((f"output{i}_{conv}", phase, op, group, 0,
                        _boundary_sent(conv, full, k, plan.context)))
    return tuple(out)


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
    """The DistributedOptimizer's reduction of each weight's gradient (ring
    allreduces, fused in buckets: the same bytes)."""
    out = []
    for w in layer.trainable_weights:
        ranks = reduction_of(w, grid).ranks
        if len(ranks) > 1:
            group = "world" if len(ranks) == grid.size else "data"
            out.append(("grad", "allreduce", group, _bytes(w), _ring(_bytes(w), len(ranks))))
    return out


def _table(plan, grid, rows, total, comm, batch_size, outputs=(), sent=None):
    head = (f"tfhybrid.describe: strategy={plan.strategy!r} rank {grid.rank}/{grid.size} "
            f"(data {grid.data_rank}/{grid.data_size}, model {grid.model_rank}/"
            f"{grid.model_size}), batch split over {plan.batch_split}, "
            f"global batch {batch_size or '(not given: one row per rank)'}")
    lines = [head, f"{'layer':<24}{'kind':<20}{'local weights':<34}{'param bytes':>12}  "
             "collectives per step (phase op group bytes)"]
    for r in rows:
        shapes = " ".join("x".join(map(str, s)) or "()" for s in r.weight_shapes) or "-"
        comms = ", ".join(_row_texts(r)) or "-"
        lines.append(f"{r.name[:23]:<24}{r.kind:<20}{shapes[:33]:<34}{r.param_bytes:>12}  "
                     f"{comms}")
    for name in dict.fromkeys(c[0] for c in outputs):
        comms = ", ".join(_wire_text(*c[1:], listed=False) for c in outputs if c[0] == name)
        lines.append(f"{name[:23]:<24}{'boundary':<20}{'-':<34}{0:>12}  {comms}")
    lines.append(f"per-rank parameter bytes: {total}   collective bytes per step: {comm}"
                 + ("" if sent is None else f"   bytes this rank sends per step: {sent}"))
    return "\n".join(lines)


def _row_texts(row):
    """The row's transfers as text, in order (``row.wire`` holds ``row.collectives``
    in their order, with the transfers they leave out between them)."""
    out, j = [], 0
    for c in row.wire:
        listed = j < len(row.collectives) and tuple(row.collectives[j]) == tuple(c[:4])
        j += listed
        out.append(_wire_text(*c, listed=listed))
    return out


def _wire_text(phase, op, group, counted, sent, listed=True):
    """"fwd allgather[model] 262144 (sends 131072)"; "+" marks a transfer the
    collective bytes leave out."""
    if not listed:
        return f"+{phase} {op}[{group}] (sends {sent})"
    return f"{phase} {op}[{group}] {counted}" + ("" if sent == counted else f" (sends {sent})")
