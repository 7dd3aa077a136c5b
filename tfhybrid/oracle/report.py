"""Render oracle predictions: ranked text table, JSON document and PNG chart.

The chart is ParaDL Fig. 3's view: one stacked bar per strategy (compute and
each communication phase), infeasible strategies hatched and labelled.

Example:
    >>> from tfhybrid.oracle.record import Prediction
    >>> p = Prediction("d", 2, 8, 0.5, {"GE-allreduce": 0.1}, 0.0, 2e9, {}, True, ())
    >>> format_table([p]).splitlines()[2].split()[:3]
    ['1', 'd', 'yes']
"""
from __future__ import annotations

import json
import math

from tfhybrid.oracle.record import PHASES

_SHORT = {"FB-allgather": "FB-ag", "FB-allreduce": "FB-ar", "halo": "halo",
          "GE-allreduce": "GE-ar", "p2p": "p2p"}


def _num(v, scale):
    if not math.isfinite(v):
        return "-"
    v *= scale
    return f"{v:.0f}" if abs(v) >= 1000 else f"{v:.4g}"


def _unit(preds):
    top = max((p.total_s for p in preds if math.isfinite(p.total_s)), default=0.0)
    return (1.0, "s") if top > 10 else (1e3, "ms")


def _grid_text(grid) -> str:
    if not isinstance(grid, dict):
        return str(grid)
    model = grid.get("model") or "x".join(str(v) for v in grid.get("spatial", [1]))
    kind = "model" if "model" in grid else "spatial"
    return f"data {grid.get('data')} x {kind} {model}"


def _short_options(opts) -> str:
    keep = []
    for key in ("grid", "mp", "n_c", "n_f", "segments", "local_batch"):
        if opts.get(key) is not None:
            val = _grid_text(opts[key]) if key == "grid" else opts[key]
            keep.append(f"{key}: {val}")
    if opts.get("partitioned_layers") is not None and "mp" in opts:
        keep.append(f"{len(opts['partitioned_layers'])} FC layers split")
    return "; ".join(keep)


def format_table(preds) -> str:
    """Ranked plain-text table: times per iteration (ms, or s when > 10 s), GB per rank."""
    scale, unit = _unit(preds)
    head = (f"{'#':>2}  {'strategy':<9} {'ok':<4} {'total':>9} {'compute':>9} "
            + " ".join(f"{_SHORT[p]:>8}" for p in PHASES) + f" {'mem GB':>8}  options / limits")
    lines = [head, "-" * len(head)]
    for i, p in enumerate(preds, 1):
        note = _short_options(p.options)
        if not p.feasible:
            note = "; ".join(p.reasons)
        lines.append(f"{i:>2}  {p.strategy:<9} {'yes' if p.feasible else 'NO':<4} "
                     f"{_num(p.total_s, scale):>9} "
                     f"{_num(p.compute_s + p.overhead_s, scale):>9} "
                     + " ".join(f"{_num(p.comm_s[ph], scale):>8}" for ph in PHASES)
                     + f" {p.memory_bytes / 1e9:>8.3g}  {note}")
    lines.append(f"times: {unit} per iteration (compute includes the per-step overhead); "
                 "mem: GB per rank")
    hidden = [p for p in preds if p.hidden_s > 0]
    if hidden:
        lines.append("total = compute + communication - the gradient allreduce hidden behind "
                     "back-propagation (machine overlap): " + ", ".join(
                         f"{p.strategy} {_num(p.hidden_s, scale).strip()}" for p in hidden))
    return "\n".join(lines)


def _clean(obj):
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    return obj


def to_json(preds, meta=None, dataset_size=None) -> dict:
    """A JSON-ready dict: meta (model, p, batch, machine) and the ranked predictions.

    Non-finite numbers become null.
    """
    rows = []
    for i, p in enumerate(preds, 1):
        d = p.to_dict()
        d["rank"] = i
        if dataset_size:
            d["per_epoch"] = p.per_epoch(dataset_size)
        rows.append(d)
    return _clean({"meta": meta or {}, "predictions": rows})


def write_json(path, preds, meta=None, dataset_size=None):
    """Write :func:`to_json` to ``path``."""
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(to_json(preds, meta, dataset_size), fh, indent=1)


def plot_png(path, preds, title=""):
    """Stacked bars of compute + communication phases per strategy (matplotlib Agg).

    Infeasible strategies are hatched and labelled; the y axis stops at 2.5x
    the slowest feasible strategy and taller bars are cut and annotated with
    their total.

    Raises:
        RuntimeError: matplotlib is not installed (``pip install tfhybrid[plot]``).
    """
    try:
        import matplotlib  # noqa: WPS433
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: WPS433
    except ImportError as err:
        raise RuntimeError("The PNG chart needs matplotlib: pip install 'tfhybrid[plot]'.") \
            from err
    shown = [p for p in preds if math.isfinite(p.total_s)]
    scale, unit = (1.0, "s") if max((p.total_s for p in shown), default=0) > 10 else (1e3, "ms")
    fig, ax = plt.subplots(figsize=(max(6, 0.9 * len(shown) + 2), 4.5))
    _stack(ax, shown, scale)
    feasible = [p.total_s * scale for p in shown if p.feasible]
    if feasible:
        top = 2.5 * max(feasible)
        ax.set_ylim(0, top)
        for i, p in enumerate(shown):
            if p.total_s * scale > top:
                ax.text(i, top * 0.97, f"{p.total_s * scale:.3g} {unit}", ha="center",
                        va="top", fontsize=8, rotation=90)
    ax.set_xticks(list(range(len(shown))))
    ax.set_xticklabels([p.strategy + ("" if p.feasible else "\n(infeasible)") for p in shown])
    ax.set_ylabel(f"time per iteration ({unit})")
    ax.set_title(title or "tfhybrid oracle: predicted time per iteration")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _stack(ax, shown, scale):
    parts = [("compute", lambda p: p.compute_s + p.overhead_s)]
    parts += [(ph, lambda p, ph=ph: p.comm_s[ph]) for ph in PHASES]
    colors = ["#4c72b0", "#dd8452", "#c44e52", "#55a868", "#8172b3", "#937860"]
    bottom = [0.0] * len(shown)
    for (label, get), color in zip(parts, colors):
        vals = [get(p) * scale for p in shown]
        if not any(vals):
            continue
        bars = ax.bar(range(len(shown)), vals, bottom=bottom, color=color, label=label)
        for bar, p in zip(bars, shown):
            if not p.feasible:
                bar.set_hatch("//")
                bar.set_alpha(0.45)
        bottom = [b + v for b, v in zip(bottom, vals)]
