"""What tfhybrid relies on in TensorFlow and Keras beyond their public API,
checked on the TensorFlow these tests run on (2.18.1, 2.19.1, 2.20.0 and
2.21.0 are supported, each with Keras 3.15.1). ``docs/horovod-patches.md``
lists every such item with the test that shows it; the items without a test
elsewhere are here. One process each (the allocator test starts one more, as its
allocator is chosen before TensorFlow starts)."""
import inspect
import json
import os
import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfhybrid
from tfhybrid import data
from tfhybrid.layers.spatial import core
from tests.fd_log import stderr_of

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _randn(shape, seed):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def _ancestors(op):
    """Names of the ops ``op`` waits for (data and control inputs, transitively)."""
    seen, todo = set(), [op]
    while todo:
        node = todo.pop()
        for parent in [t.op for t in node.inputs] + list(node.control_inputs):
            if parent.name not in seen:
                seen.add(parent.name)
                todo.append(parent)
    return seen


# -- TensorFlow ----------------------------------------------------------------------

def test_the_global_seed_is_read_where_the_checkpoint_records_it():
    """``tensorflow.python.eager.context.global_seed()`` (runtime.set_consistent_seed,
    checkpoint.gather_rng_state): None until a script sets one, then that seed."""
    from tensorflow.python.eager import context

    from tfhybrid import checkpoint

    tfhybrid.init()
    saved = context.global_seed()
    try:
        tf.random.set_seed(1234)
        model = keras.Sequential([keras.Input((2,)), keras.layers.Dropout(0.5, seed=1),
                                  keras.layers.Dense(1)])
        state = checkpoint.gather_rng_state(model)
        assert state["global_seed"] == 1234
        assert state["per_rank"].shape == (1, 1, 2)
        tf.random.set_seed(None)
        assert context.global_seed() is None
    finally:
        tf.random.set_seed(saved)


def test_tf_data_transformations_have_the_class_names_tfhybrid_walks(tmp_path):
    """tfhybrid.data reads a pipeline by its datasets' class names and
    ``_inputs()`` / ``_input_dataset`` / ``_batch_size`` / ``_drop_remainder``
    / ``_compression_type`` (their lookups fall back to "unknown" silently,
    so a renamed class would only lose the checks): every name it lists is
    the one this TensorFlow gives."""
    d = tf.data.Dataset.range(12)
    keeping = {"cache": d.cache(), "prefetch": d.prefetch(1), "repeat": d.repeat(2),
               "take": d.take(4), "skip": d.skip(2), "map": d.map(lambda x: x),
               "parallel map": d.map(lambda x: x, num_parallel_calls=2),
               "options": d.with_options(tf.data.Options()), "shuffle": d.shuffle(4),
               "assert_cardinality": d.apply(tf.data.experimental.assert_cardinality(12))}
    for what, ds in keeping.items():
        assert type(ds).__name__ in data._KEEPS_BLOCKS, (what, type(ds).__name__)
        assert ds._input_dataset is d, what
        assert len(ds._inputs()) == 1 and ds._inputs()[0] is d, what
    for what in ("cache", "prefetch", "map", "parallel map", "options", "shuffle"):
        name = type(keeping[what]).__name__
        assert any(k in name for k in data._SIZE_KEEPING), (what, name)
    batched = d.batch(5)
    assert data._batch_op(batched.map(lambda x: x).prefetch(1)) == (5, False, 12)
    assert data._batch_op(d.batch(5, drop_remainder=True, num_parallel_calls=2)) == (5, True, 12)
    names = data._pipeline(batched.unbatch())
    assert names[0] == "_UnbatchDataset" and "_BatchDataset" in names, names
    assert data._pipeline(tf.data.Dataset.from_tensor_slices([1, 2])) == ["_TensorSliceDataset"]
    path = str(tmp_path / "r.tfrecord")
    with tf.io.TFRecordWriter(path) as w:
        w.write(b"0")
    assert data._plain_tfrecords(tf.data.TFRecordDataset(path).map(lambda r: r).prefetch(1))
    assert not data._plain_tfrecords(tf.data.TFRecordDataset(path, compression_type="GZIP"))


def test_ops_made_after_reading_wait_for_the_batch():
    """guards.after_reading: an op the step makes inside the context (the loss
    tracker's count, a constant) depends on the batch read, so the call that
    meets the end of the data changes no state."""
    from tfhybrid.guards import after_reading

    count = tf.Variable(0.0)

    @tf.function
    def step(iterator):
        batch = iterator.get_next()
        with after_reading(batch):
            count.assign_add(tf.constant(1.0))
        return batch

    data_set = tf.data.Dataset.range(3).map(lambda i: tf.cast(i, tf.float32))
    graph = step.get_concrete_function(iter(data_set)).graph
    adds = [op for op in graph.get_operations() if op.type == "AssignAddVariableOp"]
    reads = {op.name for op in graph.get_operations() if op.type == "IteratorGetNext"}
    assert adds and reads and all(reads <= _ancestors(op) for op in adds)
    iterator = iter(data_set)
    for _ in range(3):
        step(iterator)
    with pytest.raises(tf.errors.OutOfRangeError):
        step(iterator)
    assert float(count.numpy()) == 3.0


