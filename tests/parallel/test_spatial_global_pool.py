"""Global average and max pooling of spatial blocks (no gather) against Keras on the
whole input.

Run under ``horovodrun -np 2`` and ``-np 4``. Layer tests: SpatialScatter then
SpatialGlobal{Average,Max}Pooling2D/3D against ``keras.layers.Global*Pooling*``
on the full tensor (outputs and the full input's gradient, keepdims, a graph;
maxima tied across blocks). Model tests: a CosmoFlow-like 3-D regression CNN
and 2-D classifiers whose spatial region ends in a global pooling, under ``s``
and ``ds``: the plan has no SpatialGather, describe lists the pooling's small
collectives, and the gathered weights after ``fit`` equal single-process
training of the unmodified model (rtol 1e-4).
"""
import keras
import numpy as np
import pytest
import tensorflow as tf

import tfhybrid
from tfhybrid.layers import (SpatialGlobalAveragePooling2D, SpatialGlobalAveragePooling3D,
                             SpatialGlobalMaxPooling2D, SpatialGlobalMaxPooling3D,
                             SpatialScatter)
from tfhybrid.compose import transform
from tfhybrid.transformer import describe, gather

from conftest import randn, reference_once, world_size
from test_primitives import run as value_and_gradient
from test_spatial_conv import split_specs

N = world_size()
FWD = dict(rtol=1e-5, atol=1e-6)
POOLS = {(2, "average"): (keras.layers.GlobalAveragePooling2D, SpatialGlobalAveragePooling2D),
         (3, "average"): (keras.layers.GlobalAveragePooling3D, SpatialGlobalAveragePooling3D),
         (2, "max"): (keras.layers.GlobalMaxPooling2D, SpatialGlobalMaxPooling2D),
         (3, "max"): (keras.layers.GlobalMaxPooling3D, SpatialGlobalMaxPooling3D)}
SPATIAL_POOLS = tuple(cls for _, cls in POOLS.values())


@pytest.mark.parametrize("mode", ["eager", "function"])
@pytest.mark.parametrize("keepdims", [False, True])
@pytest.mark.parametrize("kind", ["average", "max"])
@pytest.mark.parametrize("ndim", [2, 3])
def test_global_pooling_of_blocks_matches_keras(grid_of, ndim, kind, keepdims, mode):
    for mp, split in split_specs(ndim):
        grid_of(mp)
        keras_cls, spatial_cls = POOLS[ndim, kind]
        dims = (8, 12) if ndim == 2 else (8, 4, 6)
        x = randn((3, *dims, 5), "gap.x", ndim, mp, str(split))
        if kind == "max":        # ties across blocks: the gradient splits over all of them
            x[0, ..., 0] = 2.0
            x[1, ..., 1] = np.where(np.arange(dims[-1]) % 3 == 0, 5.0, -1.0)
        reference = keras_cls(keepdims=keepdims)
        u = randn(tuple(reference.compute_output_shape(x.shape)), "gap.u", ndim, keepdims)
        y_ref, dx_ref = value_and_gradient(reference, x, u, "eager")
        scatter, pool = SpatialScatter(split=split), spatial_cls(keepdims=keepdims)
        y, dx = value_and_gradient(lambda t: pool(scatter(t)), x, u, mode)
        np.testing.assert_allclose(y, y_ref, **FWD, err_msg=str(split))
        np.testing.assert_allclose(dx, dx_ref, **FWD, err_msg=str(split))


@pytest.mark.parametrize("cls", [SpatialGlobalAveragePooling2D, SpatialGlobalMaxPooling2D])
def test_global_pooling_refuses_channels_first(cls):
    with pytest.raises(ValueError, match="channels-last blocks.*data_format='channels_first'"):
        cls(data_format="channels_first")


@pytest.mark.parametrize("kind", ["average", "max"])
def test_global_pooling_round_trips_its_config(kind):
    keras_cls, cls = POOLS[3, kind]
    layer = cls(keepdims=True, group="model", name="gap")
    again = cls.from_config(layer.get_config())
    assert again.keepdims and again.group == "model" and again.name == "gap"
    plain = again.to_layer()
    assert type(plain) is keras_cls and plain.keepdims


# -- models whose spatial region ends in GlobalAveragePooling ---------------------------

STEPS, BATCH, LR = 2, 4, 0.05


def cosmoflow_gap(seed=0):
    """Conv3D -> BN -> ReLU -> MaxPooling3D -> Conv3D -> GlobalAveragePooling3D ->
    Dense (3 linear targets), on 8x8x8x2 volumes."""
    keras.utils.set_random_seed(seed)
    i = keras.Input((8, 8, 8, 2))
    x = keras.layers.Conv3D(6, 3, padding="same", name="conv1")(i)
    x = keras.layers.BatchNormalization(name="bn")(x)
    x = keras.layers.ReLU(name="relu")(x)
    x = keras.layers.MaxPooling3D(2, name="pool")(x)
    x = keras.layers.Conv3D(8, 3, padding="same", activation="relu", name="conv2")(x)
    x = keras.layers.GlobalAveragePooling3D(name="gap")(x)
    return keras.Model(i, keras.layers.Dense(3, name="out")(x), name="cosmoflow_gap")


