"""tfhybrid.init in one process (no horovodrun): grid of one, re-init rules."""
import pytest

import tfhybrid


@pytest.fixture(autouse=True)
def _fresh():
    tfhybrid.shutdown()
    yield
    tfhybrid.shutdown()


def test_single_process_grid():
    g = tfhybrid.init(model_parallel=1)
    assert (g.size, g.rank, g.data_size, g.model_size) == (1, 0, 1, 1)
    assert tfhybrid.is_root() and tfhybrid.grid() is g


def test_second_init_same_args_is_noop_and_different_raises():
    g = tfhybrid.init(model_parallel=1)
    assert tfhybrid.init(model_parallel=1) is g
    with pytest.raises(ValueError, match="already initialised with model_parallel=1.*model_parallel=2"):
        tfhybrid.init(model_parallel=2)


def test_model_parallel_not_dividing_world():
    with pytest.raises(ValueError, match="model_parallel=2, world size 1"):
        tfhybrid.init(model_parallel=2)


def test_config_validation():
    with pytest.raises(ValueError, match="cycle_time_ms=-1"):
        tfhybrid.Config(cycle_time_ms=-1)
    env = tfhybrid.Config(fusion_threshold_bytes=1 << 20, cycle_time_ms=2).horovod_env()
    assert env["HOROVOD_FUSION_THRESHOLD"] == "1048576" and env["HOROVOD_CYCLE_TIME"] == "2"


def test_primitives_are_identity_on_one_process():
    import numpy as np
    import tensorflow as tf

    from tfhybrid import comm
    x = tf.constant(np.arange(12.0).reshape(3, 4), tf.float32)
    for fn in (comm.split, comm.gather, comm.shard):
        np.testing.assert_array_equal(fn(x, axis=1).numpy(), x.numpy())
    np.testing.assert_array_equal(comm.reduce(x).numpy(), x.numpy())
    y = comm.halo_exchange(x, axis=0, lo=1, hi=2)
    assert y.shape == (6, 4) and float(tf.reduce_sum(y[:1])) == 0 and float(tf.reduce_sum(y[4:])) == 0


def test_bad_group_and_axis():
    import tensorflow as tf

    from tfhybrid import comm
    with pytest.raises(TypeError, match="group"):
        comm.split(tf.zeros([2, 2]), group=3)
    with pytest.raises(ValueError, match="axis=5"):
        comm.split(tf.zeros([2, 2]), axis=5)
    with pytest.raises(ValueError, match="`lo`"):
        comm.halo_exchange(tf.zeros([2, 2]), axis=0, lo=-1, hi=0)


def test_rank_and_size_like_horovod():
    """tfhybrid.rank()/size() answer alone (0, 1) before and after init."""
    assert (tfhybrid.rank(), tfhybrid.size()) == (0, 1)
    tfhybrid.init(model_parallel=1)
    assert (tfhybrid.rank(), tfhybrid.size()) == (0, 1)
    assert {"rank", "size"} <= set(tfhybrid.__all__)


def test_hosts_and_placement(monkeypatch):
    from tfhybrid import runtime
    from tfhybrid.process_grid import ProcessGrid

    tfhybrid.init(model_parallel=1)
    import socket
    assert tfhybrid.runtime.hosts() == (socket.gethostname(),)
    monkeypatch.setitem(runtime._STATE, "hosts", ("h1", "h1", "h2", "h2"))
    assert runtime.placement(ProcessGrid(4, 0, 2)) == \
        "Model groups by host: 0 [0, 1] h1; 1 [2, 3] h2"
    assert runtime.placement(ProcessGrid(4, 0, 4)) == \
        "Model groups by host: 0 [0, 1, 2, 3] h1+h2 (spans hosts)"
    assert runtime.placement(ProcessGrid(2, 0, 2)) == ""     # another world: unknown
