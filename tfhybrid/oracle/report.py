"""Render oracle predictions: ranked text table, JSON document and PNG chart.

The chart is ParaDL Fig. 3's view: one stacked bar per strategy (compute and
each communication phase), infeasible strategies hatched and labelled.

Example:
    >>> from tfhybrid.oracle.prediction import Prediction
    >>> p = Prediction("d", 2, 8, 0.5, {"GE-allreduce": 0.1}, 0.0, 2e9, {}, True, ())
    >>> format_table([p]).splitlines()[2].split()[:3]
    ['1', 'd', 'yes']
"""
from __future__ import annotations

import json
import math

from tfhybrid.oracle.prediction import PHASES

_SHORT = {"FB-allgather": "FB-ag", "FB-allreduce": "FB-ar", "halo": "halo",
          "GE-allreduce": "GE-ar", "p2p": "p2p"}


def _ms(v):
    return "-" if not math.isfinite(v) else f"{v * 1e3:.4g}"


def _short_options(opts) -> str:
    keep = []
    for key in ("grid", "mp", "n_f", "n_c", "segments", "local_batch"):
        if key in opts and opts[key] is not None:
            keep.append(f"{key}={opts[key]}")
    if opts.get("partitioned_layers") is not None and "mp" in opts:
        keep.append(f"split={len(opts['partitioned_layers'])} layers")
    return " ".join(keep).replace(" ", "") if len(keep) == 1 else "; ".join(keep)


def format_table(preds) -> str:
    """Ranked plain-text table: times in ms per iteration, memory in GB per rank."""
    head = (f"{'#':>2}  {'strategy':<9} {'ok':<4} {'total':>9} {'compute':>9} "
            + " ".join(f"{_SHORT[p]:>8}" for p in PHASES) + f" {'mem GB':>8}  options / limits")
    lines = [head, "-" * len(head)]
    for i, p in enumerate(preds, 1):
        note = _short_options(p.options)
        if not p.feasible:
            note = "; ".join(p.reasons)
        lines.append(f"{i:>2}  {p.strategy:<9} {'yes' if p.feasible else 'NO':<4} "
                     f"{_ms(p.total_s):>9} {_ms(p.compute_s):>9} "
                     + " ".join(f"{_ms(p.comm_s[ph]):>8}" for ph in PHASES)
                     + f" {p.memory_bytes / 1e9:>8.3g}  {note}")
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
    fig, ax = plt.subplots(figsize=(max(6, 0.9 * len(shown) + 2), 4.5))
    parts = [("compute", lambda p: p.compute_s + p.overhead_s)]
    parts += [(ph, lambda p, ph=ph: p.comm_s[ph]) for ph in PHASES]
    colors = ["#4c72b0", "#dd8452", "#c44e52", "#55a868", "#8172b3", "#937860"]
    x = range(len(shown))
    bottom = [0.0] * len(shown)
    for (label, get), color in zip(parts, colors):
        vals = [get(p) * 1e3 for p in shown]
        if not any(vals):
            continue
        hatches = [None if p.feasible else "//" for p in shown]
        bars = ax.bar(x, vals, bottom=bottom, color=color, label=label)
        for bar, h in zip(bars, hatches):
            if h:
                bar.set_hatch(h)
                bar.set_alpha(0.45)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set_xticks(list(x))
    ax.set_xticklabels([p.strategy + ("" if p.feasible else "\n(infeasible)") for p in shown])
    ax.set_ylabel("time per iteration (ms)")
    ax.set_title(title or "tfhybrid oracle: predicted time per iteration")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
