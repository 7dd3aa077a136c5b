"""Validated options of :func:`tfhybrid.transform` (pure Python).

One frozen :class:`TransformOptions` holds every option with its default;
:func:`make_options` builds it from the keyword arguments a user passed and
rejects options that do not apply to the chosen strategy, so a typo or a
misplaced option fails loudly instead of being ignored.
"""
from __future__ import annotations

import dataclasses
from typing import Dict, Optional, Tuple, Union

from tfhybrid._compat import renamed_option
from tfhybrid.optimizer.averaging import check_average_every, check_averaging
from tfhybrid.oracle.formulas import SPLITBRAIN_CCR_THRESHOLD
from tfhybrid.spatial_geometry import SPATIAL_AXES, default_spatial, spatial_grid  # noqa: F401
from tfhybrid.strategy_names import BUILT, TRANSFORM_NAMES

STRATEGIES = TRANSFORM_NAMES   # the one table: tfhybrid.strategy_names
FALLBACKS = ("error", "replicate")
BATCH_NORMS = ("sync", "local")
LAYER_KINDS = ("f", "c", "s", "replicate")
MODULO_SCHEMES = ("BK", "B", "B/K")
DEFAULT_CCR_THRESHOLD = SPLITBRAIN_CCR_THRESHOLD   # one definition: tfhybrid.oracle.formulas

# Options that only some strategies read.
_APPLIES = {
    "mp": ("gmp",),
    "ccr_threshold": ("gmp",),
    "scheme": ("gmp",),
    "average_every": ("gmp",),
    "averaging": ("gmp",),
    "spatial": ("s", "ds"),
    "spatial_layers": ("s", "ds"),
    "batch_size": ("auto", "ls"),
    "machine": ("auto", "ls", "p"),
    "keep_grid": ("auto",),
    "fc_workers": ("ls",),
    "stages": ("p",),
    "micro_batches": ("p",),
    "batch_norm": tuple(name for name in BUILT if name != "ls"),
}
# Strategies the transformer builds (auto picks among them).
BUILDABLE = BUILT


@dataclasses.dataclass(frozen=True)
class TransformOptions:
    """Options of :func:`tfhybrid.transform`.

    Attributes:
        strategy: One of ``d f c s df ds gmp auto``.
        mp: gmp's model-parallel group size (default: the grid's
            ``model_parallel``).
        ccr_threshold: gmp partitions a Dense layer when its
            computation-to-communication ratio (FLOPs per byte moved, see
            :func:`tfhybrid.transformer.strategies.ccr`) is at least this.
        scheme: gmp's ModuloLayer scheme (SplitBrain; the oracle's and
            :class:`tfhybrid.layers.ModuloLayer`'s name; ``modulo=`` is the
            deprecated spelling): ``"BK"`` (default;
            the model-parallel region runs once on the group's K*B rows),
            ``"B"`` (K rounds: the group's ranks take turns broadcasting their
            B rows, each round recomputed in the backward pass: activation
            memory of B rows; one model-parallel region that ends at the
            model's single output) or ``"B/K"`` (K micro-steps of B rows,
            each recomputed in the backward pass: activation memory of B rows instead of K*B; needs
            a local batch divisible by ``mp`` and one model-parallel region
            that ends at the model's single output).
        average_every: gmp: SplitBrain's model-averaging period N (§4). 1
            (default): the model-parallel part's gradients are reduced across
            the model groups every step, exact synchronous training. N > 1:
            each model group updates its copy of the model-parallel part
            (the layers from the ModuloLayer on; with ``mp=1`` from the first
            Dense layer whose CCR reaches ``ccr_threshold``) with its own
            rows' gradient, and the copies are averaged across groups every
            N steps. **Approximate** (not single-process training); the
            convolutions before it stay exactly data parallel every step.
            See :mod:`tfhybrid.optimizer.averaging`.
        averaging: gmp with ``average_every`` > 1: ``"p2p"`` (default:
            allreduce-average over the model groups) or ``"ps"`` (parameter
            server: model group 0's ranks receive every copy, average and
            broadcast back).
        spatial: s/ds split: ``"height"``, ``"width"`` or ``(ph, pw)`` for
            image models; ``"depth"``, ``"height"``, ``"width"`` or
            ``(pd, ph, pw)`` for volume (Conv3D) models. Default: the first
            spatial axis (height, or depth for volumes).
        spatial_layers: s/ds: number of leading Conv2D/Conv3D (and
            Conv2DTranspose/Conv3DTranspose) layers to split spatially
            (default: every one before the first layer that cannot run on a
            spatial block, e.g. Flatten; a whole U-Net runs on blocks; s/ds
            raise when that leaves none).
        layers: Per-layer overrides ``{"name": "f"|"c"|"s"|"replicate"}``.
        fallback: ``"error"`` (default) raises for a layer the strategy
            cannot partition; ``"replicate"`` keeps it replicated.
        batch_size: auto: the global batch the oracle predicts for (required).
        machine: auto: the oracle's machine spec (dict, JSON path or
            ``tfhybrid.oracle.Machine``; default the calibrated spec of the
            development box, ``tfhybrid.oracle.default_machine_path()``).
        keep_grid: auto: choose among the strategies of ``init``'s grid only
            (default False: every grid ``p/k x k`` is priced and the grid is
            re-formed when another one is faster, Gholami §2.2).
        fc_workers: ls: number of FC workers n_f (must divide the n_c = world - n_f
            CONV workers; default: Stanza's node assignment from the oracle).
        stages: p: number of pipeline stages S (must equal the model-group size
            of ``tfhybrid.init(model_parallel=S)``; default that size).
        micro_batches: p: GPipe micro-batches M per local batch (must divide
            it; default S).
        batch_norm: ``"sync"`` (default, exact): every BatchNormalization
            whose batch or space is split over ranks becomes a
            SyncBatchNormalization over those ranks, equal to single-process
            batch norm. ``"local"``: plain per-rank BatchNormalization on each
            rank's rows (or spatial block), as Horovod does; cheaper (no
            allreduce of the moments) but NOT equal to single-process
            training (statistics of fewer rows or of a block).
    """

    strategy: str
    mp: Optional[int] = None
    ccr_threshold: float = DEFAULT_CCR_THRESHOLD
    scheme: str = "BK"
    average_every: int = 1
    averaging: str = "p2p"
    spatial: Union[None, str, Tuple[int, ...]] = None
    spatial_layers: Optional[int] = None
    layers: Dict[str, str] = dataclasses.field(default_factory=dict)
    fallback: str = "error"
    batch_size: Optional[int] = None
    machine: object = None
    keep_grid: bool = False
    fc_workers: Optional[int] = None
    stages: Optional[int] = None
    micro_batches: Optional[int] = None
    batch_norm: str = "sync"


