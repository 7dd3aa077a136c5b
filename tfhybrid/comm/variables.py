"""Eager sums of Keras variables over a group of ranks (metric states, whose
sum over the ranks that fed disjoint rows is the one-process state)."""
from __future__ import annotations

import numpy as np
import tensorflow as tf

from tfhybrid.comm import backend


def sum_variables(variables, ranks, name, contribute=True, copies=1):
    """Replace each variable by its sum over ``ranks`` (collective; float64 sums,
    rounded for integer variables). ``contribute=False``: this rank adds zeros.
    ``copies``: each rank's rows were fed by that many ranks; the sum counts them once."""
    flat = tf.concat([tf.reshape(tf.cast(v.value, tf.float64), [-1]) for v in variables], 0)
    if not contribute:
        flat = tf.zeros_like(flat)
    total = backend.allreduce(flat, ranks, name).numpy()
    if copies > 1:
        total = total / copies
    start = 0
    for v in variables:
        n = int(np.prod(v.shape))
        value = total[start:start + n].reshape(tuple(v.shape))
        if "int" in str(v.dtype):
            value = np.rint(value)
        v.assign(value.astype(str(v.dtype)))
        start += n
