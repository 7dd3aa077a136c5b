"""tfhybrid.profiling in one process: phases of collectives, the table, bad input."""
import keras
import numpy as np
import pytest

import tfhybrid
from tfhybrid.profiling import PHASES, Profile, phase_of


@pytest.mark.parametrize("op, name, phase", [
    ("alltoall", "tfh.conv1.halo", "halo"),
    ("alltoall", "tfh.conv1.halo.bwd", "halo"),
    ("allgather", "tfh.fc1.fwd", "FB-allgather"),
    ("alltoall", "tfh.fc2.reducescatter", "FB-allgather"),
    ("allreduce", "tfh.bn.sync", "FB-allreduce"),
    ("grouped_allreduce", "tfh.distributed_sgd.bucket0", "GE-allreduce"),
    ("alltoall", "tfh.ls.fwd", "p2p"),
    ("alltoall", "p.fwd.1.0", "p2p"),
    ("broadcast", "p.fit.pred", "p2p"),
    ("allgather", "tfh.p.fwd", "FB-allgather"),     # a layer named "p"
])
def test_phase_of(op, name, phase):
    assert phase_of(op, name) == phase


def test_profile_in_one_process_prints_every_phase():
    tfhybrid.init()
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(4), keras.layers.Dense(2)])
    model.compile(optimizer=tfhybrid.DistributedOptimizer(keras.optimizers.SGD(0.1)),
                  loss="mse", jit_compile=False)
    lines = []
    profile = Profile(steps=2, start=1, batch_size=4, print_fn=lines.append)
    x, y = np.ones((16, 6), "float32"), np.zeros((16, 2), "float32")
    model.fit(x, y, batch_size=4, verbose=0, callbacks=[profile])
    assert profile.result["world_size"] == 1
    assert profile.result["measured"]["GE-allreduce"] == 0.0     # nothing to reduce
    assert all(phase in lines[0] for phase in PHASES)


@pytest.mark.parametrize("kwargs, match", [
    ({"steps": 2}, r"batch_size=<global batch>"),
    ({"steps": 0, "batch_size": 8}, r"`steps`: 0"),
    ({"steps": 2, "start": -1, "batch_size": 8}, r"`start`: -1"),
    ({"steps": 2, "batch_size": 2.5}, r"`batch_size`: 2.5"),
])
def test_profile_bad_input(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Profile(**kwargs)


def test_prediction_options_price_the_model_as_transform_built_it():
    from types import SimpleNamespace

    from tfhybrid.profiling import _options_as_built
    grid = SimpleNamespace(size=4, model_size=4)
    # f/c: layers the group cannot split were replicated (transform refuses otherwise)
    assert _options_as_built("f", None, grid) == {"fallback": "replicate"}
    assert _options_as_built("p", SimpleNamespace(micro_batches=2), grid) == {"segments": 2}
    assert _options_as_built("ls", SimpleNamespace(n_f=1), grid) is None
    world = SimpleNamespace(size=4, model_size=1)
    assert _options_as_built("ls", SimpleNamespace(n_f=2), world) == {"n_f": 2}
    assert _options_as_built("df", None, SimpleNamespace(size=4, model_size=2)) == \
        {"grid": (2, 2), "fallback": "replicate"}


def test_phase_timings_take_the_calibration_statistic(monkeypatch):
    """measure_phases' ``stat`` is calibrate's --collective-stat: best, median or
    the mean without the fastest and slowest fifth; anything else is refused."""
    from tfhybrid import profiling

    durations = [5.0, 1.0, 40.0, 1.0, 5.0]
    clock, left = [0.0], []

    def fn():
        clock[0] += left.pop(0)
        return []
    monkeypatch.setattr(profiling.time, "perf_counter", lambda: clock[0])
    got = {}
    for stat in ("best", "median", "mean"):
        left[:] = durations
        got[stat] = profiling._timed(fn, 5, None, profiling._stat(stat))
    assert got == {"best": 1.0, "median": 5.0, "mean": pytest.approx(11 / 3)}
    with pytest.raises(ValueError, match="stat='fastest'"):
        profiling.measure_phases(keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)]),
                                 2, stat="fastest")
