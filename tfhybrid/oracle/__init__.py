"""tfhybrid.oracle: predict time and memory of parallel strategies, and pick one.

ParaDL's analytical oracle (Table 3, Appendix A) made usable for Keras 3
models, extended with Gholami et al.'s 1.5D grid, SplitBrain's group model
parallelism, Stanza's layer separation and Lee et al.'s replicated FC
gradients. Pure Python + numpy (Keras only to walk a model in ``profile``);
importable and testable without Horovod.

API::

    profile(model) -> ModelProfile                       # per-layer rows
    predict(model_or_profile, strategy, p, batch_size, machine, **options) -> Prediction
    rank(model_or_profile, p, batch_size, machine, strategies=None,
         model_parallel=None) -> [Prediction]
    choose(model_or_profile, p=None, batch_size=None, machine=None, strategies=None,
           exclude=("serial",), grid=None, model_parallel=None) -> Prediction
                                                        # alias: best(...)

``choose`` is what ``tfhybrid.transform(model, strategy="auto")`` calls: it
returns the fastest feasible :class:`Prediction` (pass ``grid=tfhybrid.grid()``
to restrict it to the initialised model-group size, plus ``batch_size`` and
``machine``, which are required); use ``.strategy`` and
``.options`` (``grid`` for df/ds, ``mp`` and ``partitioned_layers`` for gmp,
``n_f`` for ls, ``segments`` for p). It raises ``ValueError`` listing every
strategy's reasons when none is feasible.

``machine`` is always explicit: a :class:`Machine`, a dict or a JSON file with
``alpha``, ``beta``, optional ``latency`` (per collective) and ``tiers``
([{max_ranks, alpha, beta[, latency]}]), ``flop_rate`` and/or
``layer_times``, ``memory_bytes``, ``phi``, ``gamma``, ``bytes_per_item``
(plus ``step_overhead_s``, ``compute_fixed_s``, ``compute_slots``,
``compute_contention``, ``ranks_per_node``). ``default_machine_path()`` is the calibrated spec of the
development CPU box; it is never used unless passed.

What the model ignores (see each module): overlap of communication with
computation, I/O, external network congestion (self-contention only via
phi), collective-algorithm switching, framework memory beyond gamma.

Example:
    >>> from tfhybrid.oracle import predict, LayerRow, ModelProfile
    >>> prof = ModelProfile("m", (LayerRow("fc", "dense", 8, 8, 0, 16, 32, 4, 2, 4, 2),), 4)
    >>> predict(prof, "d", 2, 8, {"alpha": 0, "beta": 0, "flop_rate": 1.0}).compute_s
    208.0
"""
from tfhybrid.oracle.machine import Machine, Tier, as_machine, default_machine_path
from tfhybrid.oracle.api import STRATEGY_NAMES, best, choose, predict, rank
from tfhybrid.oracle.record import PHASES, Prediction
from tfhybrid.oracle.profile import LayerRow, ModelProfile, profile

__all__ = ["profile", "predict", "rank", "choose", "best", "Machine", "Tier", "as_machine",
           "default_machine_path", "Prediction", "PHASES", "LayerRow", "ModelProfile",
           "STRATEGY_NAMES"]
