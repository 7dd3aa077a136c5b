"""A ZeroPadding folded into the ``valid`` layer after it (``border_padding``).

``tfhybrid.transform`` under ``s``/``ds`` folds a ``ZeroPadding2D/3D`` that only
feeds a ``valid`` Conv2D/3D or pooling layer into that layer
(:func:`tfhybrid.transformer.rules.fold_padding`): the unpadded tensor is split
and the layer adds the zeros at the global border only. ResNet-50's stem
(``ZeroPadding2D(3)`` -> 7x7/2 conv, ``ZeroPadding2D(1)`` -> 3x3/2 max pool)
then splits 4 ways: its padded 230 (or 38) rows do not split over 4 ranks,
the unpadded 224 (32) do; without the fold the whole model would run
replicated.

Run under ``horovodrun -np 2`` and ``-np 4``. Layers: every rank computes the
Keras ZeroPadding + layer on the full, identically seeded input and compares
its own block of the output, of the input gradient and the summed weight
gradients (helpers of test_spatial_conv), eagerly, with overlap and traced.
Models: a ResNet-like stem trained under ``s``/``ds`` equals the unmodified
model trained in one process (spatial_fit).
"""
import keras
import pytest

from tfhybrid.layers import (SpatialAveragePooling2D, SpatialConv2D, SpatialConv3D,
                             SpatialMaxPooling2D, SpatialMaxPooling3D)

from conftest import randn, rng, world_size
from spatial_fit import check_fit_equals_single_process
from test_spatial_conv import check_against, grid_of_split, split_specs, valid_size

N = world_size()

# (name, Keras layer (valid), its spatial class, window, stride, border rows per axis)
LAYERS_2D = [
    ("stem_conv", lambda: keras.layers.Conv2D(4, 7, strides=2), SpatialConv2D, 7, 2,
     ((3, 3), (3, 3))),
    ("asym_conv", lambda: keras.layers.Conv2D(3, 2), SpatialConv2D, 2, 1, ((1, 0), (0, 1))),
    ("same_conv", lambda: keras.layers.Conv2D(3, 3), SpatialConv2D, 3, 1, ((1, 1), (1, 1))),
    ("stem_pool", lambda: keras.layers.MaxPooling2D(3, strides=2), SpatialMaxPooling2D, 3, 2,
     ((1, 1), (1, 1))),
    ("avg_pool", lambda: keras.layers.AveragePooling2D(2, strides=1), SpatialAveragePooling2D,
     2, 1, ((0, 1), (1, 0))),
]
LAYERS_3D = [
    ("conv3d", lambda: keras.layers.Conv3D(3, 3), SpatialConv3D, 3, 1, ((1, 1), (2, 0), (0, 2))),
    ("pool3d", lambda: keras.layers.MaxPooling3D(2), SpatialMaxPooling3D, 2, 2,
     ((2, 2), (0, 2), (1, 1))),
]


def _dims(base, grid, window, stride, border):
    """Unpadded global sizes >= base that split over ``grid`` with the padded
    layer's output too (the geometry of the folded layer)."""
    return [valid_size(base, parts, window, stride, rows) for parts, rows in zip(grid, border)]


def _check(ndim, spec, case, modes, grid_of):
    name, make, spatial_cls, window, stride, border = case
    mp, split = spec
    grid_of(mp)
    grid = grid_of_split(split, ndim, mp)
    dims = _dims(16 if ndim == 2 else 8, grid, window, stride, border)
    assert min(dims) > 0, dims
    pad = (keras.layers.ZeroPadding2D if ndim == 2 else keras.layers.ZeroPadding3D)(border)
    layer = make()
    reference = keras.Sequential([keras.Input((*dims, 3)), pad, layer])
    key = ("border", name, spec)
    # the same weights on every rank (Keras' initialisers draw per process)
    layer.set_weights([randn(v.shape, "w", i, *key) for i, v in enumerate(layer.weights)])
    spatial = spatial_cls.from_layer(layer, split=split, border_padding=border)
    # shifted negative: a padded zero must win the max exactly where Keras' does
    x = randn((2, *dims, 3), *key) - (1.0 if "pool" in name else 0.0)
    check_against(reference, spatial, x, grid, modes, key)


