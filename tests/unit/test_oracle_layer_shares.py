"""calibrate_run.layer_shares / measure_layer_times in one process: every layer
timed alone, the whole-model slope split by those times (not by FLOPs)."""
import keras
import pytest

from tfhybrid.oracle.calibration import run as calibrate_run
from tfhybrid.oracle.profile import profile


def cnn():
    i = keras.Input((32, 32, 3))
    x = keras.layers.Conv2D(8, 3, padding="same", name="conv")(i)
    x = keras.layers.MaxPooling2D(2, name="pool")(x)
    x = keras.layers.Flatten(name="flat")(x)
    return keras.Model(i, keras.layers.Dense(4, name="fc")(x))


def test_every_layer_gets_a_measured_share():
    model = cnn()
    names = [r.name for r in profile(model).rows]
    shares = calibrate_run.layer_shares(model, names, batch=32, reps=5)
    assert set(shares) == set(names)
    assert all(f >= 0 and b >= 0 for f, b in shares.values())
    # max pooling has under 2% of the FLOPs of this model but a real (memory-bound) cost
    rows = {r.name: r for r in profile(model).rows}
    flop_share = rows["pool"].fwd_flops / sum(r.fwd_flops for r in rows.values())
    time_share = shares["pool"][0] / sum(f for f, _ in shares.values())
    assert flop_share < 0.02 and time_share > 3 * flop_share, (flop_share, time_share)


def test_layer_times_sum_to_the_fitted_slope():
    model = cnn()
    times, fixed, fwd_bwd_s = calibrate_run.measure_layer_times(model, [2, 32], reps=3)
    assert set(times) == {r.name for r in profile(model).rows}
    assert fixed >= 0 and sum(f + b for f, b in times.values()) > 0
    assert set(fwd_bwd_s) == {2, 32} and all(t > 0 for t in fwd_bwd_s.values())


def test_only_layers_behind_trainable_weights_time_their_input_gradient():
    # training never computes the model input's gradient: the first conv's backward
    # is its weight gradient alone; everything after it back-propagates its input
    needs = calibrate_run._inputs_needing_grad(cnn())
    assert {k: needs[k] for k in ("conv", "pool", "flat", "fc")} == {
        "conv": False, "pool": True, "flat": True, "fc": True}


def test_a_layer_without_a_single_input_falls_back_to_none():
    model = cnn()
    assert calibrate_run.layer_shares(model, ["no_such_layer"], batch=4, reps=1) is None


if __name__ == "__main__":
    pytest.main([__file__])
