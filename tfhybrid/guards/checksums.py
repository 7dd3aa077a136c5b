"""The guards' error and what ranks compare: structure digests, weight and batch
checksums, input fingerprints (see :mod:`tfhybrid.guards`)."""
from __future__ import annotations

import functools
import hashlib

import numpy as np
import tensorflow as tf

from tfhybrid import runtime

#: Steps checked at the start of every ``fit`` (then every ``guard_every_steps``).
FIRST_STEPS = 2
#: Relative tolerance of the weight checksums (replicas are bitwise equal when exact).
RTOL = 1e-6


class ConsistencyError(RuntimeError):
    """Ranks that must agree (rows fed, replicated weights, model structure) do not."""


# Its public name: tracebacks and pickles say tfhybrid.guards.ConsistencyError, as users catch it.
ConsistencyError.__module__ = "tfhybrid.guards"


def _config():
    return runtime.config_or_default()


def _world_gather(values, name):
    """``values`` (1-D float64) of every rank, stacked: shape (world, n)."""
    from tfhybrid.comm import backend

    grid = runtime.current_grid()
    row = tf.constant(np.asarray(values, np.float64)[None, :])
    return backend.allgather(row, tuple(range(grid.size)), name).numpy()


# -- what is compared ---------------------------------------------------------

def structure_digest(model) -> float:
    """A number identifying the model's layer names/classes and variable paths/shapes."""
    parts = [f"{layer.name}:{type(layer).__name__}" for layer in model.layers]
    parts += [f"{v.path}:{tuple(v.shape)}" for v in model.variables]
    digest = hashlib.sha256("|".join(parts).encode()).digest()
    return float(int.from_bytes(digest[:6], "little"))   # exact in float64


#: Period of the weight checksums' position weights ``1 + (i mod P)/P``.
_POSITION_PERIOD = 97


@functools.lru_cache(maxsize=128)
def _position_weights(size: int) -> np.ndarray:
    return 1.0 + (np.arange(size) % _POSITION_PERIOD) / _POSITION_PERIOD


def weight_checksums(variables) -> np.ndarray:
    """Position-weighted sums of each variable (order and value sensitive).

    The position weights are cached per size: the checks run at the start
    of every ``fit`` and after its first steps, and building the weights is
    most of a call's cost.
    """
    out = []
    for v in variables:
        flat = np.asarray(v.numpy()).ravel()
        out.append(float(np.dot(flat.astype(np.float64, copy=False),
                                _position_weights(flat.size))))
    return np.asarray(out)


def weight_checksums_in_step(variables):
    """:func:`weight_checksums` as traced ops (float64, one per variable): the
    guards' weight check runs inside the training step it follows
    (:func:`gather_step_sums`), with no eager pass over the weights in numpy.
    Same position weights (``1 + (i mod P)/P``, :data:`_POSITION_PERIOD`): the
    variable, zero-padded to a multiple of P, viewed as rows of P times a
    column of the P weights (no weight vector as large as the variable).

    Six graph nodes per variable: tracing them is part of every ``fit``'s
    first step. The earlier slice-the-tail form took 28 and 8-9 s to trace
    for 315 ResNet-like variables, 2-3 s in this form (same sums to 1e-12).
    """
    period = _POSITION_PERIOD
    cols = tf.constant(_position_weights(period)[:, None])
    out = []
    for v in variables:
        size = int(np.prod(v.shape))
        flat = tf.reshape(tf.cast(v, tf.float64), [-1])
        if size % period:
            flat = tf.pad(flat, [[0, period - size % period]])
        out.append(tf.reduce_sum(tf.matmul(tf.reshape(flat, [-1, period]), cols)))
    return tf.stack(out) if out else tf.zeros([0], tf.float64)


def gather_step_sums(model, checksum, due):
    """In ``train_step``, after the update: when ``due`` (a traced bool, set by the
    :class:`GuardCallback` before the steps whose weights it compares), gather
    this step's batch checksum and weight checksums over the world and keep
    them in the model's step-sums variable for the callback to verify. The
    allgather then runs in the traced step, instead of an eager pass over the
    weights in numpy and an eager allgather between two steps. Nothing
    when the variable is missing or sized for other variables (a train
    function traced before ``fit`` made it): the callback then finds it
    unwritten and runs the eager check."""
    sums = getattr(model, "_tfhybrid_step_sums", None)
    variables = model.trainable_variables
    if sums is None or sums.shape[1] != 1 + len(variables):
        return
    from tfhybrid.comm import backend

    world = tuple(range(runtime.current_grid().size))

    def gather():
        values = tf.concat([tf.reshape(checksum.read_value(), [1]),
                            weight_checksums_in_step(variables)], 0)
        sums.assign(backend.allgather(values[None, :], world, "guard.step_sums"))
        return tf.constant(True)

    tf.cond(due, gather, lambda: tf.constant(False))


