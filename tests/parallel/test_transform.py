"""tfhybrid.transform on hand-built CNNs: every strategy trains exactly like
single-process training of the unmodified model.

Run under ``horovodrun -np 2`` and ``-np 4``. Every rank trains the reference
itself (the original model, plain SGD, the global batches, one process); the
transformed model is fed ``tfhybrid.data.shard(batches, model=transformed)``
and compiled with ``tfhybrid.DistributedOptimizer``. After STEPS steps of
``fit`` the gathered weights must agree to rtol 1e-4 (float32). Also: fit /
evaluate / predict, gather -> save -> plain-Keras load -> transform on another
grid and resume, describe's memory accounting, dropout seeds.
"""
import os

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfhybrid
from tfhybrid.comm import backend
from tfhybrid.compose import transform
from tfhybrid.transformer import describe, gather

from conftest import job_dir, randn, reference_once, rng, world_size

STEPS, BATCH, LR = 2, 8, 0.1
N = world_size()
LOSS = "sparse_categorical_crossentropy"


def cnn(seed=0):
    """Conv -> BN -> pool -> conv -> flatten -> dense x3 (BN, pairs, softmax)."""
    keras.utils.set_random_seed(seed)
    i = keras.Input((8, 8, 3))
    x = keras.layers.Conv2D(8, 3, padding="same", activation="relu", name="conv1")(i)
    x = keras.layers.BatchNormalization(name="bn1")(x)
    x = keras.layers.MaxPooling2D(name="pool1")(x)
    x = keras.layers.Conv2D(8, 3, padding="same", name="conv2")(x)
    x = keras.layers.ReLU(name="relu2")(x)
    x = keras.layers.Flatten(name="flat")(x)
    x = keras.layers.Dense(16, activation="relu", name="fc1")(x)
    x = keras.layers.Dense(8, activation="relu", name="fc2")(x)
    x = keras.layers.Dense(4, activation="softmax", name="out")(x)
    return keras.Model(i, x, name="cnn")


def resnet(seed=0):
    """A residual block with BN and Add, global pooling, Sequential-free."""
    keras.utils.set_random_seed(seed)
    i = keras.Input((8, 8, 3))
    x = keras.layers.Conv2D(8, 3, padding="same", name="stem")(i)
    x = keras.layers.BatchNormalization(name="stem_bn")(x)
    x = keras.layers.ReLU(name="stem_relu")(x)
    y = keras.layers.Conv2D(8, 3, padding="same", name="b_conv1")(x)
    y = keras.layers.BatchNormalization(name="b_bn1")(y)
    y = keras.layers.ReLU(name="b_relu")(y)
    y = keras.layers.Conv2D(8, 3, padding="same", name="b_conv2")(y)
    y = keras.layers.Add(name="add")([x, y])
    y = keras.layers.ReLU(name="out_relu")(y)
    y = keras.layers.GlobalAveragePooling2D(name="gap")(y)
    y = keras.layers.Dense(4, activation="softmax", name="out")(y)
    return keras.Model(i, y, name="resnet")


def sequential(seed=0):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((8, 8, 3)), keras.layers.Flatten(),
                             keras.layers.Dense(16, activation="tanh", name="a"),
                             keras.layers.Dense(8, activation="tanh", name="b"),
                             keras.layers.Dense(4, activation="softmax", name="c")])


MODELS = {"cnn": cnn, "resnet": resnet, "sequential": sequential}


def data(steps=STEPS, batch=BATCH, key="data"):
    x = randn((steps * batch, 8, 8, 3), key, "x")
    y = rng(key, "y").integers(0, 4, size=steps * batch).astype(np.int32)
    return x, y


def dataset(x, y, batch=BATCH):
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(batch, drop_remainder=True)


_REFS = {}


def reference(name, x, y, seed=0):
    """Single-process fit of the unmodified model (memoised per configuration)."""
    key = (name, x.tobytes(), seed)
    if key not in _REFS:
        def compute():
            model = MODELS[name](seed)
            model.compile(optimizer=keras.optimizers.SGD(LR), loss=LOSS, jit_compile=False)
            model.fit(dataset(x, y), epochs=1, shuffle=False, verbose=0)
            return model.get_weights()
        _REFS[key] = reference_once(compute, name, x, y, seed, LR, BATCH)   # rank 0 computes
    return _REFS[key]


