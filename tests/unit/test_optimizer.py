"""DistributedOptimizer in one process: argument errors, bucket planning, the
layout reduction rule on a synthetic grid, serialization, and training that
equals the plain optimizer (a one-rank world needs no communication)."""
import os

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfhybrid
from tfhybrid.process_grid import Group, ProcessGrid
from tfhybrid.layout import VariableLayout, set_layout
from tfhybrid.optimizer import (DistributedOptimizer, mark_prereduced, plan_buckets,
                                reduction_of, replicate_fc_gradients)

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def sgd():
    return keras.optimizers.SGD(0.1)


# -- argument errors ----------------------------------------------------------

@pytest.mark.parametrize("kwargs, error, match", [
    ({"bucket_bytes": 0}, ValueError, r"`bucket_bytes`: bucket_bytes=0; expected an integer >= 1"),
    ({"bucket_bytes": -5}, ValueError, r"bucket_bytes=-5"),
    ({"bucket_bytes": 1.5}, ValueError, r"bucket_bytes=1.5"),
    ({"bucket_bytes": "big"}, ValueError, r"bucket_bytes='big'; expected an integer >= 1\. Or 'auto'"),
    ({"compression": "int8"}, ValueError, r"compression='int8'; expected one of \('none', 'fp16'\)"),
    ({"op": "max"}, ValueError, r"op='max'; expected one of \('average', 'sum'\)"),
    ({"backward_passes_per_step": 0}, ValueError, r"backward_passes_per_step=0"),
    ({"replicate_fc_gradients": -1}, ValueError, r"replicate_fc_gradients=-1"),
    ({"delay_fc_update": 1}, ValueError, r"`delay_fc_update`: 1; expected True"),
])
def test_invalid_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        DistributedOptimizer(sgd(), **kwargs)


def test_invalid_optimizer_type():
    with pytest.raises(TypeError, match=r"Received an invalid `optimizer`: 0.1 \(type float\)"):
        DistributedOptimizer(0.1)
    with pytest.raises(TypeError, match=r"class SGD as `optimizer`; pass an instance"):
        DistributedOptimizer(keras.optimizers.SGD)
    with pytest.raises(ValueError, match="wrap the plain Keras optimizer once"):
        DistributedOptimizer(DistributedOptimizer(sgd()))


def test_optimizer_by_name():
    assert isinstance(DistributedOptimizer("adam").inner_optimizer, keras.optimizers.Adam)


# -- planning -------------------------------------------------------------------

def test_buckets_reverse_order_and_limit():
    w = (0, 1)
    items = [(w, 100), (w, 8), ((), 40), (w, 8), ((0, 2), 8), (w, 30)]
    buckets = plan_buckets(items, 40)
    assert [(b.ranks, b.indices, b.nbytes) for b in buckets] == [
        ((0, 1), [5, 3], 38), ((0, 2), [4], 8), ((0, 1), [1], 8), ((0, 1), [0], 100)]
    assert buckets[0].ring_bytes() == 38.0
    assert len(plan_buckets(items, 10**9)) == 2          # one per process set


def test_a_small_last_bucket_joins_the_one_before():
    """at_least with min_last: the remainder bucket (the first layers' gradients) under
    min_last bytes joins the bucket before it of its own group; other groups, a large
    remainder and the upper-bound mode keep theirs. The cnn_head of bench/wire.py: a
    2,059 KiB head and 20 KiB of convolutions become one bucket."""
    w, v = (0, 1), (0, 2)
    head = [(w, 20 * 2**10), (w, 2059 * 2**10)]
    assert [b.nbytes for b in plan_buckets(head, 520_000, at_least=True)] == [
        2059 * 2**10, 20 * 2**10]
    merged = plan_buckets(head, 520_000, at_least=True, min_last=64 * 2**10)
    assert [(b.indices, b.nbytes) for b in merged] == [([1, 0], 2079 * 2**10)]
    items = [(w, 8), (v, 8), (w, 100), (v, 100), (w, 100)]
    got = plan_buckets(items, 150, at_least=True, min_last=50)
    assert [(b.ranks, b.indices, b.nbytes) for b in got] == [
        (w, [4, 2, 0], 208), (v, [3, 1], 108)]     # v's remainder has no bucket before it
    assert [b.nbytes for b in plan_buckets(items, 150, at_least=True, min_last=8)] == [
        200, 108, 8]
    assert [b.nbytes for b in plan_buckets(items, 150, min_last=50)] == [100, 108, 108]


