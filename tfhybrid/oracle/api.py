"""The oracle's public entry points: predict one strategy, rank all, choose one.

Example:
    >>> import keras
    >>> m = keras.Sequential([keras.Input((32,)), keras.layers.Dense(64),
    ...                       keras.layers.Dense(10)])
    >>> mach = {"alpha": 1e-5, "beta": 1e-9, "flop_rate": 1e10}
    >>> predict(m, "d", p=2, batch_size=16, machine=mach).feasible
    True
"""
from __future__ import annotations

import functools

from tfhybrid._compat import renamed_option
from tfhybrid.oracle import strategies_hybrid  # noqa: F401 (registers gmp, ls)
from tfhybrid.oracle.machine import as_machine
from tfhybrid.oracle.record import Context, Prediction
from tfhybrid.oracle.profile import ModelProfile, profile
from tfhybrid.oracle.strategies import STRATEGIES
from tfhybrid.strategy_names import PREDICTED

STRATEGY_NAMES = PREDICTED   # the one table: tfhybrid.strategy_names
_OPTIONS = {"d": {"replicated_fc"}, "s": {"spatial", "grid"}, "ds": {"spatial", "grid"},
            "p": {"segments"},
            "f": {"pairing", "fallback"}, "c": {"fallback"},
            "df": {"grid", "model_parallel", "pairing", "fallback"},
            "serial": set(),
            "gmp": {"mp", "ccr_threshold", "scheme"}, "ls": {"n_f"}}


