"""The transformer: automatic hybrid-parallel rewrite of unmodified Keras models.

The functions are exported as ``tfhybrid.transform``, ``tfhybrid.gather`` and
``tfhybrid.describe``; this subpackage is ``tfhybrid.transformer`` so that the
function does not shadow it.

``transform(model, strategy, **options)`` plans (pure Python: :mod:`.graph`,
:mod:`.layouts`, :mod:`.rules`, :mod:`.strategies`, :mod:`.planner`) and
builds (:mod:`.rewrite`) the parallel model; ``gather(model)`` returns the
plain Keras model with the full weights; ``describe(model)`` prints the
per-layer strategy, local weight shapes, collectives and memory.
"""
from tfhybrid.transformer.api import transform
from tfhybrid.transformer.describe import describe
from tfhybrid.transformer.gather import gather

__all__ = ["transform", "gather", "describe"]
