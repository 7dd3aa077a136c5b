"""Elastic runs: the Gloo timeout switch and the grid kept on a new world size.

The recovery itself runs under real ``horovodrun --min-np`` in
tests/integration/test_elastic.py.
"""
import tfhybrid
from tfhybrid.elastic import _model_parallel_for


def test_elastic_runs_take_the_elastic_gloo_timeout(monkeypatch):
    config = tfhybrid.Config(gloo_timeout_seconds=500, elastic_gloo_timeout_seconds=20)
    monkeypatch.delenv("HOROVOD_ELASTIC", raising=False)
    assert config.horovod_env()["HOROVOD_GLOO_TIMEOUT_SECONDS"] == "500"
    monkeypatch.setenv("HOROVOD_ELASTIC", "1")
    assert config.horovod_env()["HOROVOD_GLOO_TIMEOUT_SECONDS"] == "20"
    assert tfhybrid.Config().horovod_env()["HOROVOD_GLOO_TIMEOUT_SECONDS"] == "60"


def test_new_world_keeps_model_parallel_when_it_divides_else_largest_divisor_below():
    assert _model_parallel_for(2, 2) == 2      # df 2x2 on 4 -> 1x2 on 2
    assert _model_parallel_for(3, 2) == 1      # -> 3x1 on 3 (data parallel)
    assert _model_parallel_for(2, 3) == 2      # f over 3 -> f over 2
    assert _model_parallel_for(6, 4) == 3
    assert _model_parallel_for(5, 1) == 1


def test_pairs_halo_is_refused_in_elastic_runs(monkeypatch):
    import pytest

    from tfhybrid.comm import backend, halo
    monkeypatch.setenv("TFHYBRID_HALO", "pairs")
    assert halo.halo_method() == "pairs"
    monkeypatch.setitem(backend._STATE, "over_world", True)
    with pytest.raises(ValueError, match="'pairs' in an elastic run.*'neighbour'"):
        halo.halo_method()


def test_pipeline_and_layer_separation_are_refused_in_elastic_runs(monkeypatch):
    import keras
    import pytest

    from tfhybrid.comm import backend
    tfhybrid.init()
    monkeypatch.setitem(backend._STATE, "over_world", True)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    for strategy in ("p", "ls"):
        with pytest.raises(ValueError, match=f"strategy='{strategy}' in an elastic run.*df"):
            tfhybrid.transform(model, strategy)
    tfhybrid.shutdown()


class _FakeHorovod:
    """What backend.init and backend.reset call of horovod.tensorflow, recorded.
    ``init(process_sets="dynamic")`` exports HOROVOD_DYNAMIC_PROCESS_SETS=1 as
    Horovod 0.28.1's does."""

    def __init__(self):
        self.calls, self.up = [], False

    def init(self, process_sets=None):
        import os
        if process_sets == "dynamic":
            os.environ["HOROVOD_DYNAMIC_PROCESS_SETS"] = "1"
        self.calls.append(("init", process_sets,
                           os.environ.get("HOROVOD_DYNAMIC_PROCESS_SETS")))
        self.up = True

    def shutdown(self):
        self.calls.append(("shutdown",))
        self.up = False

    def is_initialized(self):
        return self.up

    def size(self):
        return 2

    def rank(self):
        return 0

    def local_rank(self):
        return 0


def test_elastic_runs_start_horovod_without_dynamic_process_sets(monkeypatch):
    """Dynamic sets lock the process-set table through a world allgather every
    cycle: after a lost worker a collective enqueued meanwhile could miss
    Horovod's shutdown and hang the survivor's step (tests/multihost). An
    elastic run starts Horovod with the world's set alone, also after a reset,
    even when an earlier dynamic start left HOROVOD_DYNAMIC_PROCESS_SETS=1."""
    from tfhybrid.comm import backend, hostcheck
    fake = _FakeHorovod()
    monkeypatch.setattr(backend, "_STATE", dict(backend._STATE, hvd=None, mpi_ops=None,
                                                initialized=False, sets={}, restarts=0))
    monkeypatch.setattr(backend, "_import_horovod", lambda: (fake, object()))
    monkeypatch.setattr(hostcheck, "check", lambda: None)
    monkeypatch.setattr(backend, "_exit_barrier_last", lambda: None)
    monkeypatch.setenv("HOROVOD_ELASTIC", "1")
    monkeypatch.setenv("HOROVOD_SIZE", "2")
    monkeypatch.setenv("HOROVOD_DYNAMIC_PROCESS_SETS", "1")
    monkeypatch.delenv("TFHYBRID_GROUPS_OVER_WORLD", raising=False)
    assert backend.init([(0, 1)]) == (2, 0, 0)
    assert backend.process_set_mode() == "none"
    backend.reset()
    assert fake.calls == [("init", None, None), ("shutdown",), ("init", None, None)]


def test_ordinary_runs_reset_to_dynamic_process_sets(monkeypatch):
    from tfhybrid.comm import backend
    fake = _FakeHorovod()
    fake.up = True
    monkeypatch.setattr(backend, "_STATE", dict(backend._STATE, hvd=fake, initialized=True,
                                                over_world=False, sets={}, static=True))
    monkeypatch.setattr(backend, "_exit_barrier_last", lambda: None)
    monkeypatch.delenv("HOROVOD_DYNAMIC_PROCESS_SETS", raising=False)
    backend.reset()
    assert fake.calls == [("shutdown",), ("init", "dynamic", "1")]
    assert backend.process_set_mode() == "dynamic"
