"""Read ParaDL's own files: model (.net), layer configuration (.lc), platform
(.plat), per-tier alpha/beta JSON and the SUMMARY tables of its projection logs.

Formats (github.com/TruongThaoNguyen/paraDL-analysis, see
``shared/paradl/README.md``):

* ``.net``: ``Dataset|NAME``, ``Input|D x C x W x H``, ``Model|NAME``, then
  ``LAYER|C x W x H|C x F x K x K|F x W x H[|seconds]``; ``#`` lines are comments.
  ``_profall.net_sc`` files carry the measured total forward+backward time
  per sample in the first layer's last column (other rows 0).
* ``.lc``: ``[index] LAYER |0/1`` per layer: whether a strategy splits it.
* ``.plat``: ``KEY|value|unit`` (MEM_PER_NODE, NODE_SPEED, BANDWIDTH,
  LATENCY, MAX_NODE, GPU_PER_NODE).

ParaDL's tool spreads the measured total time over layers in proportion to an
operation count; the weights here (2 x MACs for conv, 1.5 x MACs for FC, |y|
for activations, |y| x C x K^2 for pooling, 0 for dropout, reverse-engineered
from its logs) reproduce its per-layer times. Repeated layer names (RELU, MPOOL, ...) get a ``#k`` suffix
from their second occurrence on. Approximations: biases are absent in
ParaDL's files (0).

Example:
    >>> cfg = parse_lc_text("0 CONV1 |1\\n1 RELU |0")
    >>> cfg
    [('CONV1', True), ('RELU', False)]
"""
from __future__ import annotations

import dataclasses
import json
import math
import re

from tfhybrid.oracle.machine import Machine
from tfhybrid.oracle.profile import LayerRow, ModelProfile

_KINDS = (("CONV", "conv"), ("FC", "dense"), ("RELU", "elementwise"), ("DROPOUT", "elementwise"),
          ("MPOOL", "pool"), ("APOOL", "pool"), ("POOL", "pool"), ("BN", "norm"),
          ("ADD", "merge"))


@dataclasses.dataclass(frozen=True)
class ParaDLModel:
    """A ParaDL model file: profile, dataset size and per-layer times.

    Attributes:
        profile: The :class:`ModelProfile` (optionally with ``split`` from a .lc).
        dataset: Dataset name; ``dataset_size`` its number of samples D.
        total_time: Measured forward+backward seconds per sample (None if absent).
        layer_times: ``{layer: (fw, bw)}`` per sample (total spread by op count,
            backward = 2 x forward); empty when ``total_time`` is None.
    """

    profile: ModelProfile
    dataset: str
    dataset_size: int
    total_time: float | None
    layer_times: dict


def _dims(text):
    return [int(v) for v in text.strip().split("x") if v.strip() != ""]


def _kind(name):
    for prefix, kind in _KINDS:
        if name.upper().startswith(prefix):
            return kind
    return "other"


def _row(name, x, w, y):
    kind = _kind(name)
    xs, ys = math.prod(x), math.prod(y)
    weights = math.prod(w) if kind in ("conv", "dense") and all(w) else 0
    k = tuple(w[2:]) if len(w) > 2 else ()
    if kind in ("conv", "dense"):
        ops = 2 * weights * math.prod(y[1:])
    elif kind == "pool":
        ops = ys * math.prod(k)
    else:
        ops = ys
    bwd = 2 * ops if weights else ops
    strides = tuple(max(1, round(a / max(b, 1))) for a, b in zip(x[1:], y[1:]))
    row = LayerRow(name=name, kind=kind, params=weights, weights=weights, biases=0,
                   fwd_flops=ops, bwd_flops=bwd, x=xs, y=ys, channels=x[0], filters=y[0],
                   spatial_in=tuple(x[1:]), spatial_out=tuple(y[1:]) if ys != y[0] else (),
                   kernel=k if kind in ("conv", "pool") else (), strides=strides
                   if kind in ("conv", "pool") else ())
    if row.kernel:
        hx, hdy = row.halo_for((2,) + (1,) * (len(row.kernel) - 1))
        row = dataclasses.replace(row, halo_x=hx, halo_dy=hdy)
    if kind == "dense":
        row = dataclasses.replace(row, ccr=(ops + bwd) / max(xs + ys, 1))
    return row