@pytest.mark.parametrize("case", LAYERS_2D, ids=[c[0] for c in LAYERS_2D])
@pytest.mark.parametrize("spec", split_specs(2), ids=str)
def test_layer_with_border_padding_equals_zero_padding_then_keras(grid_of, spec, case):
    _check(2, spec, case, ["eager", "overlap", "function"], grid_of)


@pytest.mark.parametrize("case", LAYERS_3D, ids=[c[0] for c in LAYERS_3D])
@pytest.mark.parametrize("spec", split_specs(3), ids=str)
def test_3d_layer_with_border_padding_equals_zero_padding_then_keras(grid_of, spec, case):
    _check(3, spec, case, ["eager", "function"], grid_of)


def test_border_padding_is_checked_and_kept_in_the_config():
    conv = SpatialConv2D(4, 3, split="height", border_padding=((1, 0), (0, 1)))
    assert conv.get_config()["border_padding"] == [[1, 0], [0, 1]]
    again = SpatialConv2D.from_config(conv.get_config())
    assert again.border_padding == ((1, 0), (0, 1))
    with pytest.raises(ValueError, match=r"border_padding needs padding='valid'"):
        SpatialConv2D(4, 3, padding="same", split="height", border_padding=((1, 1), (1, 1)))
    with pytest.raises(ValueError, match=r"expected 2 pairs \(before, after\)"):
        SpatialMaxPooling2D(2, split="height", border_padding=((1, 1),))


# -- transform: ResNet's stem -----------------------------------------------------------------

STEPS, BATCH, SIZE, CLASSES = 2, 4, 16, 3


def stem(seed=0):
    """ResNet-50's stem (ZeroPadding2D(3) -> 7x7/2 conv -> BN -> ReLU -> ZeroPadding2D(1)
    -> 3x3/2 max pool), a 3x3 conv and a pooled Dense head."""
    keras.utils.set_random_seed(seed)
    i = keras.Input((SIZE, SIZE, 3))
    x = keras.layers.ZeroPadding2D(3, name="conv1_pad")(i)
    x = keras.layers.Conv2D(4, 7, strides=2, name="conv1_conv")(x)
    x = keras.layers.BatchNormalization(name="conv1_bn")(x)
    x = keras.layers.ReLU(name="conv1_relu")(x)
    x = keras.layers.ZeroPadding2D(1, name="pool1_pad")(x)
    x = keras.layers.MaxPooling2D(3, strides=2, name="pool1_pool")(x)
    x = keras.layers.Conv2D(4, 3, padding="same", activation="relu", name="conv2")(x)
    x = keras.layers.GlobalAveragePooling2D(name="gap")(x)
    return keras.Model(i, keras.layers.Dense(CLASSES, activation="softmax", name="out")(x),
                       name="stem")


def data():
    x = randn((STEPS * BATCH, SIZE, SIZE, 3), "stem", "x")
    y = rng("stem", "y").integers(0, CLASSES, size=STEPS * BATCH).astype("int32")
    return x, y


# -np 4: 4 ranks along height (the padded 22 and 10 rows do not split over 4: the fold
# is what makes the stem spatial); -np 2: s and ds.
CASES = {2: [("s", 2, {}), ("ds", 1, {})], 4: [("s", 4, {}), ("ds", 2, {"spatial": "width"})]
         }.get(N, [])


@pytest.mark.parametrize("strategy,mp,options", CASES,
                         ids=[f"{s}-mp{m}-{o.get('spatial', 'height')}" for s, m, o in CASES])
def test_resnet_stem_fit_equals_single_process(grid_of, strategy, mp, options):
    grid_of(mp)
    check_fit_equals_single_process(stem, *data(), BATCH, strategy, options,
                                    {"conv1_conv": SpatialConv2D,
                                     "pool1_pool": SpatialMaxPooling2D,
                                     "conv1_pad": keras.layers.Identity})
