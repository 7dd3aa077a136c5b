"""DistributedOptimizer options under model.fit against single-process training:
fp16 compression, Lee et al.'s replicated FC gradients, and a model-parallel
grid (mp=2) with weights tagged "sharded".

Run under ``horovodrun -np 2`` and ``-np 4``; see test_optimizer_fit.py for
the reference and tolerances (fp16: rtol/atol 2e-3, since float16 keeps about
3 significant digits of each gradient).
"""
import pytest

import tfhybrid

from test_optimizer_fit import (LOSS, assert_weights_close, global_dataset, make_data,
                                make_model, make_optimizer, reference_weights, run_fit)


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
