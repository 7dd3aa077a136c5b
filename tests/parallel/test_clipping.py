"""Optimizers with ``clipnorm`` / ``global_clipnorm`` train every strategy exactly.

Run under ``horovodrun -np 2`` and ``-np 4``. A user's ``SGD(clipnorm=...)``
or ``Adam(global_clipnorm=...)`` clips by the norms of whole weights in
single-process training; a rank of f/c/df/gmp holds blocks of some weights
and a rank of p/ls holds some layers only, so Keras' own clipping there
clipped each block by its own norm (f, clipnorm: weights 0.015 off after 4
steps, silently) or left replicated weights drifting apart between ranks
(global_clipnorm). Each case trains 4 steps with norms small enough that
every step clips, and compares the gathered weights with single-process
training of the unmodified model (-np 2: f c gmp p ls s; -np 4: f df ds p ls).
"""
import keras
import numpy as np
import pytest
import tensorflow as tf

import tfhybrid

from conftest import randn, reference_once, rng, world_size

BATCH, STEPS = 8, 4
LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def make_model():
    keras.utils.set_random_seed(3)
    return keras.Sequential([
        keras.Input((8, 8, 3)),
        keras.layers.Conv2D(8, 3, padding="same", activation="relu", name="conv"),
        keras.layers.MaxPooling2D(2, name="pool"),
        keras.layers.Flatten(name="flat"),
        keras.layers.Dense(16, activation="relu", name="fc1"),
        keras.layers.Dense(4, name="fc2"),
    ], name="clip_net")


def data():
    x = randn((BATCH * STEPS, 8, 8, 3), "clip", "x")
    y = rng("clip", "y").integers(0, 4, BATCH * STEPS).astype(np.int32)
    return x, y


def optimizer(kind, clip):
    if kind == "sgd":
        return keras.optimizers.SGD(0.5, momentum=0.5, **clip)
    return keras.optimizers.Adam(0.02, **clip)


_REFERENCES = {}


def reference(kind, clip):
    key = (kind, tuple(sorted(clip.items())))
    if key not in _REFERENCES:
        def compute():
            x, y = data()
            model = make_model()
            model.compile(optimizer(kind, clip), LOSS, jit_compile=False)
            model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)
            return model.get_weights()
        _REFERENCES[key] = reference_once(compute, key)     # rank 0 computes it
    return _REFERENCES[key]


def cases():
    """(strategy, model_parallel, transform options) for this world size."""
    n = world_size()
    if n >= 4:     # the groups -np 2 cannot form (c, gmp, s: same code paths at -np 2)
        return [("f", n, {}), ("df", 2, {}), ("ds", 2, {}), ("p", 2, {}),
                ("ls", 1, {"fc_workers": n // 2})]
    return [("f", n, {}), ("c", n, {"fallback": "replicate"}), ("gmp", 2, {}),
            ("p", 2, {}), ("ls", 1, {"fc_workers": n // 2}), ("s", n, {})]


CLIPS = [{"clipnorm": 0.05}, {"global_clipnorm": 0.05}]


@pytest.mark.parametrize("clip", CLIPS, ids=["clipnorm", "global_clipnorm"])
@pytest.mark.parametrize("strategy,mp,options", cases(), ids=[c[0] for c in cases()])
def test_clipping_matches_single_process(grid_of, strategy, mp, options, clip):
    kind = "adam" if strategy in ("f", "p") else "sgd"
    expected = reference(kind, clip)
    grid_of(mp)
    x, y = data()
    model = tfhybrid.transform(make_model(), strategy, **options)
    model.compile(tfhybrid.DistributedOptimizer(optimizer(kind, clip)), LOSS, jit_compile=False)
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH)
    model.fit(tfhybrid.data.shard(ds, model=model), verbose=0)
    got = tfhybrid.gather(model).get_weights()
    start = make_model().get_weights()
    moved = max(float(np.max(np.abs(e - s))) for e, s in zip(expected, start))
    assert moved > 1e-3, "the reference did not train: the test could not fail"
    for i, (a, e) in enumerate(zip(got, expected)):
        np.testing.assert_allclose(a, e, rtol=1e-5, atol=2e-6, err_msg=f"weight {i}")


def make_dense():
    keras.utils.set_random_seed(5)
    return keras.Sequential([keras.Input((12,)), keras.layers.Dense(16, activation="relu"),
                             keras.layers.Dense(8, activation="relu"), keras.layers.Dense(4)])


def test_clipping_under_loss_scaling(grid_of):
    """mixed_float16 (Keras wraps a LossScaleOptimizer): f's blocks are clipped
    by whole-weight norms of the unscaled gradients (a Dense net: f computes
    each output feature as one process does, so float16 rounds alike)."""
    clip = {"clipnorm": 0.05}
    policy = keras.config.dtype_policy()
    keras.config.set_dtype_policy("mixed_float16")
    try:
        x = randn((BATCH * STEPS, 12), "clip", "dense")
        y = rng("clip", "y").integers(0, 4, BATCH * STEPS).astype(np.int32)
        ref = make_dense()
        ref.compile(optimizer("sgd", clip), LOSS, jit_compile=False)
        ref.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)
        grid_of(world_size())
        model = tfhybrid.transform(make_dense(), "f")
        model.compile(tfhybrid.DistributedOptimizer(optimizer("sgd", clip)), LOSS,
                      jit_compile=False)
        ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH)
        model.fit(tfhybrid.data.shard(ds, model=model), verbose=0)
        got = tfhybrid.gather(model).get_weights()
    finally:
        keras.config.set_dtype_policy(policy)
    for i, (a, e) in enumerate(zip(got, ref.get_weights())):
        np.testing.assert_allclose(a, e, rtol=2e-3, atol=2e-4, err_msg=f"weight {i}")
