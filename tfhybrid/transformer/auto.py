"""``strategy="auto"``: the oracle's choice of grid, strategy and per-layer use.

Candidates, for every model-group size ``k`` dividing the world (only
``init``'s when ``keep_grid=True``):

* every strategy ``transform`` builds, priced by :func:`tfhybrid.oracle.rank`
  on the grid ``p/k x k``;
* Gholami's integrated per-layer plan on that grid
  (:func:`tfhybrid.oracle.per_layer.grid_plan`, Eq. 6): each weighted layer
  uses its model group for a domain split (``s``), a model split (``f``/``c``)
  or not at all, whichever is cheapest for that layer.

They are tried fastest first; the first one ``transform`` would build
(:func:`tfhybrid.transformer.feasibility.refusal`, the check ``tfhybrid plan``
also uses) wins. When it needs another grid than ``init``'s, the grid is
re-formed (every rank computes the same choice from the same model, batch and
machine file, so the collective re-initialisation pairs up) and a line on
rank 0 says so. The choice and every layer's alternatives are kept for
:func:`tfhybrid.describe`.

Example:
    >>> tfhybrid.init()                                       # horovodrun -np 4
    >>> pmodel = tfhybrid.transform(model, "auto", batch_size=64)
    >>> tfhybrid.describe(pmodel)            # ends with "auto: ..." and per-layer costs
"""
from __future__ import annotations

import dataclasses
import math
from typing import Optional, Tuple

from tfhybrid import runtime
from tfhybrid.transformer.feasibility import _model_parallel, refusal
from tfhybrid.transformer.options import BUILDABLE, options_for


@dataclasses.dataclass(frozen=True)
class AutoChoice:
    """What ``auto`` chose and why.

    Attributes:
        strategy: The strategy built.
        model_parallel: Its model-group size (the grid is ``p/k x k``).
        options: The options ``transform`` was given for it.
        predicted_s: Predicted seconds per iteration.
        plan: The per-layer :class:`~tfhybrid.oracle.per_layer.IntegratedPlan`
            when the integrated plan won, else None.
        ranking: ``(label, seconds, refusal or None)`` of every candidate tried,
            fastest first.
        regridded: ``(old, new)`` model-group sizes when the grid was re-formed.
    """

    strategy: str
    model_parallel: int
    options: dict
    predicted_s: float
    plan: object = None
    ranking: Tuple[tuple, ...] = ()
    regridded: Optional[Tuple[int, int]] = None

    def summary(self) -> str:
        """Several lines: the choice, the grid, the runners-up, per-layer costs."""
        lines = [f"auto: {self.strategy} on model groups of {self.model_parallel} "
                 f"({self.predicted_s * 1e3:.3g} ms predicted per iteration)"]
        if self.regridded:
            lines.append(f"  grid re-formed: model_parallel {self.regridded[0]} -> "
                         f"{self.regridded[1]}")
        for label, seconds, why in self.ranking[:6]:
            state = "chosen" if why is None else f"refused by transform: {why[:90]}"
            lines.append(f"  {label:<34} {seconds * 1e3:9.3g} ms  {state}")
            if why is None:
                break
        if self.plan is not None:
            lines += ["  per layer (chosen, then the alternatives on this grid):"] + \
                ["  " + line for line in self.plan.table().splitlines()[1:]]
        return "\n".join(lines)


def _label(strategy, k, options):
    extra = ""
    if options.get("layers"):
        extra = " per-layer " + ",".join(f"{n}:{c}" for n, c in options["layers"].items())
    if options.get("spatial_layers"):
        extra = f" spatial_layers={options['spatial_layers']}" + extra
    return f"{strategy} k={k}{extra}"[:34]


def _uniform(oracle, model, p, batch_size, machine, k):
    """(seconds, strategy, k, options, None) of each strategy priced on grid k."""
    out = []
    for pred in oracle.rank(model, p, batch_size, machine,
                            strategies=[s for s in BUILDABLE], model_parallel=k):
        kk = _model_parallel(pred)
        if not pred.feasible or kk != k:
            continue
        opts = {}
        if pred.strategy == "gmp" and pred.options.get("mp"):
            opts["mp"] = pred.options["mp"]
        if pred.strategy in ("s", "ds"):
            grid = pred.options.get("grid") or {}
            if grid.get("spatial"):
                opts["spatial"] = tuple(grid["spatial"])
        out.append((pred.total_s, pred.strategy, k, opts, None))
    return out


def choose(model, graph, grid, options) -> Tuple[object, AutoChoice]:
    """The :class:`TransformOptions` to build and the :class:`AutoChoice` record.

    Re-forms the grid when the choice needs another model-group size (unless
    ``keep_grid``). Raises ``ValueError`` naming every candidate's refusal
    when none can be built.
    """
    try:
        from tfhybrid import oracle
        from tfhybrid.oracle import per_layer
    except ImportError as err:
        raise ValueError(
            "strategy='auto' asks tfhybrid.oracle for the best strategy, but the oracle "
            f"is unavailable ({err}); pass an explicit strategy {BUILDABLE}.") from None
    batch_size = options.get("batch_size")
    if batch_size is None:
        raise ValueError("strategy='auto' needs the global batch size the oracle predicts "
                         "for: pass batch_size=<global batch>, e.g. "
                         "tfhybrid.transform(model, 'auto', batch_size=64).")
    machine = options.get("machine") or oracle.default_machine_path()
    p = grid.size
    ks = [grid.model_size] if options.get("keep_grid") else \
        [k for k in range(1, p + 1) if p % k == 0]
    user_layers = options.get("layers")
    cands = []
    for k in ks:
        cands += _uniform(oracle, model, p, batch_size, machine, k)
        if not user_layers:      # the user's own per-layer choices win over the oracle's
            plan = per_layer.integrated_plans(model, p, batch_size, machine, model_parallel=k)
            for pl in plan:
                if pl.strategy != "d":
                    cands.append((pl.total_s, pl.strategy, k, dict(pl.options), pl))
    cands.sort(key=lambda c: c[0])
    ranking = []
    for seconds, strategy, k, opts, plan in cands:
        if math.isinf(seconds):
            continue
        merged = {key: v for key, v in options.items()
                  if key not in ("batch_size", "machine", "keep_grid")}
        merged.update(opts)
        kept = options_for(strategy, merged)
        kept_dict = {f.name: getattr(kept, f.name) for f in dataclasses.fields(kept)
                     if f.name in merged}
        why = refusal(model, strategy, p, k, graph=graph, **kept_dict)
        ranking.append((_label(strategy, k, opts), seconds, why))
        if why is None:
            regridded = None
            if k != grid.model_size:
                regridded = (grid.model_size, k)
                runtime.reform(model_parallel=k)
                if runtime.is_root():
                    print(f"tfhybrid.transform(strategy='auto'): re-formed the process grid "
                          f"from model_parallel={grid.model_size} to {k} for {strategy} "
                          "(pass keep_grid=True to keep init's grid)", flush=True)
            return kept, AutoChoice(strategy, k, kept_dict, seconds, plan, tuple(ranking),
                                    regridded)
    why = "; ".join(f"{label}: {reason}" for label, _, reason in ranking) or \
        "the oracle found no feasible candidate"
    raise ValueError(f"strategy='auto': tfhybrid.transform builds no strategy for model "
                     f"{model.name!r} on {p} ranks: {why}")
