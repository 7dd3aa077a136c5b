"""Shared pieces of the "safe" user scripts (not a tfhybrid API).

Every rank computes the single-process reference itself (plain Keras, same
data, same global batches, same initial weights), so a script compares its
distributed result with single-process training without any extra launch.
Every layer is named explicitly and every rank builds the same Keras objects
in the same order, so auto-generated names (which collective names derive
from) agree across ranks.
"""
import json
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import numpy as np
import tensorflow as tf

FEATURES, CLASSES, ROWS = 12, 4, 64


def make_model(seed, name="mlp"):
    """An ordinary Keras MLP whose initial weights depend on ``seed`` only."""
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((FEATURES,), name=f"{name}_in")
    x = keras.layers.Dense(16, activation="relu", name=f"{name}_fc1")(inputs)
    x = keras.layers.Dense(8, activation="relu", name=f"{name}_fc2")(x)
    outputs = keras.layers.Dense(CLASSES, name=f"{name}_out")(x)
    return keras.Model(inputs, outputs, name=name)


def data(seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((ROWS, FEATURES)).astype(np.float32)
    y = rng.integers(0, CLASSES, ROWS).astype(np.int64)
    return x, y


def dataset(x, y, global_batch):
    """Global batches, in order (what every rank reads before sharding)."""
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(global_batch, drop_remainder=True)


def loss():
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def reference_fit(seed, optimizer, x, y, global_batch, epochs, name="mlp"):
    """Single-process training of the unmodified model with ``optimizer``: one
    ``fit`` call per entry of ``epochs`` (the optimizer state carries over).

    Returns the trained plain Keras model.
    """
    model = make_model(seed, name)
    model.compile(optimizer=optimizer, loss=loss())
    for n in epochs:
        model.fit(x, y, batch_size=global_batch, epochs=n, shuffle=False, verbose=0)
    return model


def max_rel(a_list, b_list):
    """Largest |a - b| / max|b| over paired arrays (relative to each array's scale)."""
    worst = 0.0
    for a, b in zip(a_list, b_list):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        assert a.shape == b.shape, (a.shape, b.shape)
        worst = max(worst, float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-12)))
    return worst


def report(**fields):
    """Print one machine-readable line (parsed by tests/integration/userscripts.py)."""
    print("RESULT " + json.dumps(fields, sort_keys=True), flush=True)


def rank0_pretrained_model(seed, name, rank, path):
    """What a user script does: every rank builds the model (here with its own
    random initial weights, like an unseeded script) and rank 0 alone restores
    pretrained weights (those of ``make_model(seed)``) from ``path``."""
    if rank == 0:
        make_model(seed, name).save_weights(path)
    model = make_model(1000 + 17 * rank + seed, name)
    if rank == 0:
        model.load_weights(path)
    return model


def slot_blocks_max_rel(local_optimizer, ref_optimizer, model_rank):
    """Largest relative difference between this rank's optimizer slots and the
    reference's, matched by Keras' slot names (``<variable path>_<slot>``); a
    slot of a sharded weight is compared with the matching block of the
    reference slot (contiguous blocks along the axis whose size differs).

    Returns ``(max_rel, number of slots compared)``.
    """
    ref = {v.name: v.numpy() for v in ref_optimizer.variables if v.shape.rank}
    worst, count = 0.0, 0
    for var in local_optimizer.variables:
        if var.name not in ref:
            continue
        mine, full = var.numpy(), ref[var.name]
        for axis, (a, b) in enumerate(zip(mine.shape, full.shape)):
            if a != b:
                full = np.split(full, b // a, axis=axis)[model_rank]
        worst = max(worst, max_rel([mine], [full]))
        count += 1
    return worst, count