def test_graph_tensors_carry_keras_logits():
    """splitbrain carries Keras' ``_keras_logits`` (an attribute Keras' softmax
    sets on a graph tensor, which its crossentropy reads instead of the
    clipped probabilities) across the model-parallel boundary."""
    from tfhybrid.layers.splitbrain import _attach_logits

    seen = {}

    @tf.function
    def loss(x, y_true):
        y = keras.activations.softmax(x)
        seen["keras"] = getattr(y, "_keras_logits", None) is not None
        moved = tf.identity(y)                  # what a collective returns: no logits
        _attach_logits(moved, tf.identity(x))
        seen["ours"] = getattr(moved, "_keras_logits", None) is not None
        return keras.losses.categorical_crossentropy(y_true, moved)

    x = tf.constant([[100.0, 0.0, 0.0]])
    got = float(loss(x, tf.constant([[0.0, 1.0, 0.0]]))[0])
    assert seen == {"keras": True, "ours": True}
    assert got == pytest.approx(100.0, rel=1e-5)   # the probability 3.7e-44 is below 1e-7


def test_zeros_framed_by_concatenation_keep_tensorflows_remapper():
    """TensorFlow's remapper fuses a Pad into the Conv3D it feeds and then fails
    on the Pad's other consumer (the gradient's ShapeN), dropping its fusions
    for the step (2.18.1, 2.19.1, 2.20.0 and 2.21.0 alike). core._zero_framed
    concatenates zeros instead: no Pad, no failure, the same gradients."""
    x, k = tf.constant(_randn((2, 4, 4, 4, 3), 0)), tf.constant(_randn((3, 3, 3, 3, 4), 1))
    pads = [(0, 0), (1, 1), (1, 1), (1, 1), (0, 0)]

    def step(frame):
        @tf.function
        def f():
            with tf.GradientTape() as tape:
                tape.watch([x, k])
                y = tf.nn.relu(tf.nn.conv3d(frame(x), k, [1] * 5, "VALID"))
                loss = tf.reduce_sum(y ** 2)
            return tape.gradient(loss, [x, k])
        return f

    framed = step(lambda t: core._zero_framed(t, pads))
    log = stderr_of(lambda: [t.numpy() for t in framed()])
    assert "remapper failed" not in log, log
    ops = framed.get_concrete_function().graph.get_operations()
    assert not [op.name for op in ops if op.type in ("Pad", "PadV2")]
    for a, b in zip(framed(), step(lambda t: tf.pad(t, pads))()):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-5, atol=1e-4)


@pytest.mark.skipif(bool(tf.config.list_logical_devices("GPU")), reason="CPU path only")
def test_thin_bfloat16_kernel_gradient_is_computed_in_float32():
    """core._same_kernel_grad: on CPU, a bfloat16 Conv3D kernel gradient of a
    block thinner than the window (oneDNN's bfloat16 filter gradient returned
    wrong values there, at random, under TF 2.18) is computed in float32 and
    equals float32's; a block as thick as the window keeps bfloat16."""
    def conv(t, kk, padding):
        return tf.nn.conv3d(t, kk, [1] * 5, padding.upper())

    grad = tf.function(lambda t, kk, dy: core._same_kernel_grad(conv, t, kk, dy, (3, 3, 3)))
    for thin, dtype in (((2, 8, 8), tf.float32), ((4, 4, 4), tf.bfloat16)):
        x, k, u = (tf.cast(tf.cast(v, tf.bfloat16), tf.float32) for v in (
            _randn((4, *thin, 4), 2), _randn((3, 3, 3, 4, 8), 3), _randn((4, *thin, 8), 4)))
        with tf.GradientTape() as tape:
            tape.watch(k)
            y = conv(x, k, "same")
        want = tape.gradient(y, k, output_gradients=u).numpy()
        args = [tf.cast(v, tf.bfloat16) for v in (x, k, u)]
        got = grad(*args)
        assert got.dtype == tf.bfloat16
        ops = grad.get_concrete_function(*args).graph.get_operations()
        filters = [op.get_attr("T") for op in ops if op.type.startswith("Conv3DBackpropFilter")]
        assert filters and set(filters) == {dtype}, (thin, filters)
        got = tf.cast(got, tf.float32).numpy()
        assert np.all(np.isfinite(got))
        np.testing.assert_allclose(got, want, atol=0.03 * np.max(np.abs(want)))


