"""Would ``tfhybrid.transform`` build this strategy for this model? One check,
shared by ``strategy="auto"`` and ``tfhybrid plan``.

The oracle prices strategies from a per-layer profile and cannot know that,
say, an Embedding cannot be filter-split; the transformer's planner can. This
module runs the planner (pure Python: graph, options, plan; no layer is built
and no collective runs) on a hypothetical process grid, so a strategy that
``transform`` would refuse is never chosen by ``auto`` and is shown infeasible
by ``plan`` with ``transform``'s own reason.

Example:
    >>> m = keras.Sequential([keras.Input((5,), dtype="int32"),
    ...                       keras.layers.Embedding(100, 8), keras.layers.LSTM(4),
    ...                       keras.layers.Dense(2)])
    >>> refusal(m, "d", p=2, model_parallel=1) is None
    True
    >>> "Embedding" in refusal(m, "c", p=2, model_parallel=2)
    True
"""
from __future__ import annotations

import dataclasses
import math
import warnings
from typing import Optional

from tfhybrid.process_grid import ProcessGrid
from tfhybrid.strategy_names import BUILT
from tfhybrid.transformer.graph import as_functional, describe_graph
from tfhybrid.transformer.options import make_options
from tfhybrid.transformer.planner import make_plan


def refusal(model, strategy: str, p: int, model_parallel: int, graph=None,
            **options) -> Optional[str]:
    """``transform``'s ``ValueError`` message for ``strategy`` on ``p`` ranks with
    model groups of ``model_parallel``, or None when it would build.

    Args:
        model: A built Sequential/Functional Keras model.
        strategy: A name ``transform`` builds (others: a refusal saying so).
        p: World size.
        model_parallel: Model-group size (must divide ``p``).
        graph: The model's :class:`~tfhybrid.transformer.graph.GraphSpec`
            (computed when not given; pass it to check several strategies).
        **options: ``transform`` options of that strategy.
    """
    if strategy not in BUILT:
        return f"tfhybrid.transform does not build strategy {strategy!r} (it builds {BUILT})."
    if strategy == "ls":       # ranks run different layers (layer_separation.py)
        from tfhybrid.transformer import layer_separation as ls
        try:
            ls.check_workers(p, options.get("fc_workers") or 1)
            ls.find_cut(as_functional(model, flatten=True))
        except ValueError as err:
            return str(err)
        return None
    if strategy == "p":        # pipeline stages (pipeline.py)
        from tfhybrid.transformer import pipeline
        try:
            stages = pipeline.check_stages(options.get("stages") or model_parallel,
                                           model_parallel)
            pipeline.plan_stages(as_functional(model, flatten=True), stages)
        except ValueError as err:
            return str(err)
        return None
    try:
        grid = ProcessGrid(size=p, rank=0, model_parallel=model_parallel)
        if graph is None:
            graph = describe_graph(as_functional(model, flatten=True))
        with warnings.catch_warnings():    # a check, not a transform: no advice here
            warnings.simplefilter("ignore")
            make_plan(graph, make_options(strategy, **options), grid)
    except ValueError as err:
        return str(err)
    return None


def _model_parallel(pred) -> Optional[int]:
    """The model-group size a prediction's strategy and options use."""
    opts = pred.options or {}
    grid = opts.get("grid")
    if pred.strategy == "d":
        return 1
    if pred.strategy in ("f", "c", "s"):
        return pred.p
    if pred.strategy == "df" and isinstance(grid, dict):
        return grid.get("model")
    if pred.strategy == "ds" and isinstance(grid, dict):
        return math.prod(grid.get("spatial") or (1,))
    if pred.strategy == "gmp":
        return opts.get("mp")
    return None


def _options(pred) -> dict:
    return {"mp": pred.options["mp"]} if pred.strategy == "gmp" and pred.options.get("mp") \
        else {}


def check_predictions(model, predictions) -> list:
    """``predictions`` with every feasible one that ``transform`` would refuse
    marked infeasible, ``transform``'s reason first in its ``reasons``.

    Strategies ``transform`` does not build (``serial``, ``p``, ``ls``) and
    predictions without a model-group size are returned unchanged; the order
    is kept (feasible first, then by time).
    """
    graph = describe_graph(as_functional(model, flatten=True))
    out = []
    for pred in predictions:
        k = _model_parallel(pred)
        if pred.feasible and pred.strategy in BUILT and k:
            why = refusal(model, pred.strategy, pred.p, k, graph=graph, **_options(pred))
            if why:
                pred = dataclasses.replace(pred, feasible=False,
                                           reasons=(f"transform: {why}",) + tuple(pred.reasons))
        out.append(pred)
    return sorted(out, key=lambda r: (not r.feasible, r.total_s))