def parse_net_text(text: str, name: str = "paradl") -> ParaDLModel:
    """Parse the text of a ParaDL ``.net`` / ``.net_sc`` file.

    Raises:
        ValueError: a layer line has fewer than 4 ``|`` fields or bad dims
            (the message gives the line number).

    Example:
        >>> m = parse_net_text("Input|10x3x8x8\\nCONV1|3x8x8|3x4x3x3|4x8x8|0.5")
        >>> (m.dataset_size, m.profile.rows[0].weights, m.total_time)
        (10, 108, 0.5)
    """
    header, rows, total, seen = {}, [], None, {}
    for no, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        parts = [s.strip() for s in line.split("|")]
        if parts[0] in ("Dataset", "Input", "Model"):
            header[parts[0]] = parts[1] if len(parts) > 1 else ""
            continue
        if len(parts) < 4:
            raise ValueError(f"ParaDL .net line {no} {line!r}: expected "
                             "NAME|CxWxH|CxFxKxK|FxWxH[|seconds].")
        seen[parts[0]] = seen.get(parts[0], 0) + 1
        name_l = parts[0] if seen[parts[0]] == 1 else f"{parts[0]}#{seen[parts[0]]}"
        try:
            rows.append(_row(name_l, _dims(parts[1]), _dims(parts[2]), _dims(parts[3])))
        except ValueError as err:
            raise ValueError(f"ParaDL .net line {no} {line!r}: bad dimensions ({err}).") from None
        if len(parts) > 4 and parts[4] and float(parts[4]) > 0:
            total = (total or 0.0) + float(parts[4])
    inp = _dims(header.get("Input", "1x1"))
    prof = ModelProfile(header.get("Model", name), tuple(rows), math.prod(inp[1:]))
    return ParaDLModel(prof, header.get("Dataset", ""), inp[0], total, _spread(rows, total))


def _tool_ops(r):
    """ParaDL's per-layer weights for spreading the measured time (from its logs)."""
    if r.kind == "dense":
        return 0.75 * r.fwd_flops
    if r.kind == "pool":
        return r.fwd_flops * r.channels
    if r.name.upper().startswith("DROPOUT"):
        return 0.0
    return r.fwd_flops


def _spread(rows, total):
    if not total:
        return {}
    ops = sum(_tool_ops(r) for r in rows) or 1
    out = {}
    for r in rows:
        t = total * _tool_ops(r) / ops
        out[r.name] = (t / 3, 2 * t / 3)
    return out


def read_net(path) -> ParaDLModel:
    """Read a ParaDL ``.net`` file (see :func:`parse_net_text`)."""
    with open(path, encoding="utf-8") as fh:
        return parse_net_text(fh.read(), name=str(path))


def parse_lc_text(text: str) -> list:
    """Parse a layer configuration: list of (layer name, split flag)."""
    out = []
    for no, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line:
            continue
        m = re.match(r"^(?:\d+\s+)?(.+?)\s*\|\s*([01])\s*$", line)
        if not m:
            raise ValueError(f"ParaDL .lc line {no} {line!r}: expected '[index] NAME |0 or 1'.")
        out.append((m.group(1).strip(), m.group(2) == "1"))
    return out


def apply_lc(model: ParaDLModel, config: list) -> ParaDLModel:
    """Attach a layer configuration to a model (names must match in order).

    Raises:
        ValueError: different lengths or a name mismatch (reported with position).
    """
    rows = model.profile.rows
    if len(config) != len(rows):
        raise ValueError(f"Layer configuration has {len(config)} entries but the model has "
                         f"{len(rows)} layers; they must match one to one.")
    for i, ((name, _), row) in enumerate(zip(config, rows)):
        if name.upper() != row.name.split("#")[0].upper():
            raise ValueError(f"Layer configuration entry {i} is {name!r} but the model's "
                             f"layer {i} is {row.name!r}.")
    prof = dataclasses.replace(model.profile, split=tuple(flag for _, flag in config))
    return dataclasses.replace(model, profile=prof)


