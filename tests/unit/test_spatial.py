"""Spatial layers in one process: geometry, argument validation, config and
serialization round trips, from_layer/to_layer (the parallel behaviour is in
tests/parallel/test_spatial_*.py)."""
import itertools
import os

import keras
import numpy as np
import pytest
import tensorflow as tf

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from tfhybrid.process_grid import Group, ProcessGrid
from tfhybrid.layers import (SpatialAveragePooling2D, SpatialAveragePooling3D,
                             SpatialConv2D, SpatialConv3D, SpatialGather,
                             SpatialMaxPooling2D, SpatialMaxPooling3D, SpatialScatter)
from tfhybrid import spatial_geometry as sp
from tfhybrid.layout import layout_of
from keras.src.ops.operation_utils import compute_conv_output_shape


# -- geometry ------------------------------------------------------------------------

@pytest.mark.parametrize("size,window,stride,padding", list(itertools.product(
    [5, 8, 9, 16], [1, 2, 3, 5, 7], [1, 2, 3], ["valid", "same"])))
def test_window_output_matches_keras(size, window, stride, padding):
    if padding == "valid" and window > size:
        return
    want = compute_conv_output_shape((1, size, 1), 1, (window,), (stride,), padding)[1]
    assert sp.window_output(size, window, stride, padding)[0] == want


def test_same_padding_is_asymmetric_like_tf():
    # 16 rows, 3-wide window, stride 2: TF pads 0 rows before and 1 after.
    assert sp.window_output(16, 3, 2, "same") == (8, 0)
    assert sp.window_output(16, 4, 1, "same") == (16, 1)   # 3 rows: 1 before, 2 after
    geom = sp.AxisGeometry(16, 2, 4, 1, "same")
    assert [geom.need(i) for i in range(2)] == [(1, 2), (1, 2)]


def test_valid_padding_shifts_the_needs_of_later_ranks():
    geom = sp.AxisGeometry(16, 2, 3, 1, "valid")          # output 14 -> 7 per rank
    assert [geom.need(i) for i in range(2)] == [(0, 1), (1, 0)]
    assert geom.exchange() == (1, 1)


@pytest.mark.parametrize("parts,window,stride,padding", list(itertools.product(
    [1, 2, 3, 4], [1, 2, 3, 4, 5, 7], [1, 2], ["valid", "same"])))
def test_plans_cover_exactly_the_windows_of_each_output_block(parts, window, stride, padding):
    for size in range(parts, 40, parts):
        geom = sp.AxisGeometry(size, parts, window, stride, padding)
        if geom.problem():
            continue
        lo_ex, hi_ex = geom.exchange()
        assert max(lo_ex, hi_ex) <= geom.block
        for i in range(parts):
            plan = sp.AxisPlan(geom, i)
            lo, hi = plan.need
            assert lo + geom.block + hi == (geom.out_block - 1) * stride + window
            take_lo, take_hi = plan.take(True)
            pad_lo, pad_hi = plan.pads()
            assert take_lo + pad_lo == lo and take_hi + pad_hi == hi
            assert take_lo <= lo_ex and take_hi <= hi_ex
            a, b = plan.interior()
            for j in range(a, b):   # interior windows use only local rows
                first = j * stride - lo            # in own-block coordinates
                assert first >= (-lo if not plan.halo[0] else 0)
                assert first + window <= geom.block + (hi if not plan.halo[1] else 0)


def test_problems_and_nearest_valid_sizes():
    assert "does not split evenly" in sp.AxisGeometry(10, 4, 3, 1, "same").problem()
    assert sp.AxisGeometry(10, 4, 3, 1, "same").nearest_valid() == (8, 12)
    assert "output size 7" in sp.AxisGeometry(16, 2, 3, 2, "valid").problem()
    assert sp.AxisGeometry(16, 2, 3, 2, "valid").nearest_valid() == (14, 18)
    assert "smaller than the halo" in sp.AxisGeometry(8, 4, 7, 1, "same").problem()
    assert sp.AxisGeometry(8, 4, 3, 1, "valid").nearest_valid() == (None, None)
    msg = sp.axis_problem_message("L", (None, 8, 4, 1), (4, 1), "height",
                                  sp.AxisGeometry(8, 4, 3, 1, "valid"))
    assert "none found" in msg and "padding='same'" in msg


def test_split_arguments():
    assert sp.grid_shape("height", 2, 4) == (4, 1)
    assert sp.grid_shape("width", 3, 2) == (1, 1, 2)
    assert sp.grid_shape((2, 2), 2, 4) == (2, 2)
    with pytest.raises(ValueError, match=r"`split`: 'depth'.*\('height', 'width'\)"):
        sp.grid_shape("depth", 2, 4)
    with pytest.raises(ValueError, match=r"`split`: \(2, 0\)"):
        sp.check_split((2, 0), 2)
    with pytest.raises(ValueError, match=r"split=\(2, 2\) \(product 4\).*3 ranks"):
        sp.grid_shape((2, 2), 2, 3)


def test_factor_group_matches_the_process_grid():
    for rank in range(8):
        grid = ProcessGrid(size=8, rank=rank, model_parallel=4)
        ours = sp.factor_group(grid.group("model"), (2, 2), ("h", "w"))
        assert [g.ranks for g in ours] == [g.ranks for g in grid.subgroups((2, 2), ("h", "w"))]
    every = sp.all_factored([(0, 1, 2, 3), (4, 5, 6, 7)], (2, 2))
    assert every == ProcessGrid(size=8, rank=0, model_parallel=4).all_subgroups((2, 2))
    assert sp.factor_group(Group("model", (0, 1), 1), (2, 1), "hw")[1].ranks == (1,)