def test_reduction_rule_on_synthetic_grid():
    grid = ProcessGrid(size=8, rank=5, model_parallel=2)
    v = keras.Variable(np.zeros(3, np.float32))
    assert reduction_of(v, grid) == (r := reduction_of(v, grid)) and r.ranks == tuple(range(8))
    assert r.factor == pytest.approx(1 / 8)
    set_layout(v, VariableLayout(kind="replicated", group="data"))   # same grad in a model group
    r = reduction_of(v, grid)
    assert r.ranks == (1, 3, 5, 7) and r.factor == pytest.approx(1 / 4)
    set_layout(v, VariableLayout(kind="sharded", grad_scale=0.5))
    r = reduction_of(v, grid)
    assert r.ranks == (1, 3, 5, 7) and r.factor == pytest.approx(0.5 / 4)
    set_layout(v, VariableLayout(kind="partial"))
    assert reduction_of(v, grid).factor == pytest.approx(2 / 8)
    assert reduction_of(v, grid, op="sum").factor == pytest.approx(2 / 8 * 4)
    set_layout(v, VariableLayout(kind="partial", group=Group("h", (4, 5), 1)))
    assert reduction_of(v, grid).factor == pytest.approx(2 / 8)
    set_layout(v, VariableLayout(kind="partial", group="h"))
    with pytest.raises(ValueError, match=r"'partial' layout over group='h'"):
        reduction_of(v, grid)
    mark_prereduced(v)
    assert reduction_of(v, grid).ranks == ()


# -- single-process behaviour ---------------------------------------------------------

def small_model(seed=0):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((5,)), keras.layers.Dense(4, activation="relu"),
                             keras.layers.Dense(2)])


def data():
    r = np.random.default_rng(0)
    return r.standard_normal((12, 5)).astype(np.float32), r.standard_normal((12, 2)).astype(np.float32)


@pytest.mark.parametrize("options", [{}, {"compression": "fp16"}, {"replicate_fc_gradients": 1}])
def test_one_process_equals_plain_optimizer(options):
    x, y = data()
    ref = small_model()
    ref.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse", jit_compile=False)
    ref.fit(x, y, batch_size=4, shuffle=False, verbose=0)
    model = small_model()
    model.compile(optimizer=DistributedOptimizer(keras.optimizers.Adam(0.01), **options), loss="mse")
    model.fit(x, y, batch_size=4, shuffle=False, verbose=0, callbacks=tfhybrid.callbacks.standard())
    for a, b in zip(model.get_weights(), ref.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_delay_fc_update_round_trips_and_marks_dense_weights():
    opt = DistributedOptimizer(keras.optimizers.SGD(0.1), delay_fc_update=True)
    again = DistributedOptimizer.from_config(opt.get_config())
    assert again.delay_fc_update is True
    model = small_model()
    marked = tfhybrid.optimizer.mark_delayed_fc(model)
    dense = [v for layer in model.layers if isinstance(layer, keras.layers.Dense)
             for v in layer.trainable_variables]
    assert marked == len(dense) > 0
    assert all(tfhybrid.optimizer.is_delayed_fc(v) for v in dense)


def test_learning_rate_and_iterations_delegate():
    opt = DistributedOptimizer(keras.optimizers.SGD(0.5))
    assert float(opt.learning_rate) == 0.5
    opt.learning_rate = 0.25
    assert float(opt.inner_optimizer.learning_rate) == 0.25
    assert opt.iterations is opt.inner_optimizer.iterations


def test_config_round_trip():
    opt = DistributedOptimizer(keras.optimizers.Adam(0.003), bucket_bytes=1024, compression="fp16",
                               backward_passes_per_step=2, op="sum", replicate_fc_gradients=1)
    clone = keras.optimizers.deserialize(keras.optimizers.serialize(opt))
    assert isinstance(clone, DistributedOptimizer)
    assert clone.get_config()["bucket_bytes"] == 1024
    assert {k: v for k, v in clone.get_config().items() if k != "optimizer"} == {
        k: v for k, v in opt.get_config().items() if k != "optimizer"}
    assert float(clone.learning_rate) == pytest.approx(0.003)


def test_model_save_and_load(tmp_path):
    x, y = data()
    model = small_model()
    model.compile(optimizer=DistributedOptimizer(keras.optimizers.Adam(0.01),
                                                 backward_passes_per_step=2), loss="mse")
    model.fit(x, y, batch_size=4, verbose=0)
    path = str(tmp_path / "m.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    assert isinstance(loaded.optimizer, DistributedOptimizer)
    assert loaded.optimizer.backward_passes_per_step == 2
    for a, b in zip(loaded.optimizer.variables, model.optimizer.variables):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b))
    np.testing.assert_allclose(loaded.predict(x, verbose=0), model.predict(x, verbose=0), rtol=1e-6)


def test_backward_passes_accumulate_then_apply():
    v = keras.Variable(np.zeros(2, np.float32))
    opt = DistributedOptimizer(keras.optimizers.SGD(1.0), backward_passes_per_step=2)
    opt.apply([tf.constant([1.0, 2.0])], [v])
    np.testing.assert_allclose(v.numpy(), [0, 0])
    opt.apply([tf.constant([3.0, 4.0])], [v])
    np.testing.assert_allclose(v.numpy(), [-2, -3])
    assert int(opt.iterations) == 1


