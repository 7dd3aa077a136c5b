"""s/ds: a spatial region that ends before the model's last convolutions is
reported (rank 0, a UserWarning naming the layer, the reason and the grids
that go further), since those convolutions then run replicated on the whole
volume on every rank; a region that ends at a classifier's Flatten, and
feasibility checks (auto, plan), say nothing."""
import warnings

import keras
import pytest

from tfhybrid.process_grid import ProcessGrid
from tfhybrid.transformer.feasibility import refusal
from tfhybrid.transformer.graph import as_functional, describe_graph
from tfhybrid.transformer.options import make_options
from tfhybrid.transformer.planner import make_plan

L = keras.layers


def _unet(size=12):
    inp = keras.Input((size, size, size, 1))
    a = L.Conv3D(4, 3, padding="same", name="enc")(inp)
    b = L.MaxPooling3D(2, name="pool")(a)
    b = L.Conv3D(4, 3, padding="same", name="mid")(b)
    b = L.UpSampling3D(2, name="up")(b)
    x = L.Concatenate(name="cat")([a, b])
    return keras.Model(inp, L.Conv3D(2, 1, name="head")(x))


def _classifier():
    inp = keras.Input((8, 8, 2))
    x = L.Conv2D(4, 3, padding="same", name="c0")(inp)
    x = L.Flatten(name="flat")(x)
    return keras.Model(inp, L.Dense(3, name="fc")(x))


def _plan(model, size, **options):
    graph = describe_graph(as_functional(model))
    return make_plan(graph, make_options("s", **options), ProcessGrid(size, 0, size))


def test_a_region_ending_before_the_decoder_is_reported():
    with pytest.warns(UserWarning) as caught:
        plan = _plan(_unet(), 4)
    text = " ".join(str(w.message) for w in caught)
    assert "'pool' (MaxPooling3D)" in text and "does not split evenly over 4" in text
    assert "'mid', 'head'" in text and "replicated" in text
    assert "spatial=(1, 2, 2)" in text          # a grid whose region goes further
    kinds = {n.name: n.kind for n in plan.nodes}
    assert kinds["enc"] == "spatial" and kinds["mid"] != "spatial"
    assert caught[0].filename == __file__        # points at the caller's line


@pytest.mark.parametrize("build,size,options", [
    (_unet, 4, {"spatial": (1, 2, 2)}),     # the whole U-Net on blocks
    (lambda: _unet(16), 4, {}),             # 16^3 pools to 8: splits over 4
    (_classifier, 2, {}),                   # the region ends at Flatten: nothing after
])
def test_nothing_is_said_when_no_convolution_runs_replicated(build, size, options):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _plan(build(), size, **options)


def test_feasibility_checks_do_not_warn():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert refusal(_unet(), "s", 4, 4) is None


def test_a_channels_first_volume_model_is_told_to_build_channels_last():
    inp = keras.Input((1, 8, 8, 8))
    x = L.Conv3D(4, 3, padding="same", data_format="channels_first", name="c0")(inp)
    model = keras.Model(inp, L.Conv3D(2, 1, data_format="channels_first", name="c1")(x))
    with pytest.raises(ValueError, match=r"channels_first.*To fix, build the model "
                                         r"channels_last .* or use strategy='d'"):
        _plan(model, 2)