# -- layers in a world of one process --------------------------------------------------

def _conv(cls, ndim, **kwargs):
    layer = cls(**kwargs)
    layer.build((None,) + (7,) * ndim + (2,))
    return layer


def test_single_rank_spatial_conv_equals_keras_and_round_trips():
    conv = _conv(keras.layers.Conv2D, 2, filters=3, kernel_size=3, strides=2, padding="same")
    spatial = SpatialConv2D.from_layer(conv, split="width", overlap=False)
    x = np.random.default_rng(0).standard_normal((2, 8, 6, 2)).astype(np.float32)
    np.testing.assert_allclose(spatial(x), conv(x), rtol=1e-6)
    config = spatial.get_config()
    assert (config["split"], config["group"], config["overlap"]) == ("width", "model", False)
    clone = SpatialConv2D.from_config(config)
    assert (clone.split, clone.kernel_size, clone.strides) == ("width", (3, 3), (2, 2))
    assert [layout_of(v).kind for v in spatial.trainable_variables] == ["partial"] * 2
    plain = spatial.to_layer()
    assert type(plain) is keras.layers.Conv2D and plain.get_config()["strides"] == (2, 2)


def test_block_grid_split_survives_json(tmp_path):
    inputs = keras.Input((4, 4, 2))
    x = SpatialScatter(split=(1, 1))(inputs)
    x = SpatialConv2D(2, 3, padding="same", split=(1, 1))(x)
    x = SpatialAveragePooling2D(2, padding="same", split=(1, 1))(x)
    x = SpatialMaxPooling2D(2, split=(1, 1))(x)
    outputs = SpatialGather(split=(1, 1))(x)
    model = keras.Model(inputs, outputs)
    path = tmp_path / "spatial.keras"
    model.save(path)
    loaded = keras.models.load_model(path)
    assert loaded.layers[2].split == (1, 1)
    data = np.random.default_rng(1).standard_normal((1, 4, 4, 2)).astype(np.float32)
    np.testing.assert_allclose(loaded(data), model(data), rtol=1e-6)


@pytest.mark.parametrize("cls,ndim", [(SpatialMaxPooling2D, 2), (SpatialAveragePooling2D, 2),
                                      (SpatialMaxPooling3D, 3), (SpatialAveragePooling3D, 3)])
def test_single_rank_pooling_equals_keras(cls, ndim):
    keras_cls = getattr(keras.layers, cls.__name__.replace("Spatial", ""))
    x = np.random.default_rng(2).standard_normal((1,) + (5,) * ndim + (2,)).astype(np.float32)
    for padding in ("valid", "same"):
        got = cls(3, strides=2, padding=padding)(x - 4)
        np.testing.assert_allclose(got, keras_cls(3, strides=2, padding=padding)(x - 4),
                                   rtol=1e-6)
    config = cls(2, padding="same", split=(1,) * ndim).get_config()
    assert cls.from_config(config).split == (1,) * ndim


def test_from_layer_errors():
    with pytest.raises(TypeError, match=r"SpatialConv2D.from_layer: Received layer=.*Conv2D"):
        SpatialConv2D.from_layer(keras.layers.Dense(3))
    with pytest.raises(TypeError, match="keras.layers.Conv3D"):
        SpatialConv3D.from_layer(_conv(keras.layers.Conv2D, 2, filters=1, kernel_size=1))
    with pytest.raises(ValueError, match="'c0' is not built"):
        SpatialConv2D.from_layer(keras.layers.Conv2D(2, 3, name="c0"))


def test_argument_errors():
    with pytest.raises(ValueError, match="channels_last"):
        SpatialConv2D(2, 3, data_format="channels_first")
    with pytest.raises(ValueError, match=r"`split`: 'rows'"):
        SpatialConv2D(2, 3, split="rows")
    with pytest.raises(ValueError, match=r"`split`: \(2,\)"):
        SpatialConv3D(2, 3, split=(2,))
    with pytest.raises(TypeError, match="`group`: 3"):
        SpatialMaxPooling2D(2, group=3)
    with pytest.raises(TypeError, match="`overlap`: 'yes'"):
        SpatialConv2D(2, 3, overlap="yes")
    with pytest.raises(TypeError, match="`overlap`: 1"):
        SpatialMaxPooling2D(2, overlap=1)
    assert SpatialConv2D(2, 3).get_config()["overlap"] is None
    with pytest.raises(ValueError, match="`padding`: 'full'"):
        SpatialAveragePooling2D(2, padding="full")
    conv = SpatialConv2D(2, 3)
    assert conv(keras.Input((None, 4, 2))).shape == (None, None, None, 2)  # symbolic: unknown
    unknown = tf.function(conv.call, input_signature=[tf.TensorSpec((None, None, 4, 2))])
    with pytest.raises(ValueError, match=r"known spatial sizes.*\(None, None, 4, 2\)"):
        unknown.get_concrete_function()
    with pytest.raises(ValueError, match=r"4-D \(NHWC\) or 5-D"):
        SpatialScatter()(keras.Input((4, 2)))


def test_supports_jit_is_false_on_instances():
    """Keras' Layer.__init__ assigns supports_jit=True to every instance; NoXLA keeps False."""
    for layer in (SpatialConv2D(2, 3), SpatialConv3D(2, 3), SpatialMaxPooling2D(),
                  SpatialAveragePooling3D(), SpatialScatter(), SpatialGather()):
        assert layer.supports_jit is False
        layer.supports_jit = True
        assert layer.supports_jit is False
