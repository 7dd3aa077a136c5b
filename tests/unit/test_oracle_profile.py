"""profile(): per-layer rows of Keras models against hand counts and the papers' tables."""
import keras
import pytest

from tfhybrid.oracle import profile
from tfhybrid.oracle.models import build_model

L = keras.layers


def test_small_cnn_rows_hand_counted():
    m = keras.Sequential([keras.Input((8, 8, 3)),
                          L.Conv2D(4, 3, padding="same", activation="relu", name="c"),
                          L.MaxPooling2D(2, name="p"), L.BatchNormalization(name="bn"),
                          L.Flatten(name="f"), L.Dense(5, name="d")])
    rows = {r.name: r for r in profile(m).rows}
    c = rows["c"]
    assert (c.kind, c.params, c.weights, c.biases) == ("conv", 112, 108, 4)
    assert c.fwd_flops == 2 * 27 * 4 * 64 + 256 + 256     # MACs x2 + bias + fused ReLU
    assert c.bwd_flops == 2 * (2 * 27 * 4 * 64 + 256) + 256
    assert (c.x, c.y, c.channels, c.filters) == (192, 256, 3, 4)
    assert (c.kernel, c.strides) == ((3, 3), (1, 1))
    assert (c.halo_x, c.halo_dy) == (1 * 8 * 3, 1 * 8 * 4)   # one row of W x C per side
    p = rows["p"]
    assert (p.kind, p.y, p.fwd_flops, p.halo_x) == ("pool", 64, 64 * 4, 0)
    assert rows["bn"].kind == "norm" and rows["bn"].params == 16
    assert rows["f"].kind == "reshape" and rows["f"].fwd_flops == 0
    d = rows["d"]
    assert (d.params, d.fwd_flops, d.x, d.y) == (325, 2 * 64 * 5 + 5, 64, 5)
    assert profile(m).total_params == m.count_params()


def test_halo_for_grid_and_strides():
    m = keras.Sequential([keras.Input((16, 12, 2)), L.Conv2D(3, 5, strides=2, padding="same",
                                                             dilation_rate=1, name="c")])
    r = profile(m).rows[0]
    assert r.halo_for((2, 1)) == (2 * 12 * 2, 1 * 6 * 3)     # ceil((5-2)/2)=2 rows of x
    assert r.halo_for((2, 2)) == (2 * 12 * 2 + 2 * 16 * 2, 6 * 3 + 8 * 3)
    assert r.halo_for((1, 1)) == (0, 0)


def test_conv3d_and_functional_add():
    inp = keras.Input((8, 8, 8, 2))
    a = L.Conv3D(4, 3, padding="same", name="c3")(inp)
    b = L.Conv3D(4, 1, name="c1")(inp)
    out = L.Add(name="add")([a, b])
    rows = {r.name: r for r in profile(keras.Model(inp, out)).rows}
    assert rows["c3"].fwd_flops == 2 * 27 * 2 * 4 * 512 + 4 * 512
    assert rows["c3"].halo_x == 1 * 8 * 8 * 2 and rows["c1"].halo_x == 0
    assert rows["add"].kind == "merge" and rows["add"].x == 2 * 2048


def test_errors():
    with pytest.raises(TypeError, match="expects a keras.Model"):
        profile("vgg16")
    with pytest.raises(ValueError, match="Unknown model 'nope'"):
        build_model("nope")


@pytest.fixture(scope="module")
def vgg16():
    return profile(build_model("vgg16"))


def test_vgg16_matches_keras_and_lee(vgg16):
    assert vgg16.total_params == 138357544
    fc1 = next(r for r in vgg16.rows if r.name == "fc1")
    assert fc1.weights == 102760448          # Lee et al.: K_b K_c of VGG-A FC1
    assert (fc1.channels, fc1.filters) == (25088, 4096)
    conv = [r for r in vgg16.rows if r.kind == "conv"]
    assert len(conv) == 13 and min(r.filters for r in conv) == 64


def test_resnet50_and_alexnet():
    r50 = build_model("resnet50")
    prof = profile(r50)
    assert prof.total_params == r50.count_params() == 25636712
    kinds = {r.kind for r in prof.rows}
    assert {"conv", "norm", "merge", "pool", "dense"} <= kinds
    alex = profile(build_model("alexnet"))
    assert alex.rows[0].spatial_out == (55, 55) and alex.rows[0].filters == 96


def test_splitbrain_vgg_table1():
    prof = profile(build_model("splitbrain_vgg"))
    want = {"conv0": 1728, "conv1": 36864, "conv2": 73728, "conv3": 147456, "conv4": 294912,
            "conv5": 589824, "conv6": 589824, "fc0": 4194304, "fc1": 1048576, "fc2": 10240}
    got = {r.name: r.weights for r in prof.rows if r.weights}
    assert got == want
    fc0 = next(r for r in prof.rows if r.name == "fc0")
    assert (fc0.channels, fc0.filters) == (4096, 1024)
