"""Calibrated split shares: a k-way split of a small layer does not run k times
faster, and the strategies that split layers (f, c, df, gmp and the per-layer
plans) are priced with the measured share instead of 1/k."""
import keras
import pytest

from tfhybrid.oracle import predict
from tfhybrid.oracle.calibration import run as calibrate_run
from tfhybrid.oracle.machine import Machine
from tfhybrid.oracle.per_layer import integrated_plans
from tfhybrid.oracle.profile import profile


def cnn():
    i = keras.Input((16, 16, 4))
    x = keras.layers.Conv2D(8, 3, padding="same", activation="relu", name="conv1")(i)
    x = keras.layers.MaxPooling2D(2, name="pool")(x)
    x = keras.layers.Conv2D(8, 3, padding="same", activation="relu", name="conv2")(x)
    x = keras.layers.Flatten(name="flat")(x)
    x = keras.layers.Dense(16, activation="relu", name="fc1")(x)
    return keras.Model(i, keras.layers.Dense(4, name="fc2")(x))


BASE = {"alpha": 1e-5, "beta": 1e-9, "flop_rate": 1e9}
NAMES = ("conv1", "conv2", "fc1", "fc2")


def test_split_share_reads_the_table_and_defaults_to_one_over_k():
    m = Machine.from_dict({**BASE, "split_scales": {"conv1": {"f2": 0.8, "c4": 0.4}}})
    assert m.split_share("conv1", "f", 2) == 0.8
    assert m.split_share("conv1", "c", 4) == 0.4
    assert m.split_share("conv1", "f", 4) == 0.25          # not measured: 1/k
    assert m.split_share("fc1", "c", 2) == 0.5
    assert m.split_share("conv1", "f", 1) == 1.0
    assert Machine.from_dict(m.to_dict()) == m


@pytest.mark.parametrize("table, words", [
    ([0.5], "must map layer names"),
    ({"conv1": 0.5}, "expected a dict"),
    ({"conv1": {"x2": 0.5}}, "is not 'f<k>'"),
    ({"conv1": {"f0": 0.5}}, "is not 'f<k>'"),
    ({"conv1": {"f2": 0}}, "split_scales['conv1']['f2']"),
    ({"conv1": {"f2": float("nan")}}, "finite"),
])
def test_bad_split_scales_are_named(table, words):
    with pytest.raises(ValueError, match=None) as err:
        Machine.from_dict({**BASE, "split_scales": table})
    assert words in str(err.value)


def _machine(share):
    scales = {n: {f"{h}{k}": share(k) for h in "fc" for k in (2, 4)} for n in NAMES}
    return Machine.from_dict({**BASE, "split_scales": scales})


@pytest.mark.parametrize("strategy, p", [("f", 2), ("f", 4), ("c", 4), ("df", 4), ("gmp", 2)])
def test_split_strategies_pay_the_measured_share(strategy, p):
    model = cnn()
    opts = {"mp": p, "ccr_threshold": 0} if strategy == "gmp" else {"fallback": "replicate"}
    linear = predict(model, strategy, p, 32, _machine(lambda k: 1.0 / k), **opts)
    plain = predict(model, strategy, p, 32, Machine.from_dict(BASE), **opts)
    slow = predict(model, strategy, p, 32, _machine(lambda k: 1.0), **opts)
    # a table of exactly 1/k is the uncalibrated prediction; no speed-up costs more
    assert linear.compute_s == pytest.approx(plain.compute_s, rel=1e-12)
    assert slow.compute_s > plain.compute_s * (1.05 if strategy == "gmp" else 1.2)
    assert slow.comm_s == plain.comm_s                  # only the compute changes


def test_d_and_serial_ignore_split_scales():
    model = cnn()
    for strategy, p in (("serial", 1), ("d", 4)):
        a = predict(model, strategy, p, 32, _machine(lambda k: 1.0))
        b = predict(model, strategy, p, 32, Machine.from_dict(BASE))
        assert a.total_s == b.total_s


def test_integrated_plans_price_split_layers_with_the_share():
    prof = profile(cnn())
    fast = integrated_plans(prof, 4, 32, Machine.from_dict(BASE))
    slow = integrated_plans(prof, 4, 32, _machine(lambda k: 1.0))
    by_grid = {pl.model_parallel: pl.total_s for pl in slow}
    for pl in fast:
        if pl.model_parallel > 1 and pl.strategy != "s" and pl.model_parallel in by_grid:
            assert by_grid[pl.model_parallel] >= pl.total_s


def test_split_variants_of_conv_and_dense():
    model = cnn()
    conv = calibrate_run._split_variants(model.get_layer("conv2"), 2)
    assert set(conv) == {"f2", "c2"}
    layer, shape = conv["f2"]
    assert layer.filters == 4 and shape[1:] == (8, 8, 8)
    layer, shape = conv["c2"]
    assert layer.filters == 8 and shape[1:] == (8, 8, 4) and not layer.use_bias
    dense = calibrate_run._split_variants(model.get_layer("fc2"), 4)
    assert set(dense) == {"f4", "c4"} and dense["f4"][0].units == 1
    assert set(calibrate_run._split_variants(model.get_layer("fc2"), 3)) == set()   # 4 % 3
    assert calibrate_run._split_variants(model.get_layer("pool"), 2) == {}


def test_measured_shares_lie_between_one_over_k_and_one():
    model = cnn()
    scales = calibrate_run.measure_split_scales(model, list(NAMES) + ["pool"], 16, [2, 4],
                                                reps=3)
    # pooling is never split; a layer whose whole time is below an empty call's
    # (fc2, 4 units at batch 16, now and then) has no share: it keeps 1/k
    assert {"conv1", "conv2"} <= set(scales) <= set(NAMES)
    assert set(scales["conv1"]) == {"f2", "f4", "c2", "c4"}
    for name, row in scales.items():
        for key, share in row.items():
            assert 1.0 / int(key[1:]) <= share <= 1.0, (name, key, share)
    Machine.from_dict({**BASE, "split_scales": scales})   # a valid machine entry


def test_spatial_blocks_of_valid_windows_hold_their_halo():
    """A ``valid`` 3x3 convolution's block is its output rows plus the kernel's
    halo (the calibration of ``tfhybrid calibrate --model`` at -np 4 raised on
    rank 0 alone for a block narrower than the kernel, and left the other ranks
    waiting); a split finer than the output rows is not timed."""
    model = keras.Sequential([
        keras.Input((8, 8, 2)), keras.layers.Conv2D(4, 3, name="cv"),
        keras.layers.MaxPooling2D(2, name="mp"),
        keras.layers.Conv2D(4, 3, strides=2, padding="same", name="cs")])
    cv = {k: v[1][1:3] for k, v in calibrate_run._spatial_variants(model.get_layer("cv"), 4).items()}
    assert cv == {"s4": (4, 8), "s2x2": (5, 5), "s1x4": (8, 4)}    # 6 rows out: 2 + 2 halo
    mp = calibrate_run._spatial_variants(model.get_layer("mp"), 4)
    assert set(mp) == {"s2x2"}                  # 3 rows out: no 4-way split of one axis
    cs = calibrate_run._spatial_variants(model.get_layer("cs"), 2)
    assert {k: v[1][1:3] for k, v in cs.items()} == {"s2": (2, 3), "s1x2": (3, 2)}
    scales = calibrate_run.measure_split_scales(model, ["cv", "cs"], 16, [2, 4], reps=2,
                                                spatial_names=["cv", "mp", "cs"])
    assert set(scales) <= {"cv", "mp", "cs"}


if __name__ == "__main__":
    pytest.main([__file__])
