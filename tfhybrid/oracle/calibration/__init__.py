"""Calibrating the oracle's machine model on the machine it runs on.

* :mod:`.fit` — pure numpy: the least-squares fits of the ring cost models
  (alpha/beta per group size), flop rate and per-layer shares, and the
  machine JSON they produce. Importable without TensorFlow.
* :mod:`.run` — the ``tfhybrid calibrate`` job: times Horovod collectives
  (through :mod:`tfhybrid.comm`) and Keras layers on every rank, then calls
  :mod:`.fit`. Only the CLI imports it.
"""