def train(pmodel, x, y):
    pmodel.compile(optimizer=tfhybrid.DistributedOptimizer(keras.optimizers.SGD(LR)),
                   loss=LOSS, jit_compile=False)
    pmodel.fit(tfhybrid.data.shard(dataset(x, y), model=pmodel), epochs=1, shuffle=False,
               verbose=0)
    return pmodel


def barrier():
    """Every rank waits for the others (an all-reduce of one number over the world)."""
    backend.allreduce(tf.zeros(1), tuple(range(N)), "test_transform.barrier")


def assert_weights_close(actual, expected, initial, rtol=1e-4, atol=1e-6):
    assert len(actual) == len(expected)
    moved = max(float(np.max(np.abs(e - i))) for e, i in zip(expected, initial))
    assert moved > 1e-3, "the reference did not train: the comparison would be vacuous"
    for i, (a, e) in enumerate(zip(actual, expected)):
        np.testing.assert_allclose(a, e, rtol=rtol, atol=atol, err_msg=f"weight {i}")


# (strategy, model_parallel ("N": world), options); f/c/s use every rank.
CASES = [
    ("d", 1, {}), ("d", 2, {}),
    ("f", "N", {"fallback": "replicate"}), ("c", "N", {"fallback": "replicate"}),
    ("s", "N", {}), ("df", 2, {"fallback": "replicate"}), ("ds", 2, {}),
    ("gmp", 2, {"ccr_threshold": 0, "fallback": "replicate"}),
    ("gmp", "N", {"ccr_threshold": 0, "fallback": "replicate"}),
]


def _mp(value):
    return N if value == "N" else value


# The residual model (BN, Add, global pooling) under the strategies that treat
# them differently: rows (d), spatial (s), filter (df), gmp.
RESIDUAL_CASES = [c for c in CASES if (c[0], c[1]) in {("d", 2), ("s", "N"), ("df", 2),
                                                       ("gmp", 2)}]


@pytest.mark.parametrize("name,strategy,mp,options",
                         [("cnn",) + c for c in CASES] + [("resnet",) + c for c in RESIDUAL_CASES],
                         ids=[f"cnn-{s}-mp{m}" for s, m, _ in CASES]
                         + [f"resnet-{s}-mp{m}" for s, m, _ in RESIDUAL_CASES])
def test_fit_equals_single_process(grid_of, name, strategy, mp, options):
    grid_of(_mp(mp))
    check_fit_equals_single_process(name, strategy, options)


def check_fit_equals_single_process(name, strategy, options):
    """``fit`` of ``MODELS[name]`` transformed under ``strategy`` on the current
    grid: the gathered weights equal the single-process reference, and the
    original model is left untouched."""
    x, y = data()
    expected = reference(name, x, y)
    original = MODELS[name]()
    initial = original.get_weights()
    pmodel = train(transform(original, strategy, **options), x, y)
    assert_weights_close(gather(pmodel).get_weights(), expected, initial)
    assert all(np.array_equal(a, b) for a, b in zip(original.get_weights(), initial))


@pytest.mark.parametrize("strategy,mp", [("f", "N"), ("gmp", 2)])
def test_sequential_model(grid_of, strategy, mp):
    grid_of(_mp(mp))
    x, y = data()
    expected = reference("sequential", x, y)
    original = sequential()
    initial = original.get_weights()
    pmodel = train(transform(original, strategy, ccr_threshold=0) if strategy == "gmp"
                   else transform(original, strategy), x, y)
    full = gather(pmodel)
    assert isinstance(full, keras.Sequential)
    assert_weights_close(full.get_weights(), expected, initial)