def read_lc(path) -> list:
    """Read a ParaDL ``.lc`` file (see :func:`parse_lc_text`)."""
    with open(path, encoding="utf-8") as fh:
        return parse_lc_text(fh.read())


def parse_plat_text(text: str) -> dict:
    """Parse a ``.plat`` file into {KEY: float}."""
    out = {}
    for no, line in enumerate(text.splitlines(), 1):
        parts = [s.strip() for s in line.split("|")]
        if len(parts) >= 2 and parts[0]:
            try:
                out[parts[0]] = float(parts[1])
            except ValueError:
                raise ValueError(f"ParaDL .plat line {no} {line.strip()!r}: expected "
                                 "KEY|number|unit") from None
    return out


def machine_from_plat(plat: dict, tiers=None, layer_times=None, gamma=1.0, phi=1.0,
                      bytes_per_item=4) -> Machine:
    """A :class:`Machine` from parsed ``.plat`` values (+ optional tiers JSON dict).

    Example:
        >>> m = machine_from_plat({"LATENCY": 5e-7, "BANDWIDTH": 12.5e9, "NODE_SPEED": 7.8e12,
        ...                        "MEM_PER_NODE": 16e9, "GPU_PER_NODE": 4})
        >>> (m.alpha, m.beta, m.ranks_per_node)
        (5e-07, 8e-11, 4)
    """
    need = {"LATENCY", "BANDWIDTH", "NODE_SPEED"} - set(plat)
    if need:
        raise ValueError(f"ParaDL platform lacks keys {sorted(need)}.")
    for key, positive in (("BANDWIDTH", True), ("NODE_SPEED", True), ("LATENCY", False)):
        v = plat[key]
        if not math.isfinite(v) or v < 0 or (positive and v == 0):
            raise ValueError(f"ParaDL platform {key}={v!r}; expected a "
                             f"{'positive' if positive else 'non-negative'} finite number "
                             f"({'bytes/s' if key == 'BANDWIDTH' else 'FLOP/s' if positive else 's'})")
    tier_list = (tiers or {}).get("tiers", []) if isinstance(tiers, dict) else (tiers or [])
    delta = (tiers or {}).get("bytes_per_item", bytes_per_item) if isinstance(tiers, dict) \
        else bytes_per_item
    return Machine(alpha=plat["LATENCY"], beta=1.0 / plat["BANDWIDTH"],
                   tiers=tuple(tier_list), flop_rate=plat["NODE_SPEED"],
                   layer_times=layer_times or None,
                   memory_bytes=plat.get("MEM_PER_NODE"), phi=phi, gamma=gamma,
                   bytes_per_item=delta,
                   ranks_per_node=int(plat["GPU_PER_NODE"]) if "GPU_PER_NODE" in plat else None,
                   source="ParaDL platform file")


def read_plat(path, tiers_path=None, **kwargs) -> Machine:
    """Read a ``.plat`` file (and optionally an ``abci_tiers.json``) into a Machine."""
    with open(path, encoding="utf-8") as fh:
        plat = parse_plat_text(fh.read())
    tiers = None
    if tiers_path:
        with open(tiers_path, encoding="utf-8") as fh:
            tiers = json.load(fh)
    return machine_from_plat(plat, tiers, **kwargs)


def parse_summary(text: str) -> list:
    """Rows of the SUMMARY table of a ParaDL projection log.

    Returns:
        A list of dicts: name, B, p, mem, tcomp, tcomm, time (per epoch).

    Example:
        >>> parse_summary("==SUMMARY==\\nname B p\\ndata\\t64.0\\t2.0\\t9e9\\t5.0\\t1.0\\t6.0\\t1")[0]["p"]
        2
    """
    rows, on = [], False
    for line in text.splitlines():
        if "SUMMARY" in line:
            on = True
            continue
        parts = line.split()
        if not on or len(parts) < 7 or parts[0] == "name":
            continue
        try:
            nums = [float(v) for v in parts[1:7]]
        except ValueError:
            continue
        rows.append({"name": parts[0], "B": int(nums[0]), "p": int(nums[1]), "mem": nums[2],
                     "tcomp": nums[3], "tcomm": nums[4], "time": nums[5]})
    return rows
