"""Gradient clipping by norm when a rank holds only part of the model.

Keras' ``clipnorm`` (each gradient scaled to at most that L2 norm) and
``global_clipnorm`` (all gradients scaled together to at most that global
norm) read norms of the gradients a rank holds. After
:class:`tfhybrid.DistributedOptimizer` reduces them, a replicated or partial
weight's gradient is whole on every rank, but a sharded weight's gradient is
one block (f, c, df, gmp) and a pipeline stage (p) or an ``ls`` worker holds
only its own layers: Keras would clip each block by the block's norm and the
global norm would miss the other ranks' blocks. Single-process training
clips by the norms of the whole weights, so tfhybrid computes them over the
ranks that hold the pieces (one small allreduce of squared norms per group)
and applies Keras' formulas itself, with the wrapped optimizer's own
clipping switched off for that call. ``clipvalue`` is element-wise and needs
nothing.

Under ``LossScaleOptimizer`` the gradients arrive scaled by the loss scale
``S``; the norm used is the scaled norm / ``S``, so the scaled gradient is
multiplied by the same factor Keras applies to the unscaled one.
"""
from __future__ import annotations

import contextlib

import keras
import tensorflow as tf

from tfhybrid.comm import backend

KEYS = ("clipnorm", "global_clipnorm")


def clipper_of(optimizer):
    """``(optimizer whose clipping applies, loss-scale variable or None)``."""
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        return optimizer.inner_optimizer, optimizer.dynamic_scale
    return optimizer, None


def clip_norms(optimizer):
    """``(clipnorm, global_clipnorm)`` of ``optimizer`` (0.0 where unset)."""
    clipper, _ = clipper_of(optimizer)
    return tuple(float(getattr(clipper, k, None) or 0.0) for k in KEYS)


@contextlib.contextmanager
def keras_clipping_off(optimizer):
    """Switch off the norm clipping of ``optimizer`` (or the optimizer a
    LossScaleOptimizer wraps) for the duration; restored afterwards."""
    clipper, _ = clipper_of(optimizer)
    saved = {k: getattr(clipper, k, None) for k in KEYS}
    try:
        for k in KEYS:
            setattr(clipper, k, None)
        yield
    finally:
        for k, v in saved.items():
            setattr(clipper, k, v)


def _squares(grads):
    return [None if g is None else tf.reduce_sum(tf.square(tf.cast(g, tf.float32)))
            for g in grads]


def summed_over(squares, groups, name):
    """Each squared norm summed over its ranks: ``groups[i]`` a ranks tuple
    (one grouped allreduce per distinct tuple, in first-seen order, which
    every rank of that tuple shares) or None (kept)."""
    out = list(squares)
    order = []
    for i, ranks in enumerate(groups):
        if ranks and squares[i] is not None and ranks not in order:
            order.append(ranks)
    for number, ranks in enumerate(order):
        chosen = [i for i, r in enumerate(groups) if r == ranks and squares[i] is not None]
        summed = backend.grouped_allreduce([squares[i] for i in chosen], ranks,
                                           f"{name}.{number}")
        for i, s in zip(chosen, summed):
            out[i] = s
    return out


def global_total_over(ranks, weights, name):
    """``global_total`` for :func:`clip`: every rank of ``ranks`` adds its squared
    norms times ``weights`` (one per gradient: 1 / the number of ranks of
    ``ranks`` holding that same gradient), one scalar allreduce."""
    def total(squares):
        parts = [s * w for s, w in zip(squares, weights) if s is not None]
        local = tf.add_n(parts) if parts else tf.constant(0.0)
        return backend.allreduce(local, tuple(ranks), f"{name}.global")
    return total


def clip(grads, optimizer, per_variable, global_total, name):
    """``grads`` clipped as ``optimizer``'s ``clipnorm``/``global_clipnorm``
    ask, with whole-weight norms.

    Args:
        grads: Gradients (None allowed), reduced.
        optimizer: The optimizer that will apply them (maybe a LossScaleOptimizer).
        per_variable: ``f(squares) -> squares`` of the whole weights (clipnorm).
        global_total: ``f(squares) -> scalar``: the squared global norm
            (``squares`` has None where ``grads`` has).
        name: Base of the collective names.
    """
    clipnorm, global_clipnorm = clip_norms(optimizer)
    _, scale = clipper_of(optimizer)
    squares = _squares(grads)

    def norm(square):
        positive = square > 0
        n = tf.where(positive, tf.sqrt(tf.where(positive, square, tf.ones_like(square))),
                     square)
        return n if scale is None else n / tf.cast(scale, n.dtype)

    if clipnorm > 0:
        totals = per_variable(squares)
        out = []
        for g, total in zip(grads, totals):
            if g is None:
                out.append(g)
                continue
            c = tf.constant(clipnorm, tf.float32)
            factor = c / tf.maximum(norm(total), c)
            out.append(g * tf.cast(factor, g.dtype))
        return out
    if global_clipnorm > 0:
        total = norm(global_total(squares))
        c = tf.constant(global_clipnorm, tf.float32)
        factor = c * tf.minimum(1.0 / total, 1.0 / c) + (total - total)
        return [None if g is None else g * tf.cast(factor, g.dtype) for g in grads]
    return list(grads)


def apply_whole(optimizer, grads, variables, ranks, holders, name):
    """``optimizer.apply`` on a rank whose weights are whole but whose model is
    spread over ``ranks`` (a pipeline's stages, ``ls``'s CONV and FC workers):
    ``clipnorm`` is Keras' own; a ``global_clipnorm`` takes the norm over every
    rank's part: one scalar allreduce over ``ranks`` of this rank's squared
    norm / ``holders`` (the ranks of ``ranks`` holding the same gradients).
    Every rank of ``ranks`` must call it, with or without variables."""
    if not clip_norms(optimizer)[1]:
        if variables:
            optimizer.apply(grads, variables)
        return

    global_total = global_total_over(ranks, [1.0 / holders] * len(variables), name)
    if not variables:   # joins the norm's allreduce only
        global_total([])
        return
    grads = clip(grads, optimizer, None, global_total, name)
    with keras_clipping_off(optimizer):
        optimizer.apply(grads, variables)