def make_options(strategy, **options) -> TransformOptions:
    """Validate ``strategy`` and keyword ``options`` into a :class:`TransformOptions`.

    Raises:
        ValueError: unknown strategy or option, an option that does not apply
            to the strategy, or an invalid value.

    Example:
        >>> make_options("gmp", mp=2).mp
        2
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"Received an unknown strategy: strategy={strategy!r}; expected one "
                         f"of {STRATEGIES} (see concepts.md#strategies: "
                         "python -m tfhybrid.docs concepts).")
    options = renamed_option(options, "modulo", "scheme", "tfhybrid.transform")
    known = {f.name for f in dataclasses.fields(TransformOptions)} - {"strategy"}
    for key in options:
        if key not in known:
            raise ValueError(f"Received an unknown option {key}={options[key]!r} for strategy "
                             f"{strategy!r}; valid options are {sorted(known)}.")
        allowed = _APPLIES.get(key)
        if allowed and strategy not in allowed and strategy != "auto":
            raise ValueError(
                f"Option {key}={options[key]!r} does not apply to strategy {strategy!r}; "
                f"it is read only by strategy {' / '.join(map(repr, allowed))}. Remove it "
                f"or use strategy={allowed[0]!r}.")
    opts = TransformOptions(strategy=strategy, **options)
    _validate(opts)
    return opts


def _validate(o: TransformOptions):
    if o.mp is not None and (isinstance(o.mp, bool) or not isinstance(o.mp, int) or o.mp < 1):
        raise ValueError(f"Received an invalid value for `mp`, expected a positive integer. "
                         f"Received: mp={o.mp!r}")
    if isinstance(o.ccr_threshold, bool) or not isinstance(o.ccr_threshold, (int, float)) \
            or o.ccr_threshold < 0:
        raise ValueError(f"Received an invalid value for `ccr_threshold`, expected a "
                         f"non-negative number. Received: ccr_threshold={o.ccr_threshold!r}")
    if o.scheme not in MODULO_SCHEMES:
        raise ValueError(f"Received an invalid value for `scheme`: scheme={o.scheme!r}; "
                         f"expected one of {MODULO_SCHEMES} (gmp's ModuloLayer scheme: 'BK' "
                         "gathers the group's K*B rows, 'B' broadcasts each rank's B rows "
                         "in turn, 'B/K' runs K micro-steps of B rows).")
    if o.batch_norm not in BATCH_NORMS:
        raise ValueError(f"Received an invalid value for `batch_norm`: batch_norm="
                         f"{o.batch_norm!r}; expected one of {BATCH_NORMS} ('sync': "
                         "synchronised statistics, equal to single-process training; "
                         "'local': per-rank statistics as in Horovod).")
    check_average_every(o.average_every)
    check_averaging(o.averaging)
    if o.fallback not in FALLBACKS:
        raise ValueError(f"Received an invalid value for `fallback`: fallback={o.fallback!r}; "
                         f"expected one of {FALLBACKS}.")
    if o.spatial_layers is not None and (isinstance(o.spatial_layers, bool) or not isinstance(
            o.spatial_layers, int) or o.spatial_layers < 1):
        raise ValueError(f"Received an invalid value for `spatial_layers`, expected a positive "
                         f"integer. Received: spatial_layers={o.spatial_layers!r}")
    if o.batch_size is not None and (isinstance(o.batch_size, bool) or not isinstance(
            o.batch_size, int) or o.batch_size < 1):
        raise ValueError(f"Received an invalid value for `batch_size`, expected the global "
                         f"batch size (a positive integer). Received: batch_size={o.batch_size!r}")
    if not isinstance(o.layers, dict):
        raise ValueError(f"Received an invalid value for `layers`: {o.layers!r}; expected a "
                         f"dict such as {{'fc1': 'f', 'fc2': 'c'}}.")
    for name, kind in o.layers.items():
        if kind not in LAYER_KINDS:
            raise ValueError(f"Received an invalid override layers[{name!r}]={kind!r}; "
                             f"expected one of {LAYER_KINDS}.")


def options_for(strategy: str, options: dict) -> TransformOptions:
    """``options`` re-validated for the strategy ``auto`` chose (options that do
    not apply to it, and auto's own, are dropped).

    Example:
        >>> options_for("df", {"mp": 2, "fallback": "replicate"}).fallback
        'replicate'
    """
    kept = {k: v for k, v in options.items()
            if strategy in _APPLIES.get(k, (strategy,))}
    return make_options(strategy, **kept)
