"""Cropping under spatial parallelism: SpatialCropping2D/3D (and
SpatialZeroPadding3D, the same re-blocking with rows added) against the Keras
layers, and tfhybrid.transform of a U-Net-like CNN with a Cropping2D under
``s`` and ``ds`` trained exactly like the single-process original.

Run under ``horovodrun -np 2`` and ``-np 4``. Layers: every rank computes
keras.layers.Cropping2D/3D on the full, identically seeded input and compares
its own block of the output and of the input gradient (float32: rtol 1e-5
forward, 1e-4 gradients), eagerly and, for the re-blocking crops, traced.
Model: the reference is ``fit`` of the unmodified model on the global
batches in one process (rank 0 computes it: spatial_fit.reference); the transformed model is
fed ``tfhybrid.data.shard`` and compiled with ``tfhybrid.DistributedOptimizer``;
after STEPS steps the gathered weights must agree (rtol 1e-4, atol 1e-6), and
its predictions the original's.
"""
import keras
import numpy as np
import pytest

from tfhybrid.layers import SpatialCropping2D, SpatialCropping3D, SpatialZeroPadding3D

from conftest import randn, rng, world_size
from spatial_fit import check_fit_equals_single_process
from test_spatial_conv import GRAD, check_against, grid_of_split, split_specs, valid_size

N = world_size()
STEPS, BATCH, SIZE, CLASSES = 2, 8, 20, 3
CROP = ((3, 1), (1, 3))


# -- the layers against Keras --------------------------------------------------------------

CROPS_2D = [((3, 1), (1, 3)), ((2, 2), (0, 0)), ((0, 4), (2, 2))]
# Traced as well for the crop that moves rows between neighbours on every grid (time).
CROP_CASES = [(c, m) for c in CROPS_2D for m in ("eager", "function")
              if m == "eager" or c == CROPS_2D[0]]


def _sizes(base, grid, border, sign=-1):
    """Global sizes >= base that split over ``grid`` before and after adding
    ``sign`` x ``border`` rows per axis (cropping: -1, padding: +1)."""
    return [valid_size(base, grid[d], 1, 1, (sign * lo, sign * hi))
            for d, (lo, hi) in enumerate(border)]


@pytest.mark.parametrize("cropping,mode", CROP_CASES, ids=str)
@pytest.mark.parametrize("spec", split_specs(2), ids=str)
def test_spatial_cropping2d_matches_keras(grid_of, spec, cropping, mode):
    mp, split = spec
    grid_of(mp)
    grid = grid_of_split(split, 2, mp)
    dims = _sizes(12, grid, cropping)
    assert min(dims) > 0, dims
    x = randn((2, *dims, 3), "crop2d", spec, cropping)
    check_against(keras.layers.Cropping2D(cropping), SpatialCropping2D(cropping, split=split),
                  x, grid, [mode], ("crop2d", spec, cropping))
    assert GRAD["rtol"] == 1e-4


# (name, Keras layer, spatial layer, its border argument, border rows per axis):
# the re-blocking of a volume that loses rows (cropping) or gains them (padding).
BORDERS_3D = [("crop3d", keras.layers.Cropping3D, SpatialCropping3D, "cropping",
               ((1, 3), (2, 0), (1, 1))),
              ("pad3d", keras.layers.ZeroPadding3D, SpatialZeroPadding3D, "padding",
               ((3, 1), (0, 2), (1, 1)))]


@pytest.mark.parametrize("name,keras_cls,spatial_cls,arg,border", BORDERS_3D,
                         ids=[b[0] for b in BORDERS_3D])
@pytest.mark.parametrize("spec", split_specs(3), ids=str)
def test_spatial_border3d_matches_keras(grid_of, spec, name, keras_cls, spatial_cls, arg, border):
    mp, split = spec
    grid_of(mp)
    grid = grid_of_split(split, 3, mp)
    dims = _sizes(8, grid, border, -1 if arg == "cropping" else 1)
    x = randn((1, *dims, 2), name, spec)
    check_against(keras_cls(border), spatial_cls(border, split=split),
                  x, grid, ["eager"], (name, spec))
    again = spatial_cls.from_config(spatial_cls(border, split=split).get_config())
    assert getattr(again, arg) == border and again.split == split


def test_crop_that_does_not_split_names_the_layer_and_the_sizes(grid_of):
    grid_of(2)
    crop = SpatialCropping2D(((1, 0), (0, 0)), split="height", name="c1")
    with pytest.raises(ValueError, match=r"SpatialCropping2D 'c1': the input of global shape "
                                         r"\(None, 8, 4, 1\) cannot be split over the 2x1 grid "
                                         r"along height: cropping \(1, 0\) rows changes its "
                                         r"size 8 to 7, which does not split evenly over 2 "
                                         r"ranks, nor does it for any input size \(the change, "
                                         r"-1 rows, is not a multiple of 2\)\. Change the "
                                         r"cropping along height, the split or the number of "
                                         r"ranks\."):
        crop(keras.Input((4, 4, 1)))
    if N >= 4:    # 8 rows over 4 ranks cropped to 4: rank 0 needs all of rank 1's 2 rows and more
        grid_of(4)
        crop = SpatialCropping2D(((4, 0), (0, 0)), split="height", name="c2")
        with pytest.raises(ValueError, match=r"SpatialCropping2D 'c2': .*\(None, 8, 4, 1\).*the "
                                             r"blocks of 2 rows are smaller than the halo.*"
                                             r"Nearest valid global height sizes: 12"):
            crop(keras.Input((2, 4, 1)))


# -- transform of a U-Net-like CNN ---------------------------------------------------------

def unet_like(seed=0):
    """Encoder conv -> ('valid' 5x5 conv, Cropping2D skip) -> Add -> pool -> conv -> Dense."""
    keras.utils.set_random_seed(seed)
    i = keras.Input((SIZE, SIZE, 3))
    enc = keras.layers.Conv2D(4, 3, padding="same", activation="relu", name="enc")(i)
    main = keras.layers.Conv2D(4, 5, activation="tanh", name="main")(enc)
    skip = keras.layers.Cropping2D(CROP, name="crop")(enc)
    x = keras.layers.Add(name="join")([main, skip])
    x = keras.layers.MaxPooling2D(2, name="pool")(x)
    x = keras.layers.Conv2D(4, 3, padding="same", activation="relu", name="dec")(x)
    x = keras.layers.Flatten(name="flat")(x)
    return keras.Model(i, keras.layers.Dense(CLASSES, activation="softmax", name="out")(x),
                       name="unet_like")


def data():
    x = randn((STEPS * BATCH, SIZE, SIZE, 3), "unet", "x")
    y = rng("unet", "y").integers(0, CLASSES, size=STEPS * BATCH).astype(np.int32)
    return x, y


# (strategy, model_parallel, options): s over every rank, ds with data groups.
CASES = {2: [("s", 2, {}), ("s", 2, {"spatial": "width"}), ("ds", 1, {})],
         4: [("s", 4, {}), ("s", 4, {"spatial": (2, 2)}), ("ds", 2, {"spatial": "width"})]
         }.get(N, [])


@pytest.mark.parametrize("strategy,mp,options", CASES,
                         ids=[f"{s}-mp{m}-{o.get('spatial', 'height')}" for s, m, o in CASES])
def test_unet_like_fit_equals_single_process(grid_of, strategy, mp, options):
    grid_of(mp)
    check_fit_equals_single_process(unet_like, *data(), BATCH, strategy, options,
                                    {"crop": SpatialCropping2D})