def classifier_gap(seed=0, pool=keras.layers.GlobalAveragePooling2D):
    """Conv2D -> Conv2D (stride 2) -> global pooling -> Dense softmax, 8x12x3."""
    keras.utils.set_random_seed(seed)
    i = keras.Input((8, 12, 3))
    x = keras.layers.Conv2D(6, 3, padding="same", activation="relu", name="conv1")(i)
    x = keras.layers.Conv2D(8, 3, strides=2, padding="same", activation="relu", name="conv2")(x)
    x = pool(name="gap")(x)
    return keras.Model(i, keras.layers.Dense(4, activation="softmax", name="out")(x))


def classifier_gmp(seed=0):
    """classifier_gap with GlobalMaxPooling2D."""
    return classifier_gap(seed, keras.layers.GlobalMaxPooling2D)


MODELS = {"cosmoflow": (cosmoflow_gap, (8, 8, 8, 2), "mse", (3,)),
          "classifier": (classifier_gap, (8, 12, 3), "sparse_categorical_crossentropy", ()),
          "classifier_max": (classifier_gmp, (8, 12, 3), "sparse_categorical_crossentropy", ())}


def _data(name):
    _, shape, _, target = MODELS[name]
    x = randn((STEPS * BATCH, *shape), "gapfit.x", name)
    if target:
        return x, randn((STEPS * BATCH, *target), "gapfit.y", name)
    return x, (np.arange(STEPS * BATCH) % 4).astype(np.int64)


def _fit(model, loss, x, y):
    model.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH), epochs=1,
              shuffle=False, verbose=0)


def _reference(name):
    build, _, loss, _ = MODELS[name]
    x, y = _data(name)

    def compute():
        model = build()
        model.compile(optimizer=keras.optimizers.SGD(LR), loss=loss, jit_compile=False)
        _fit(model, loss, x, y)
        return model.get_weights()
    return reference_once(compute, name, x, y, LR)


# (model, strategy, model_parallel, options)
CASES = {2: [("cosmoflow", "s", 2, {}), ("classifier", "s", 2, {"spatial": "width"}),
             ("classifier_max", "s", 2, {})],
         4: [("cosmoflow", "s", 4, {"spatial": (2, 2, 1)}), ("cosmoflow", "ds", 2, {}),
             ("classifier", "s", 4, {"spatial": (2, 2)}),
             ("classifier", "ds", 2, {"spatial": "height"}),
             ("classifier_max", "s", 4, {"spatial": (2, 2)}),
             ("classifier_max", "ds", 2, {"spatial": "width"})]}.get(N, [])


@pytest.mark.parametrize("name,strategy,mp,options", CASES,
                         ids=[f"{n}-{s}-mp{m}" for n, s, m, _ in CASES])
def test_fit_through_global_pooling_equals_single_process(grid_of, name, strategy, mp,
                                                                  options):
    grid_of(mp)
    build, _, loss, _ = MODELS[name]
    x, y = _data(name)
    expected = _reference(name)
    original = build()
    initial = original.get_weights()
    pmodel = transform(original, strategy, **options)
    assert isinstance(pmodel.get_layer("gap"), SPATIAL_POOLS)
    assert not [layer.name for layer in pmodel.layers if "gather" in layer.name]
    rows = describe(pmodel, batch_size=BATCH, print_fn=lambda *_: None).rows
    gap = next(r for r in rows if r.name == "gap")
    local = BATCH // tfhybrid.grid().data_size
    if name == "classifier_max":     # the maxima; backward, their tie counts
        assert tuple(gap.collectives) == (("fwd", "allgather", "model", local * 8 * 4),
                                          ("bwd", "allreduce", "model", local * 8 * 4))
    else:                            # the sums and the block's voxel count
        assert tuple(gap.collectives) == (("fwd", "allreduce", "model", local * (8 + 1) * 4),)
    pmodel.compile(optimizer=tfhybrid.DistributedOptimizer(keras.optimizers.SGD(LR)),
                   loss=loss, jit_compile=False)
    blocks, index = tfhybrid.data.batch_split(pmodel)
    part = slice(index * BATCH // blocks, (index + 1) * BATCH // blocks)
    np.testing.assert_allclose(pmodel.predict(x[part], batch_size=BATCH, verbose=0),
                               original(x[part]), rtol=1e-5, atol=1e-6)
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH)
    pmodel.fit(tfhybrid.data.shard(data, model=pmodel), epochs=1, shuffle=False, verbose=0)
    actual = gather(pmodel)
    moved = max(float(np.max(np.abs(e - i))) for e, i in zip(expected, initial))
    assert moved > 1e-3, "the reference did not train: the comparison would be vacuous"
    for i, (a, e) in enumerate(zip(actual.get_weights(), expected)):
        np.testing.assert_allclose(a, e, rtol=1e-4, atol=1e-6, err_msg=f"weight {i}")
