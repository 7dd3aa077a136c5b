"""The transformer: automatic hybrid-parallel rewrite of unmodified Keras models.

``tfhybrid.gather`` and ``tfhybrid.describe`` are exported from here;
``tfhybrid.transform`` is :func:`tfhybrid.compose.transform`.

``build(model, strategy, **options)`` (what ``tfhybrid.transform`` calls
before it installs the guards: :mod:`tfhybrid.compose`) plans (pure Python: :mod:`.graph`,
:mod:`.layouts`, :mod:`.rules`, :mod:`.strategies`, :mod:`.planner`) and
builds (:mod:`.rewrite`) the parallel model; ``gather(model)`` returns the
plain Keras model with the full weights; ``describe(model)`` prints the
per-layer strategy, local weight shapes, collectives and memory.
"""
from tfhybrid.transformer.api import build
from tfhybrid.transformer.describe import describe
from tfhybrid.transformer.gather import gather

__all__ = ["build", "gather", "describe"]