def _batch_size_option(fn):
    """Accept the deprecated keyword ``batch=`` for ``batch_size=`` (one name everywhere)."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        return fn(*args, **renamed_option(kwargs, "batch", "batch_size",
                                          f"tfhybrid.oracle.{fn.__name__}"))
    return wrapper


def _check_args(strategy, p, batch_size):
    if strategy not in STRATEGIES:
        raise ValueError(f"Received strategy={strategy!r}; expected one of {STRATEGY_NAMES}.")
    for name, val in (("p", p), ("batch_size", batch_size)):
        if isinstance(val, bool) or not isinstance(val, int) or val < 1:
            raise ValueError(f"Received {name}={val!r}; expected a positive integer.")


def _as_profile(model_or_profile) -> ModelProfile:
    return profile(model_or_profile)


@_batch_size_option
def predict(model_or_profile, strategy: str, p: int, batch_size: int, machine,
            **strategy_options) -> Prediction:
    """Predict one iteration of ``strategy`` on ``p`` ranks with global batch ``batch_size``.

    Args:
        model_or_profile: A built Keras model or a :class:`ModelProfile`.
        strategy: One of ``serial, d, s, p, f, c, df, ds, gmp, ls``.
        p: World size (serial ignores it and predicts one rank).
        batch_size: Global mini-batch B (``batch=`` is the deprecated spelling).
        machine: A :class:`Machine`, a dict of its keys, or a JSON path.
        **strategy_options: ``d``: replicated_fc; ``s``/``ds``: spatial (the
            block grid ``(ph, pw)`` or an axis name, as ``tfhybrid.transform``'s
            ``spatial=``; ``grid=`` is deprecated);
            ``f``: pairing, fallback; ``c``: fallback; ``df``: grid=(p_data,
            p_model) or model_parallel, pairing, fallback (``"replicate"``:
            layers the model group cannot split are replicated, as
            ``transform(..., fallback="replicate")`` builds them; default
            ``"error"``: such a prediction is infeasible); ``p``: segments;
            ``gmp``: mp, ccr_threshold, scheme; ``ls``: n_f. Options not given
            are chosen by the oracle and reported in ``Prediction.options``.

    Returns:
        A :class:`Prediction` (infeasible ones carry ``reasons``).

    Raises:
        ValueError: unknown strategy or option, non-positive p or batch, or an
            invalid machine.

    Example:
        >>> from tfhybrid.oracle.profile import LayerRow, ModelProfile
        >>> prof = ModelProfile("m", (LayerRow("fc", "dense", 8, 8, 0, 16, 32, 4, 2, 4, 2),), 4)
        >>> predict(prof, "f", p=4, batch_size=8, machine={"alpha": 0, "beta": 0,
        ...         "flop_rate": 1.0}).reasons[0][:33]
        'model group 4 exceeds the minimum'
    """
    _check_args(strategy, p, batch_size)
    unknown = set(strategy_options) - _OPTIONS[strategy]
    if unknown:
        raise ValueError(f"Unknown options {sorted(unknown)} for strategy {strategy!r}; "
                         f"accepted: {sorted(_OPTIONS[strategy])}.")
    ctx = Context(_as_profile(model_or_profile), as_machine(machine), batch_size)
    return STRATEGIES[strategy](ctx, p, **strategy_options)


def grid_options(p, model_parallel):
    """Candidate (strategy, options) pairs compatible with a fixed model-group size."""
    k = model_parallel
    if k is None:
        return {name: {} for name in STRATEGY_NAMES}
    if not isinstance(k, int) or k < 1 or p % k:
        raise ValueError(f"Received model_parallel={k!r} with p={p}; it must divide p.")
    out = {"serial": {}}
    if k == 1:
        out["d"] = {}
    if k == p:
        out.update(f={}, c={}, s={})
    if 1 < k < p:
        out.update(df={"grid": (p // k, k)}, ds={"spatial": (k, 1)})
    out["gmp"] = {"mp": k}
    return out


@_batch_size_option
def rank(model_or_profile, p: int, batch_size: int, machine, strategies=None,
         model_parallel=None) -> list:
    """Predictions of every strategy, feasible ones first, each group by total time.

    Args:
        model_or_profile: Keras model or :class:`ModelProfile`.
        p: World size.
        batch_size: Global mini-batch.
        machine: Machine spec.
        strategies: Names to rank (default: all).
        model_parallel: When the process grid is fixed (``tfhybrid.init(
            model_parallel=k)``), only strategies that use model groups of k.

    Example:
        >>> from tfhybrid.oracle.profile import LayerRow, ModelProfile
        >>> prof = ModelProfile("m", (LayerRow("fc", "dense", 8, 8, 0, 16, 32, 4, 2, 4, 2),), 4)
        >>> [r.strategy for r in rank(prof, 2, 8, {"alpha": 0, "beta": 0, "flop_rate": 1.0},
        ...                           strategies=("serial", "d"))]
        ['d', 'serial']
    """
    if isinstance(strategies, str):
        strategies = [s.strip() for s in strategies.split(",")]
    unknown = [s for s in (strategies or ()) if s not in STRATEGY_NAMES]
    if unknown:
        raise ValueError(f"Received unknown strategies {unknown}; expected names from "
                         f"{STRATEGY_NAMES}.")
    cands = grid_options(p, model_parallel)
    names = [s for s in (strategies or STRATEGY_NAMES) if s in cands]
    prof = _as_profile(model_or_profile)
    mach = as_machine(machine)
    preds = [predict(prof, s, p, batch_size, mach, **cands[s]) for s in names]
    return sorted(preds, key=lambda r: (not r.feasible, r.total_s))


@_batch_size_option
def choose(model_or_profile, p: int | None = None, batch_size: int | None = None, machine=None,
           strategies=None, exclude=("serial",), grid=None, model_parallel=None) -> Prediction:
    """The fastest feasible strategy and its options (what ``strategy="auto"`` uses).

    Args:
        model_or_profile: Keras model or :class:`ModelProfile`.
        p: World size (or give ``grid``).
        batch_size: Global mini-batch (required).
        machine: Machine spec: dict, JSON path or :class:`Machine` (required;
            never assumed).
        strategies: Candidate names (default: all but ``exclude``).
        exclude: Names never chosen (serial by default, since p ranks exist).
        grid: A ``tfhybrid.process_grid.ProcessGrid``: sets p = grid.size and
            model_parallel = grid.model_size.
        model_parallel: Restrict to strategies with model groups of this size.

    Returns:
        The best feasible :class:`Prediction`; ``.strategy`` and ``.options``
        (e.g. ``options['grid']``, ``options['mp']``) tell the transformer what
        to build.

    Raises:
        ValueError: missing p/batch/machine, or no candidate strategy is
            feasible (the message lists each strategy's reasons).

    Example:
        >>> from tfhybrid.oracle.profile import LayerRow, ModelProfile
        >>> prof = ModelProfile("m", (LayerRow("fc", "dense", 8, 8, 0, 16, 32, 4, 2, 4, 2),), 4)
        >>> choose(prof, 2, 8, {"alpha": 0, "beta": 0, "flop_rate": 1.0}).strategy
        'f'
    """
    if grid is not None:
        p = grid.size
        model_parallel = grid.model_size if model_parallel is None else model_parallel
    if p is None or batch_size is None or machine is None:
        raise ValueError("tfhybrid.oracle.choose needs p (or grid), batch_size and machine; "
                         f"received p={p!r}, batch_size={batch_size!r}, "
                         f"machine={'given' if machine else None}. "
                         "Pass batch_size=<global batch> and machine=<JSON path or dict>, e.g. "
                         "tfhybrid.oracle.default_machine_path() on the development box.")
    names = [s for s in (strategies or STRATEGY_NAMES) if s not in (exclude or ())]
    ranked = rank(model_or_profile, p, batch_size, machine, names, model_parallel)
    if not ranked:
        raise ValueError(f"No candidate strategy for p={p}, model_parallel={model_parallel}: "
                         f"none of {names} uses model groups of that size. Pass other "
                         "strategies, or omit strategies to consider all.")
    if not ranked[0].feasible:
        why = "; ".join(f"{r.strategy}: {', '.join(r.reasons)}" for r in ranked)
        raise ValueError(f"No feasible strategy for p={p}, batch_size={batch_size}: {why}")
    return ranked[0]


best = choose