@pytest.mark.parametrize("strategy,mp", [("df", 2), ("gmp", 2), ("s", "N")])
def test_evaluate_and_predict_match_the_original(grid_of, strategy, mp):
    grid = grid_of(_mp(mp))
    x, y = data(steps=1)
    original = cnn()
    opts = {"ccr_threshold": 0} if strategy == "gmp" else {}
    pmodel = transform(original, strategy, fallback="replicate", **opts) \
        if strategy != "s" else transform(original, strategy)
    pmodel.compile(optimizer=tfhybrid.DistributedOptimizer(keras.optimizers.SGD(LR)),
                   loss=LOSS, jit_compile=False)
    blocks, index = tfhybrid.data.batch_split(pmodel)
    rows = slice(index * BATCH // blocks, (index + 1) * BATCH // blocks)
    local = tfhybrid.data.shard(dataset(x, y), model=pmodel)
    np.testing.assert_allclose(pmodel.predict(local, verbose=0), original(x[rows]),
                               rtol=1e-5, atol=1e-6)
    original.compile(loss=LOSS, jit_compile=False)
    # evaluate of a transformed model: the loss of the whole global batch, on every rank
    expected = original.evaluate(x, y, batch_size=BATCH, verbose=0)
    assert pmodel.evaluate(local, verbose=0) == pytest.approx(expected, rel=1e-5)
    assert grid.size == N


def test_gather_save_load_without_tfhybrid_and_resume_on_another_grid(grid_of, tmp_path_factory):
    grid_of(2 if N % 2 == 0 else 1)
    x, y = data(steps=2)
    original = cnn()
    initial = original.get_weights()
    expected = reference("cnn", x, y)
    first = train(transform(original, "df"), x[:BATCH], y[:BATCH])
    full = gather(first)
    # The same path on every rank of this job (a per-process id would differ per rank).
    path = os.path.join(job_dir(), "transform_test.keras")
    if tfhybrid.is_root():
        full.save(path)
    barrier()
    loaded = keras.saving.load_model(path)      # registered tfhybrid classes not needed
    assert not any(type(layer).__module__.startswith("tfhybrid") for layer in loaded.layers)
    grid_of(N)                                  # another grid: one model group of N
    resumed = train(transform(loaded, "gmp", ccr_threshold=0, fallback="replicate"),
                    x[BATCH:], y[BATCH:])
    assert_weights_close(gather(resumed).get_weights(), expected, initial)
    barrier()
    if tfhybrid.is_root():
        os.remove(path)


def test_describe_reports_local_shapes_collectives_and_parameter_bytes(grid_of):
    grid_of(N)
    original = cnn()
    pmodel = transform(original, "f")
    text = []
    d = describe(pmodel, batch_size=BATCH, print_fn=text.append)
    rows = {r.name: r for r in d.rows}
    # conv1 filter-parallel: kernel (3,3,3,8/N), bias (8/N,); out (4 units) replicated
    # when N does not divide it.
    assert rows["conv1"].weight_shapes == ((3, 3, 3, 8 // N), (8 // N,))
    assert rows["fc1"].kind == "filter (split out)"
    assert rows["fc2"].kind == "channel (split in)"
    assert ("fwd", "allreduce", "model", BATCH * 8 * 4) in rows["fc2"].collectives
    # conv1 reads the model input: nothing back-propagates into it, no bwd collective
    assert not [c for c in rows["conv1"].collectives if c[0] == "bwd"]
    # one data replica (f over the world): replicated weights (fc2's bias) need no reduction
    assert not [c for r in d.rows for c in r.collectives if c[0] == "grad"]
    analytic = 0
    for layer in original.layers:
        for w in layer.trainable_weights:
            n = int(np.prod(w.shape))
            sliced = rows[layer.name].kind.startswith("filter") or (
                rows[layer.name].kind.startswith("channel") and w.path.endswith("kernel"))
            analytic += 4 * (n // N if sliced else n)
    assert d.param_bytes == analytic
    assert "per-rank parameter bytes" in text[0] and "fc1" in text[0]


def test_dropout_masks_agree_inside_a_model_group(grid_of):
    """Dropout on a replicated tensor: one mask per model group, another per data group."""
    grid = grid_of(2)
    keras.utils.set_random_seed(0)
    i = keras.Input((64,))
    h = keras.layers.Dropout(0.5, name="drop")(i)
    model = keras.Model(i, keras.layers.Dense(8, name="fc")(h))
    pmodel = transform(model, "df")
    masks = keras.Model(pmodel.inputs, pmodel.get_layer("drop").output)
    y = masks(np.ones((4, 64), np.float32), training=True).numpy()
    assert 0 < np.mean(y == 0) < 1
    everyone = backend.allgather(tf.constant(y[None]), tuple(range(N)), "test.dropout").numpy()
    for rank, other in enumerate(everyone):
        same_group = rank // grid.model_size == grid.data_rank
        assert np.array_equal(other, y) == same_group, f"rank {rank}"


def test_transform_rejects_untransformed_models_in_gather_and_describe(grid_of):
    grid_of(1)
    with pytest.raises(ValueError, match=r"not returned by tfhybrid.transform"):
        gather(cnn())
    with pytest.raises(ValueError, match=r"not returned by tfhybrid.transform"):
        describe(cnn())