def test_replicated_fc_errors():
    model = small_model()
    with pytest.raises(ValueError, match=r"replicate_fc_gradients=3, but model .* has only 2 Dense"):
        replicate_fc_gradients(model, 3)
    with pytest.raises(ValueError, match=r"f=1.5"):
        replicate_fc_gradients(model, 1.5)
    unbuilt = keras.Sequential([keras.layers.Dense(2)])
    unbuilt.layers  # noqa: B018
    with pytest.raises(ValueError, match="not built"):
        replicate_fc_gradients(keras.Sequential([keras.layers.Dense(2), keras.layers.Dense(1)]), 1)
    set_layout(model.layers[1].kernel, VariableLayout(kind="sharded"))
    with pytest.raises(ValueError, match=r"holds a sharded weight"):
        replicate_fc_gradients(model, 2)


def test_replicate_fc_without_attach_raises():
    model = small_model()
    opt = DistributedOptimizer(sgd(), replicate_fc_gradients=1)
    with pytest.raises(ValueError, match=r"found no hooked Dense layer.*attach\(model\)"):
        opt.build(model.trainable_variables)


def test_attach_turns_off_xla():
    model = small_model()
    model.compile(optimizer=DistributedOptimizer(sgd()), loss="mse", jit_compile=True)
    with pytest.warns(UserWarning, match="turning off XLA"):
        assert model.optimizer.attach(model)
    assert model.jit_compile is False


def test_xla_context_detection():
    from tfhybrid.optimizer import in_xla_context

    seen = []

    @tf.function(jit_compile=True)
    def f(x):
        seen.append(in_xla_context())
        return x + 1

    f(tf.constant(1.0))
    tf.function(lambda x: seen.append(in_xla_context()) or x)(tf.constant(1.0))
    assert seen == [True, False] and not in_xla_context()


def test_seed_state_is_not_broadcast():
    from tfhybrid.callbacks import broadcastable

    layer = keras.layers.Dropout(0.5, seed=1)
    states = [v for v in layer.variables if "seed" in v.name]
    assert states and not any(broadcastable(v) for v in states)
    assert all(broadcastable(v) for v in small_model().variables)


def test_callback_argument_errors():
    with pytest.raises(ValueError, match=r"`target_lr`: -1"):
        tfhybrid.callbacks.LearningRateWarmupCallback(-1, 10)
    with pytest.raises(ValueError, match=r"`warmup_steps`: 0"):
        tfhybrid.callbacks.LearningRateWarmupCallback(0.1, 0)
    with pytest.raises(ValueError, match=r"warmup_steps=5 without `target_lr`"):
        tfhybrid.callbacks.standard(warmup_steps=5)
    with pytest.raises(ValueError, match=r"root_rank=3"):
        tfhybrid.callbacks.broadcast_model(small_model(), root_rank=3)


def test_auto_bucket_size_follows_the_calibrated_link(tmp_path, monkeypatch):
    """bucket_bytes="auto": 25 MiB without a machine file; with TFHYBRID_MACHINE, the
    size fusion_bytes picks from the file's allreduce latency and bandwidth."""
    import json
    from tfhybrid.optimizer.distributed import DEFAULT_BUCKET_BYTES, fusion_bytes
    opt = DistributedOptimizer(keras.optimizers.SGD(0.1))
    assert opt.bucket_bytes == "auto" and opt.get_config()["bucket_bytes"] == "auto"
    items = [((0, 1), 1_000_000), ((0, 1), 675_176), ((), 0)]
    monkeypatch.delenv("TFHYBRID_MACHINE", raising=False)
    assert opt._bucket_size(items) == DEFAULT_BUCKET_BYTES
    slow, fast = tmp_path / "slow.json", tmp_path / "fast.json"
    for path, lat, beta in ((slow, 3e-3, 8.4e-8), (fast, 3e-4, 1e-9)):
        path.write_text(json.dumps({"alpha": 0.0, "beta": 0.0, "flop_rate": 1e9, "collectives": {
            "allreduce": {"latency": lat, "alpha": 0.0, "beta": beta}}}))
    monkeypatch.setenv("TFHYBRID_MACHINE", str(slow))
    small = opt._bucket_size(items)
    # p = 2: each rank sends half the bytes twice, so a payload byte costs beta
    assert small == fusion_bytes(1_675_176, 3e-3, 8.4e-8) == 244_597
    monkeypatch.setenv("TFHYBRID_MACHINE", str(fast))
    assert opt._bucket_size(items) == fusion_bytes(1_675_176, 3e-4, 1e-9) > small
    assert DistributedOptimizer(keras.optimizers.SGD(0.1), bucket_bytes=4096)._bucket_size(
        items) == 4096
    # a fast link where the square root asks for one bucket: a bucket closes at a
    # quarter of the bytes instead, so the last layers' gradients travel during
    # back-propagation and at most a quarter is left after it
    assert fusion_bytes(2_128_808, 9.7e-3, 2.5e-9) == 532_202
    assert fusion_bytes(1_675_176, 3.7e-3, 7.8e-9) == 418_794    # 1 Gbit/s, 4 buckets
    assert fusion_bytes(100_000, 1e-2, 1e-12) == 64 * 2**10     # never below 64 KiB
    monkeypatch.setenv("TFHYBRID_MACHINE", str(tmp_path / "missing.json"))
    with pytest.raises(ValueError, match="TFHYBRID_MACHINE=.*unset TFHYBRID_MACHINE"):
        opt._bucket_size(items)