def step_sums_variable(model):
    """The model's step-sums variable (world x (1 + trainable variables), float64),
    made or remade eagerly at the start of ``fit`` (before Keras traces its
    train function) when missing or sized for other variables."""
    width = 1 + len(model.trainable_variables)
    sums = getattr(model, "_tfhybrid_step_sums", None)
    if sums is None or tuple(sums.shape) != (runtime.current_grid().size, width):
        with tf.init_scope():
            sums = tf.Variable(np.full((runtime.current_grid().size, width), np.nan),
                               trainable=False, name="tfhybrid_step_sums", dtype=tf.float64)
        object.__setattr__(model, "_tfhybrid_step_sums", sums)
    return sums


# batch_checksum's rows up to this many items use one matrix-vector product
# (fewer traced ops: every guarded train step traces it); longer rows use slices
CHECKSUM_SMALL_ROW = 4096


def batch_checksum(data, position=None):
    """A traced float64 checksum of a batch, sensitive to row order and values.

    ``position`` (a traced int, p/ls): this batch is block ``position`` of
    equal blocks that another rank feeds as one batch; its rows are weighted
    as rows ``position x rows ...`` of that batch, so the blocks' checksums
    sum to the joined batch's.

    Each row's sum weighs column ``j`` by ``1 + (j % 7) / 7``. Rows of up to
    :data:`CHECKSUM_SMALL_ROW` items take one float64 matrix-vector product
    (a weight vector TensorFlow folds into a constant: small). Longer rows
    (volumes) are summed as seven strided column slices in float64, one after
    the other: no row-long weight constant kept for the traced step's
    lifetime and no float64 copy of the whole batch, a few sevenths of the
    batch's size at most."""
    total = tf.constant(0.0, tf.float64)
    for t in tf.nest.flatten(data):
        if t is None or not tf.is_tensor(t) or not (t.dtype.is_floating or t.dtype.is_integer
                                                     or t.dtype.is_bool):
            continue
        if t.shape.rank == 0:
            total += tf.cast(t, tf.float64)
            continue
        rows = tf.reshape(t, [tf.shape(t)[0], -1])
        width = rows.shape[1]
        if width is not None and width <= CHECKSUM_SMALL_ROW:
            cols = 1.0 + tf.cast(tf.range(width) % 7, tf.float64) / 7.0
            per_row = tf.linalg.matvec(tf.cast(rows, tf.float64), cols)
        else:
            per_row = tf.zeros([tf.shape(rows)[0]], tf.float64)
            for r in range(7):
                # one slice at a time: the previous float64 copy is freed before the next
                with tf.control_dependencies([per_row] if r else []):
                    part = tf.cast(rows[:, r::7], tf.float64)
                per_row += tf.reduce_sum(part, axis=1) * (1.0 + r / 7.0)
        row_w = 1.0 + tf.cast(tf.range(tf.shape(rows)[0]), tf.float64)
        if position is not None:
            row_w += tf.cast(position * tf.shape(rows)[0], tf.float64)
        total += tf.reduce_sum(per_row * row_w)
    return total


# input_fingerprint hashes an array whole up to this size, else FINGERPRINT_ROWS
# evenly spaced rows of it (BLAKE2b hashes on the order of 1 GB/s, so the whole-array
# bound keeps a fingerprint to tens of milliseconds).
FINGERPRINT_WHOLE_BYTES = 32 * 2**20
FINGERPRINT_ROWS = 1024


def input_fingerprint(*sources) -> float:
    """A cheap digest of in-memory inputs (numpy arrays or eager tensors, nested in
    lists, tuples or dicts): shapes, dtypes and the bytes of each array (whole up
    to ``FINGERPRINT_WHOLE_BYTES``, else ``FINGERPRINT_ROWS`` evenly spaced
    rows), as a float64 holding 48 bits of BLAKE2b. NaN when any source is
    something else (a dataset, a generator, a PyDataset): not known before a step.
    ``None`` sources are skipped.

    Per-rank arrays of different rows differ in (nearly) every row, so the
    sample tells them apart; two large arrays equal in every sampled row but
    not elsewhere would be taken as copies (``fit``'s step-2 batch check then
    corrects it)."""
    flat = [a for a in tf.nest.flatten([s for s in sources if s is not None])
            if a is not None]
    if not flat:
        return float("nan")
    h = hashlib.blake2b(digest_size=6)
    for a in flat:
        if not (isinstance(a, np.ndarray) or (tf.is_tensor(a) and tf.executing_eagerly())):
            return float("nan")
        shape = tuple(int(d) for d in a.shape)
        h.update(f"{shape}|{a.dtype}|".encode())
        nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(a.dtype.name if tf.is_tensor(a)
                                                               else a.dtype).itemsize
        if shape and shape[0] and nbytes <= FINGERPRINT_WHOLE_BYTES:
            h.update(np.ascontiguousarray(a if isinstance(a, np.ndarray) else a.numpy()).tobytes())
        elif shape and shape[0]:
            rows = np.unique(np.linspace(0, shape[0] - 1,
                                         min(shape[0], FINGERPRINT_ROWS)).astype(np.int64))
            sample = a[rows] if isinstance(a, np.ndarray) else tf.gather(a, rows).numpy()
            h.update(np.ascontiguousarray(sample).tobytes())
        elif not shape:
            h.update(np.asarray(a).tobytes())
    return float(int.from_bytes(h.digest(), "little"))
