"""Automatic hybrid-parallel rewrite of unmodified Keras models.

``transform(model, strategy, **options)`` plans (pure Python: :mod:`.graph`,
:mod:`.layouts`, :mod:`.rules`, :mod:`.strategies`, :mod:`.planner`) and
builds (:mod:`.rewrite`) the parallel model; ``gather(model)`` returns the
plain Keras model with the full weights; ``describe(model)`` prints the
per-layer strategy, local weight shapes, collectives and memory.
"""
from tfhybrid.transform.api import transform
from tfhybrid.transform.describe import describe
from tfhybrid.transform.gather import gather

__all__ = ["transform", "gather", "describe"]