ALLOCATOR_SCRIPT = r"""
import glob, importlib.util, json, os, sys, tempfile
import tensorflow as tf
spec = importlib.util.spec_from_file_location("volume_memory", sys.argv[1])
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)
tf.config.experimental.reset_memory_stats("CPU:0")
a = tf.ones((512, 512))
tf.matmul(a, a).numpy()
peak = tf.config.experimental.get_memory_info("CPU:0")["peak"]
logdir = tempfile.mkdtemp()
tf.profiler.experimental.start(logdir)
tf.matmul(tf.ones((256, 256)), tf.ones((256, 256))).numpy()
tf.profiler.experimental.stop()
paths = glob.glob(os.path.join(logdir, "**", "*.xplane.pb"), recursive=True)
print(json.dumps({"peak": peak, "traces": len(paths),
                  "requested": bench.requested_peak(paths[0]) if paths else None}))
"""


def test_bfc_allocator_statistics_and_profiler_allocations():
    """bench/volume_memory.py --tensors/--trace: with TF_CPU_ALLOCATOR_USE_BFC=true,
    ``tf.config.experimental.get_memory_info("CPU:0")["peak"]`` counts the
    tensors, and a profiler trace (read with
    ``tensorflow.tsl.profiler.protobuf.xplane_pb2``) records MemoryAllocation
    events with ``addr`` and ``requested_bytes`` that requested_peak sums."""
    env = dict(os.environ, TF_CPU_ALLOCATOR_USE_BFC="true", TF_CPP_MIN_LOG_LEVEL="3",
               TF_NUM_INTRAOP_THREADS="1", TF_NUM_INTEROP_THREADS="1", CUDA_VISIBLE_DEVICES="")
    run = subprocess.run([sys.executable, "-c", ALLOCATOR_SCRIPT,
                          os.path.join(ROOT, "bench", "volume_memory.py")],
                         capture_output=True, text=True, env=env, timeout=300, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert got["peak"] >= 2 * 512 * 512 * 4, got          # a and a @ a
    assert got["traces"] == 1, got
    assert got["requested"] >= 256 * 256 * 4, got         # at least the product


# -- Keras (3.15.1 with every supported TensorFlow) -------------------------------------

def test_step_count_reads_the_applied_gradients_under_accumulation():
    """optimizer.slots.step_count reads Keras' ``_iterations``: under
    gradient_accumulation_steps, ``iterations`` is that count floor-divided."""
    from tfhybrid.optimizer.slots import set_step_count, step_count

    opt = keras.optimizers.SGD(0.1, gradient_accumulation_steps=2)
    v = keras.Variable(np.ones(3, np.float32))
    opt.build([v])
    for _ in range(3):
        opt.apply([tf.ones(3)], [v])
    assert step_count(opt) == 3 and int(opt.iterations.numpy()) == 1
    set_step_count(opt, 4)
    assert step_count(opt) == 4 and int(opt.iterations.numpy()) == 2


def _signature(fn):
    return list(inspect.signature(fn).parameters)


def test_keras_calls_the_private_methods_tfhybrid_overrides():
    """Keras calls ``_moments`` (SyncBatchNormalization), ``_apply_normalization``
    (SpatialGroupNormalization) and ``_get_metrics_result_or_logs`` (the guarded,
    pipeline and layer-separated models: at the end of each fit epoch and of
    evaluate), with the arguments tfhybrid's overrides take."""
    from tfhybrid.layers import SpatialGroupNormalization, SyncBatchNormalization

    BN, GN = keras.layers.BatchNormalization, keras.layers.GroupNormalization
    assert _signature(BN._moments) == _signature(SyncBatchNormalization._moments)
    assert _signature(GN._apply_normalization) == _signature(
        SpatialGroupNormalization._apply_normalization)
    calls = []

    def counted(layer, name):
        original = getattr(layer, name)
        object.__setattr__(layer, name, lambda *a: calls.append(name) or original(*a))

    bn, gn = BN(), GN(groups=2)
    counted(bn, "_moments")
    counted(gn, "_apply_normalization")
    bn(tf.ones((2, 4)), training=True)
    gn(tf.ones((2, 3, 4)))
    assert calls == ["_moments", "_apply_normalization"]

    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.compile(optimizer="sgd", loss="mse", metrics=["mae"])
    counted(model, "_get_metrics_result_or_logs")
    x, y = np.ones((4, 3), np.float32), np.zeros((4, 2), np.float32)
    calls.clear()
    model.fit(x, y, epochs=2, verbose=0)
    assert calls == ["_get_metrics_result_or_logs"] * 2
    calls.clear()
    assert isinstance(model.evaluate(x, y, verbose=0), list)   # _flatten_metrics_in_order
    assert calls == ["_get_metrics_result_or_logs"]
    assert model._flatten_metrics_in_order({"loss": 1.0, "mae": 2.0}) == [1.0, 2.0]


def test_keras_private_attributes_tfhybrid_reads():
    """The private attributes and entry points of Keras that tfhybrid reads or
    wraps exist with the shapes it assumes (the file reading each in brackets)."""
    from keras.src.models.functional import Functional           # transformer/graph.py
    from keras.src.saving import serialization_lib               # transformer/source.py
    from keras.src.utils import tracking                         # optimizer/distributed.py

    assert callable(tracking.no_automatic_dependency_tracking)
    with serialization_lib.SafeModeScope(False):
        assert not serialization_lib.in_safe_mode()

    inp = keras.Input((4,), name="x")
    out = keras.layers.Dense(2, name="d2")(keras.layers.Dense(3, name="d1")(inp))
    model = keras.Model(inp, out)
    assert isinstance(model, Functional)
    # transformer/graph.py, rewrite.py: the walk keras.models.clone_model uses
    assert _signature(model._run_through_graph) == ["inputs", "operation_fn", "call_fn"]
    again = model._run_through_graph(keras.Input((4,)), operation_fn=lambda op: op)
    assert tuple(again.shape) == (None, 2)
    assert model._inputs_struct is inp and model._outputs_struct is out
    assert sorted(model._nodes_by_depth) == [0, 1, 2]
    node = model.layers[1]._inbound_nodes[0]                      # volumes.py, layer_separation
    assert node.operation is model.layers[1] and not node.is_input
    assert node.input_tensors[0] is inp
    # guards/keras_hooks.py, checkpoint.py, transformer/source.py
    assert [layer.name for layer in model._flatten_layers(include_self=False, recursive=True)] \
        == ["x", "d1", "d2"]
    assert model.layers[1]._get_own_losses() == []               # layers/spatial/output.py

    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse",
                  metrics=[keras.losses.mean_squared_error])
    model.fit(np.ones((4, 4), np.float32), np.ones((4, 2), np.float32), verbose=0)
    compiled = model._compile_loss                                # batch_losses.py, output.py
    assert compiled.built and callable(compiled.build)
    entry = compiled._flat_losses[0]
    assert {"path", "loss"} <= set(entry._fields) and hasattr(entry, "_replace")
    assert callable(model._loss_tracker.update_state)             # batch_losses.weighted_rows
    metrics = model._compile_metrics                              # batch_losses.py, metrics.py
    assert metrics.built and isinstance(model._compile_metrics._flat_weighted_metrics, list)
    wrapper = metrics._flat_metrics[0].metrics[0]
    assert callable(wrapper._fn) and wrapper._fn_kwargs == {}
    assert "optimizer" in model._compile_config.config              # compose.py
    assert model._initial_epoch is None                             # guards/keras_hooks.py
    assert hasattr(model, "_eval_epoch_iterator")

    # layers: Lambda's output_shape (transformer/source.py), a conv's kernel (spatial/conv.py)
    lam = keras.layers.Lambda(lambda t: t, output_shape=lambda s: s)
    assert callable(lam._output_shape)
    conv = keras.layers.Conv3D(4, 3)
    conv.build((None, 4, 4, 4, 2))
    assert tuple(conv._kernel.shape) == (3, 3, 3, 2, 4)
    gn = keras.layers.GroupNormalization(groups=2)                  # spatial/group_norm.py
    assert gn._create_broadcast_shape((None, 4, 4)) == [1, 1, 2, 2]
    assert _signature(keras.layers.UpSampling2D._resize_images)[:5] == [   # spatial/upsample.py
        "self", "x", "height_factor", "width_factor", "data_format"]
    bn = keras.layers.BatchNormalization()                          # sync_bn.py
    bn.build((None, 3, 4))
    assert list(bn._reduction_axes) == [0, 1]

    # optimizers: weight-decay exclusions (checkpoint.py, guards/optimizers.py,
    # compose.py), the variable index (optimizer/distributed.py), the rate (callbacks.py)
    opt = keras.optimizers.AdamW(0.1)
    v = keras.Variable(np.ones(3, np.float32))
    opt.exclude_from_weight_decay(var_list=[v], var_names=["bias"])
    assert opt._exclude_from_weight_decay == {opt._var_key(v)}
    assert opt._exclude_from_weight_decay_pattern.pattern == "bias"
    assert hasattr(opt, "_exclude_from_weight_decay_cache")
    opt.build([v])
    assert opt._get_variable_index(v) == 0 and opt._trainable_variables == [v]
    assert opt._variables and isinstance(opt._learning_rate, keras.Variable)
