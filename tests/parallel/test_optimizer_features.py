"""DistributedOptimizer options under model.fit against single-process training:
fp16 compression, Lee et al.'s replicated FC gradients and delayed FC update, and
a model-parallel grid (mp=2) with weights tagged "sharded".

Run under ``horovodrun -np 2`` and ``-np 4``; see test_optimizer_fit.py for
the reference and tolerances (fp16: rtol/atol 2e-3, since float16 keeps about
3 significant digits of each gradient).
"""
import keras
import numpy as np
import pytest
import tensorflow as tf

import tfhybrid

from test_optimizer_fit import (GLOBAL_BATCH, LOSS, assert_weights_close, global_dataset,
                                make_data, make_model, make_optimizer, reference_weights,
                                run_fit)


@pytest.fixture
def dp(grid_of):
    return grid_of(1)


def test_fp16_compression(dp):
    x, y = make_data()
    model = run_fit("sgd", x, y, compression="fp16")
    assert model.optimizer.communication_plan()["payload_bytes"] == 2 * sum(
        w.size for w in model.get_weights())
    assert_weights_close(model.get_weights(), reference_weights("sgd", x, y), 2e-3, 2e-3)


class _HalfOfFloat32(tfhybrid.optimizer.Compressor):
    """A user-defined compressor: float16 on the wire, counted calls."""

    name = "user_fp16"
    calls = 0

    def compress(self, gradient):
        type(self).calls += 1
        return tfhybrid.optimizer.Compression.fp16.compress(gradient)

    def decompress(self, summed, context):
        return tfhybrid.optimizer.Compression.fp16.decompress(summed, context)

    def wire_itemsize(self, dtype):
        return tfhybrid.optimizer.Compression.fp16.wire_itemsize(dtype)


def test_user_defined_compressor_equals_fp16(dp):
    x, y = make_data()
    model = run_fit("sgd", x, y, compression=_HalfOfFloat32())
    assert _HalfOfFloat32.calls > 0
    assert model.optimizer.communication_plan()["payload_bytes"] == 2 * sum(
        w.size for w in model.get_weights())
    fp16 = run_fit("sgd", x, y, compression=tfhybrid.optimizer.Compression.fp16)
    assert_weights_close(model.get_weights(), fp16.get_weights(), 1e-6, 1e-6)


@pytest.mark.parametrize("kind", ["adam"])
def test_replicated_fc_gradients(dp, kind):
    """Lee et al.'s replicated gradients of the first 2 Dense layers are exact."""
    x, y = make_data()
    model = run_fit(kind, x, y, replicate_fc_gradients=2, bucket_bytes=100,
                    callbacks=tfhybrid.callbacks.standard())
    n_dense_vars = 4
    n_comm = sum(b["gradients"] for b in model.optimizer.communication_plan()["buckets"])
    if tfhybrid.grid().size > 1:
        assert n_comm == len(model.trainable_variables) - n_dense_vars
    assert_weights_close(model.get_weights(), reference_weights(kind, x, y))


def test_replicated_fc_needs_attach(dp):
    x, y = make_data()
    with pytest.raises(ValueError, match=r"replicate_fc_gradients=1.*attach\(model\)"):
        run_fit("sgd", x, y, replicate_fc_gradients=1)


def test_model_parallel_grid_with_sharded_tag(grid_of):
    """mp=2: a model group shares rows; tagged-sharded weights reduce over the data group."""
    grid = grid_of(2)
    x, y = make_data()
    model = make_model()
    for var in model.layers[-1].trainable_variables:
        tfhybrid.layout.set_layout(var, tfhybrid.layout.VariableLayout(kind="sharded"))
    model.compile(optimizer=tfhybrid.DistributedOptimizer(make_optimizer("sgd"), bucket_bytes=64),
                  loss=LOSS, jit_compile=False)
    model.fit(tfhybrid.data.shard(global_dataset(x, y)), epochs=1, verbose=0, shuffle=False)
    buckets = model.optimizer.communication_plan()["buckets"]
    if grid.data_size > 1:
        assert [b["ranks"] for b in buckets[:2]] == [list(grid.group("data").ranks)] * 2
    assert_weights_close(model.get_weights(), reference_weights("sgd", x, y))


def delayed_reference(kind, x, y, batch=GLOBAL_BATCH):
    """Lee et al.'s delayed FC update written out in one process: step t applies
    the Dense layers' gradient of step t-1 (zero at the first step)."""
    model = make_model()
    opt = make_optimizer(kind)
    opt.build(model.trainable_variables)
    fc = {id(v) for layer in model.layers if isinstance(layer, keras.layers.Dense)
          for v in layer.trainable_variables}
    previous = [tf.zeros_like(v) for v in model.trainable_variables]
    for start in range(0, len(x), batch):
        with tf.GradientTape() as tape:
            loss = LOSS(y[start:start + batch], model(x[start:start + batch], training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply([p if id(v) in fc else g
                   for g, p, v in zip(grads, previous, model.trainable_variables)],
                  model.trainable_variables)
        previous = grads
    return model.get_weights()


@pytest.mark.parametrize("kind", ["sgd", "adam"])
def test_delayed_fc_update(dp, kind):
    """delay_fc_update=True equals the delayed schedule run in one process, and is
    not the synchronous result (the option changes training, as documented)."""
    x, y = make_data(steps=4)
    model = run_fit(kind, x, y, delay_fc_update=True, bucket_bytes=100,
                    callbacks=tfhybrid.callbacks.standard())
    assert len(model.optimizer._delayed) == 6     # 3 Dense layers x (kernel, bias)
    assert_weights_close(model.get_weights(), delayed_reference(kind, x, y))
    synchronous = reference_weights(kind, x, y)
    assert max(np.abs(a - b).max() for a, b in zip(model.get_weights(), synchronous)) > 1e-3


def test_delayed_fc_update_needs_attach_and_a_bool(dp):
    x, y = make_data()
    with pytest.raises(ValueError, match=r"delay_fc_update=True.*attach\(model\)"):
        run_fit("sgd", x, y, delay_fc_update=True)
    with pytest.raises(ValueError, match=r"delay_fc_update.*'yes'"):
        tfhybrid.DistributedOptimizer(keras.optimizers.SGD(0.1), delay_fc_update="yes")
