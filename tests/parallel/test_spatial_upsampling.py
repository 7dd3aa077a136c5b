"""Bilinear UpSampling2D on spatial blocks (SpatialUpSampling2D) against Keras.

Run under ``horovodrun -np 2`` and ``-np 4``. Before it, a bilinear
``UpSampling2D`` ended the spatial region of ``s``/``ds``: a U-Net decoder
ran replicated at full resolution from there on. Each case: outputs and input
gradients block by block (eager and traced) for factors 2, 3 and (2, 3), on
height, width and 2x2 splits; a U-Net with bilinear up-sampling whose whole
decoder runs on blocks trains equal to one process (gathered weights,
History, ``predict``), and the other interpolations still gather.
"""
import keras
import numpy as np
import pytest

import tfhybrid
from tfhybrid.layers import SpatialUpSampling2D

from conftest import randn, world_size
from spatial_fit import fit_like_one_process
from test_spatial_conv import check_against, grid_of_split, split_specs

L = keras.layers


@pytest.mark.parametrize("size", [2, 3, (2, 3)], ids=str)
@pytest.mark.parametrize("spec", split_specs(2), ids=str)
def test_bilinear_upsampling_matches_keras(grid_of, spec, size):
    mp, split = spec
    grid_of(mp)
    grid = grid_of_split(split, 2, mp)
    x = randn((2, 2 * grid[0] if grid[0] > 1 else 5, 3 * grid[1] if grid[1] > 1 else 5, 3),
              "x", spec, size)
    reference = L.UpSampling2D(size, interpolation="bilinear")
    spatial = SpatialUpSampling2D(size, interpolation="bilinear", split=split)
    check_against(reference, spatial, x, grid, ["eager", "function"], (spec, size))


@pytest.mark.parametrize("spec", split_specs(2), ids=str)
def test_one_row_blocks(grid_of, spec):
    """Blocks of one row: each output row reads both neighbours' rows."""
    mp, split = spec
    grid_of(mp)
    grid = grid_of_split(split, 2, mp)
    x = randn((1, grid[0], grid[1], 2), "one", spec)
    check_against(L.UpSampling2D(2, interpolation="bilinear"),
                  SpatialUpSampling2D(2, split=split), x, grid, ["function"], ("one", spec))


def test_other_interpolations_are_refused():
    with pytest.raises(ValueError, match="interpolation='bicubic'.*bilinear"):
        SpatialUpSampling2D(2, interpolation="bicubic")
    layer = SpatialUpSampling2D.from_layer(L.UpSampling2D(3, interpolation="bilinear"),
                                           split="width")
    assert (layer.size, layer.interpolation, layer.split) == ((3, 3), "bilinear", "width")
    assert isinstance(layer.to_layer(), L.UpSampling2D)


def _unet(interpolation="bilinear"):
    keras.utils.set_random_seed(3)
    i = keras.Input((16, 16, 2))
    e0 = L.Conv2D(4, 3, padding="same", activation="relu", name="e0")(i)
    e1 = L.Conv2D(6, 3, padding="same", activation="relu", name="e1")(L.MaxPooling2D(2)(e0))
    m = L.Conv2D(8, 3, padding="same", activation="relu", name="mid")(L.MaxPooling2D(2)(e1))
    x = L.UpSampling2D(2, interpolation=interpolation, name="up1")(m)
    x = L.Conv2D(6, 3, padding="same", activation="relu", name="d1")(L.Concatenate()([e1, x]))
    x = L.UpSampling2D(2, interpolation=interpolation, name="up0")(x)
    x = L.Conv2D(4, 3, padding="same", activation="relu", name="d0")(L.Add()([e0, L.Conv2D(
        4, 1, name="proj")(x)]))
    return keras.Model(i, L.Conv2D(3, 1, activation="softmax", name="head")(x))


def _cases():
    if world_size() == 2:
        return [("s", 2, "height"), ("s", 2, "width")]
    return [("s", 4, (2, 2)), ("s", 4, "height"), ("ds", 2, "width")]


@pytest.mark.parametrize("strategy, mp, spatial", _cases(), ids=str)
def test_bilinear_unet_trains_on_blocks(strategy, mp, spatial):
    tfhybrid.shutdown()
    tfhybrid.init(model_parallel=mp)
    r = np.random.default_rng(5)
    x = r.standard_normal((8, 16, 16, 2)).astype(np.float32)
    y = r.integers(0, 3, (8, 16, 16)).astype(np.int32)
    model = tfhybrid.transform(_unet(), strategy, spatial=spatial)
    for name in ("up1", "up0"):
        assert isinstance(model.get_layer(name), SpatialUpSampling2D)
    assert model._tfhybrid_split_outputs == (True,)      # no layer at full resolution
    want = fit_like_one_process(model, _unet, x, y, lr=0.5, epochs=3,
                                predict=x[:4])
    np.testing.assert_allclose(model.predict(x[:4], verbose=0), want, rtol=1e-4, atol=1e-5)
    tfhybrid.shutdown()


def test_bicubic_still_gathers():
    tfhybrid.shutdown()
    tfhybrid.init(model_parallel=world_size())
    model = tfhybrid.transform(_unet("bicubic"), "s", fallback="replicate")
    assert type(model.get_layer("up1")) is L.UpSampling2D
    assert not any(getattr(model, "_tfhybrid_split_outputs", ()))
    tfhybrid.shutdown()
