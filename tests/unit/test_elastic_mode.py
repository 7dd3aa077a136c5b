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
