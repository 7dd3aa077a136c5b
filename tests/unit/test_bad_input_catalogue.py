"""The bad-input catalogue: every bad argument or file a user
can hand tfhybrid, with the error type and a key phrase of the message.

One process. Each API case must raise (no case may pass silently); each CLI
case runs ``tfhybrid.cli.main`` in-process and must print one line per
problem on stderr (naming the argument or file) and exit with code 2, before
doing any work; two cases run the real console script to show that no
traceback reaches the user. A SIGALRM bound fails a case that hangs.
"""
import contextlib
import io
import json
import os
import re
import signal
import subprocess
import sys

import keras
import numpy as np
import pytest

import tfhybrid
from tfhybrid import cli, oracle
from tfhybrid.comm import p2p
from tests.pretend_grid import pretend
from tfhybrid.oracle import paradl_io

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MACHINE = os.path.join(ROOT, "tfhybrid", "oracle", "machines", "cpu_box.json")
CASE_SECONDS = 60


@pytest.fixture(autouse=True)
def _bounded():
    """A case that hangs fails instead of blocking the suite."""
    def timeout(*_):
        raise TimeoutError(f"bad-input case still running after {CASE_SECONDS} s (a hang)")
    old = signal.signal(signal.SIGALRM, timeout)
    signal.alarm(CASE_SECONDS)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, old)


def mlp(name="mlp"):
    i = keras.Input((8,))
    x = keras.layers.Dense(8, activation="relu", name="fc1")(i)
    return keras.Model(i, keras.layers.Dense(4, name="out")(x), name=name)


def on_filter_split(method, *args):
    """``model.<method>(*args)`` of an mlp transformed under f (split Dense layers)."""
    tfhybrid.shutdown()
    tfhybrid.init()
    try:
        return getattr(tfhybrid.transform(mlp(), "f"), method)(*args)
    finally:
        tfhybrid.shutdown()


def horovod_keras():
    import horovod.tensorflow.keras as hvd_keras
    return hvd_keras


class Subclassed(keras.Model):
    def __init__(self):
        super().__init__()
        self.fc = keras.layers.Dense(2)

    def call(self, x):
        return self.fc(x)


class NeedsK(keras.layers.Layer):
    """A custom layer whose get_config drops its constructor argument."""

    def __init__(self, k, **kwargs):
        super().__init__(**kwargs)
        self.k = k

    def get_config(self):
        return super().get_config()

    def call(self, x):
        return x * self.k


class Opaque:
    pass


class OpaqueConfig(keras.layers.Layer):
    """A custom layer whose config holds a Python object Keras cannot serialize."""

    def __init__(self, thing=None, **kwargs):
        super().__init__(**kwargs)
        self.thing = thing or Opaque()

    def get_config(self):
        return {**super().get_config(), "thing": self.thing}

    def call(self, x):
        return x


def with_layer(layer):
    i = keras.Input((8,))
    return keras.Model(i, keras.layers.Dense(4, name="out")(layer(i)))


def transformed():
    return tfhybrid.transform(mlp(), "d")


def world_of(size, model_parallel=1):
    """A pretend grid (no Horovod), as rank 0: for the pure row arithmetic of data.shard."""
    return pretend(size, 0, model_parallel)


def sharded_in_world_of_4(rows=12, **kwargs):
    with world_of(4):
        return tfhybrid.data.shard((np.zeros((rows, 2)), np.zeros(rows)), **kwargs)


def volume_model(filters=5, channels=2):
    i = keras.Input((4, 4, 4, channels))
    return keras.Model(i, keras.layers.Conv3D(filters, 3, name="conv3d")(i))


def split_output_loss(loss):
    """compute_loss of a transformed 2-D segmentation net (its output stays split
    under s) compiled with ``loss``: tfhybrid checks the loss's reduction."""
    i = keras.Input((8, 8, 1))
    seg = keras.layers.Conv2D(2, 3, padding="same", activation="softmax", name="seg")(i)
    tfhybrid.shutdown()
    tfhybrid.init()
    try:
        pmodel = tfhybrid.transform(keras.Model(i, seg), "s")
        pmodel.compile(loss=loss)
        x = np.ones((2, 8, 8, 1), np.float32)
        return pmodel.compute_loss(x, np.zeros((2, 8, 8)), pmodel(x))
    finally:
        tfhybrid.shutdown()


class _OwnCall(keras.losses.Loss):
    def __call__(self, y_true, y_pred, sample_weight=None):
        return keras.ops.mean(y_pred)


def in_world_of(size, model_parallel, fn):
    """``fn()`` on a pretend grid of ``size`` ranks (planning and layer checks only)."""
    with world_of(size, model_parallel):
        return fn()


def local_batch_in_world_of_4(batch):
    with world_of(4):
        return tfhybrid.data.local_batch_size(batch)


def init(**kwargs):
    tfhybrid.shutdown()
    try:
        return tfhybrid.init(**kwargs)
    finally:
        tfhybrid.shutdown()


def init_twice():
    tfhybrid.shutdown()
    try:
        tfhybrid.init(model_parallel=1)
        tfhybrid.init(model_parallel=2)
    finally:
        tfhybrid.shutdown()


SGD = keras.optimizers.SGD
D = tfhybrid.DistributedOptimizer
L = tfhybrid.layers
X = np.zeros((8, 2), "float32")

def nested_model(inner_name="b_c0", subclassed=False):
    """Transfer-learning style: a model called as a layer of the outer model
    (transform inlines it; these variants it cannot)."""
    if subclassed:
        class Block(keras.Model):
            def __init__(self):
                super().__init__(name="base")
                self.conv = keras.layers.Conv2D(4, 3, name=inner_name)

            def call(self, x):
                return self.conv(x)
        base = Block()
    else:
        base = keras.Sequential([keras.Input((8, 8, 2)),
                                 keras.layers.Conv2D(4, 3, name=inner_name)], name="base")
    inp = keras.Input((8, 8, 2))
    h = keras.layers.GlobalAveragePooling2D(name="gap")(base(inp))
    return keras.Model(inp, keras.layers.Dense(2, name="head")(h))


# (id, callable, exception type, regex found in the message)
API = [
    # -- init -------------------------------------------------------------------------
    ("init-mp-2-world-1", lambda: init(model_parallel=2), ValueError,
     r"model_parallel=2, world size 1; model_parallel must divide the world size"),
    ("init-mp-0", lambda: init(model_parallel=0), ValueError, r"model_parallel=0"),
    ("init-mp-str", lambda: init(model_parallel="2"), ValueError,
     r"expected a positive integer.*model_parallel='2'"),
    ("init-mp-float", lambda: init(model_parallel=1.0), ValueError, r"model_parallel=1\.0"),
    ("init-mp-bool", lambda: init(model_parallel=True), ValueError, r"model_parallel=True"),
    ("init-config-dict", lambda: init(config={"cycle_time_ms": 2}), TypeError,
     r"expected tfhybrid\.Config"),
    ("init-twice-different", init_twice, ValueError,
     r"already initialised with model_parallel=1; received model_parallel=2"),
    # -- Config -----------------------------------------------------------------------
    ("config-shutdown-below-check", lambda: tfhybrid.Config(stall_shutdown_seconds=10),
     ValueError, r"stall_shutdown_seconds=10 below stall_check_seconds=60: Horovod 0\.28\.1 "
                 r"then disables the stall shutdown"),
    ("config-check-0", lambda: tfhybrid.Config(stall_check_seconds=0), ValueError,
     r"stall_check_seconds=0; expected a positive number"),
    ("config-gloo-0", lambda: tfhybrid.Config(gloo_timeout_seconds=0), ValueError,
     r"gloo_timeout_seconds=0.*times out at once"),
    ("config-elastic-gloo-0", lambda: tfhybrid.Config(elastic_gloo_timeout_seconds=0),
     ValueError, r"elastic_gloo_timeout_seconds=0.*times out at once"),
    ("config-int-overflow", lambda: tfhybrid.Config(stall_shutdown_seconds=2**31),
     ValueError, r"at most 2147483647 seconds"),
    ("config-negative", lambda: tfhybrid.Config(stall_check_seconds=-5), ValueError,
     r"stall_check_seconds=-5; expected a non-negative integer"),
    ("config-str-seconds", lambda: tfhybrid.Config(stall_check_seconds="60"), ValueError,
     r"stall_check_seconds='60'"),
    ("config-cycle-nan", lambda: tfhybrid.Config(cycle_time_ms=float("nan")), ValueError,
     r"cycle_time_ms=nan; expected a finite"),
    ("config-fusion-fraction", lambda: tfhybrid.Config(fusion_threshold_bytes=1.5),
     ValueError, r"fusion_threshold_bytes=1\.5; expected a whole number of bytes"),
    ("config-fusion-negative", lambda: tfhybrid.Config(fusion_threshold_bytes=-1), ValueError,
     r"fusion_threshold_bytes=-1"),
    ("config-watchdog-seconds-0", lambda: tfhybrid.Config(watchdog_seconds=0), ValueError,
     r"watchdog_seconds=0"),
    # -- transform --------------------------------------------------------------------
    ("transform-f-nested-name-collision", lambda: tfhybrid.transform(nested_model("gap"), "f"),
     ValueError, r"two layers named 'gap' \(one inside a model used as a layer\).*Rename one"),
    ("transform-s-nested-subclassed", lambda: tfhybrid.transform(
        nested_model(subclassed=True), "s"), ValueError,
     r"Layer 'base' is a subclassed model \(Block\) used as a layer.*functional API"),
    ("transform-unknown-strategy", lambda: tfhybrid.transform(mlp(), "dp"), ValueError,
     r"unknown strategy: strategy='dp'"),
    ("transform-unknown-option", lambda: tfhybrid.transform(mlp(), "d", shards=2), ValueError,
     r"unknown option shards=2"),
    ("transform-option-wrong-strategy", lambda: tfhybrid.transform(mlp(), "d", mp=2),
     ValueError, r"mp=2 does not apply to strategy 'd'.*use strategy='gmp'"),
    ("transform-bad-mp", lambda: tfhybrid.transform(mlp(), "gmp", mp=0), ValueError,
     r"mp=0"),
    ("transform-bad-modulo", lambda: tfhybrid.transform(mlp(), "gmp", scheme="K"), ValueError,
     r"scheme='K'; expected one of"),
    ("transform-average-every-0", lambda: tfhybrid.transform(mlp(), "gmp", average_every=0),
     ValueError, r"average_every=0; expected a positive integer"),
    ("transform-average-every-float",
     lambda: tfhybrid.transform(mlp(), "gmp", average_every=2.5), ValueError,
     r"average_every=2\.5; expected a positive integer"),
    ("transform-averaging", lambda: tfhybrid.transform(mlp(), "gmp", averaging="ring"),
     ValueError, r"averaging='ring'; expected one of \('p2p', 'ps'\)"),
    ("transform-average-every-not-gmp", lambda: tfhybrid.transform(mlp(), "d", average_every=4),
     ValueError, r"average_every=4 does not apply to strategy 'd'"),
    ("transform-bad-fallback", lambda: tfhybrid.transform(mlp(), "d", fallback="skip"),
     ValueError, r"fallback='skip'"),
    ("transform-bad-batch-norm", lambda: tfhybrid.transform(mlp(), "d", batch_norm="global"),
     ValueError, r"batch_norm='global'; expected one of \('sync', 'local'\)"),
    ("transform-bad-layers", lambda: tfhybrid.transform(mlp(), "f", layers="fc1"), ValueError,
     r"expected a dict"),
    ("transform-bad-override", lambda: tfhybrid.transform(mlp(), "f", layers={"fc1": "x"}),
     ValueError, r"layers\['fc1'\]='x'"),
    ("transform-auto-no-batch", lambda: tfhybrid.transform(mlp(), "auto"), ValueError,
     r"strategy='auto' needs the global batch size"),
    ("transform-not-keras", lambda: tfhybrid.transform("model.keras", "d"), TypeError,
     r"invalid `model` of type str.*expected a built Keras 3 model"),
    ("transform-none", lambda: tfhybrid.transform(None, "d"), TypeError,
     r"invalid `model` of type NoneType"),
    ("transform-unbuilt", lambda: tfhybrid.transform(keras.Sequential([keras.layers.Dense(2)]),
                                                     "d"), ValueError,
     r"unbuilt Sequential model"),
    ("transform-subclassed", lambda: tfhybrid.transform(Subclassed(), "d"), ValueError,
     r"subclassed model.*functional API"),
    ("transform-twice", lambda: tfhybrid.transform(transformed(), "d"), ValueError,
     r"already transformed.*tfhybrid\.gather\(model\) first"),
    ("transform-custom-layer-no-config",
     lambda: tfhybrid.transform(with_layer(NeedsK(2.0, name="scale")), "d"), ValueError,
     r"cannot record layer 'scale' \(NeedsK.*missing 1 required positional argument: 'k'.*"
     r"register_keras_serializable"),
    ("transform-custom-layer-opaque-config",
     lambda: tfhybrid.transform(with_layer(OpaqueConfig(name="opaque")), "d"), ValueError,
     r"cannot record layer 'opaque'.*does not serialize to JSON"),
    # -- gather / describe ------------------------------------------------------------
    ("gather-original-model", lambda: tfhybrid.gather(mlp()), ValueError,
     r"which was not returned by tfhybrid\.transform"),
    ("gather-not-a-model", lambda: tfhybrid.gather("model.keras"), ValueError,
     r"'model\.keras', which was not returned by tfhybrid\.transform"),
    ("describe-original-model", lambda: tfhybrid.describe(mlp(), print_fn=None), ValueError,
     r"not returned by tfhybrid\.transform"),
    ("describe-bad-batch", lambda: tfhybrid.describe(transformed(), batch_size=0,
                                                     print_fn=None), ValueError,
     r"batch_size=0; expected the global batch size"),
    ("describe-bad-print-fn", lambda: tfhybrid.describe(transformed(), print_fn="stdout"),
     TypeError, r"invalid `print_fn`"),
    # -- DistributedOptimizer ---------------------------------------------------------
    ("optimizer-class", lambda: D(SGD), TypeError, r"Received the class SGD.*pass an instance"),
    ("optimizer-not-optimizer", lambda: D(42), TypeError, r"invalid `optimizer`: 42"),
    ("optimizer-wrapped-twice", lambda: D(D(SGD(0.1))), ValueError, r"wrap the plain Keras "
                                                                    r"optimizer once"),
    ("optimizer-bucket-0", lambda: D(SGD(0.1), bucket_bytes=0), ValueError, r"bucket_bytes=0"),
    ("optimizer-compression", lambda: D(SGD(0.1), compression="int8"), ValueError,
     r"compression='int8'; expected one of"),
    ("optimizer-op", lambda: D(SGD(0.1), op="max"), ValueError, r"op='max'"),
    ("optimizer-passes-0", lambda: D(SGD(0.1), backward_passes_per_step=0), ValueError,
     r"backward_passes_per_step=0"),
    ("optimizer-fc-negative", lambda: D(SGD(0.1), replicate_fc_gradients=-1), ValueError,
     r"replicate_fc_gradients=-1"),
    # -- callbacks --------------------------------------------------------------------
    ("callbacks-warmup-without-target",
     lambda: tfhybrid.callbacks.standard(warmup_steps=100), ValueError,
     r"warmup_steps=100 without `target_lr`"),
    ("callbacks-root-rank-outside-world", lambda: tfhybrid.callbacks.standard(root_rank=3),
     ValueError, r"root_rank=3; expected 0 <= root_rank < world size 1"),
    ("callbacks-root-rank-str", lambda: tfhybrid.callbacks.standard(root_rank="0"),
     ValueError, r"root_rank='0'"),
    ("callbacks-warmup-negative-lr",
     lambda: tfhybrid.callbacks.LearningRateWarmupCallback(target_lr=-0.1, warmup_steps=10),
     ValueError, r"`target_lr`: -0\.1"),
    ("callbacks-broadcast-root", lambda: tfhybrid.callbacks.broadcast_model(mlp(), root_rank=2),
     ValueError, r"root_rank=2"),
    # -- data -------------------------------------------------------------------------
    ("shard-arrays-without-batch-size", lambda: tfhybrid.data.shard((X, X)), ValueError,
     r"`batch_size`: None; expected the global batch size"),
    ("shard-batch-size-0", lambda: tfhybrid.data.shard(X, batch_size=0), ValueError,
     r"`batch_size`: 0"),
    ("shard-wrong-type", lambda: tfhybrid.data.shard("train.csv"), TypeError,
     r"invalid `dataset` of type str"),
    ("shard-batch-size-positional", lambda: tfhybrid.data.shard((X, X), 64), TypeError,
     r"invalid `model`: 64.*batch_size=64"),
    ("shard-arrays-of-different-lengths",
     lambda: tfhybrid.data.shard((X, np.zeros(6)), batch_size=4), ValueError,
     r"arrays of different lengths \[6, 8\]"),
    ("shard-no-arrays", lambda: tfhybrid.data.shard((), batch_size=4), ValueError,
     r"no arrays to shard"),
    ("shard-indivisible-batch", lambda: sharded_in_world_of_4(batch_size=6), ValueError,
     r"global batch of 6 rows cannot be split evenly over 4"),
    ("shard-indivisible-last-batch", lambda: sharded_in_world_of_4(rows=10, batch_size=8), ValueError,
     r"global batch of 2 rows cannot be split evenly over 4 .*\(the last batch of 10 samples"),
    ("local-batch-indivisible", lambda: local_batch_in_world_of_4(10), ValueError,
     r"global batch of 10 rows cannot be split evenly over 4"),
    ("local-batch-0", lambda: tfhybrid.data.local_batch_size(0), ValueError,
     r"`global_batch`: 0"),
    ("volumes-wrong-type", lambda: tfhybrid.data.volumes(42, batch_size=2), TypeError,
     r"volumes: Received x of type int; expected a \.npy path"),
    ("volumes-missing-file", lambda: tfhybrid.data.volumes("missing.npy", batch_size=2),
     ValueError, r"x='missing\.npy'; expected an existing \.npy file"),
    ("volumes-indivisible-depth", lambda: in_world_of(4, 4, lambda: tfhybrid.data.volumes(
        np.zeros((4, 6, 4, 4, 1), np.float32), batch_size=2, spatial="depth")), ValueError,
     r"depth=6 is not divisible by 4; use a multiple of 4"),
    ("volumes-different-lengths", lambda: tfhybrid.data.volumes(
        np.zeros((4, 4, 4, 4, 1)), np.zeros(3), batch_size=2), ValueError,
     r"x of 4 samples and y of 3"),
    ("volumes-bad-shuffle", lambda: tfhybrid.data.volumes(
        np.zeros((4, 4, 4, 4, 1)), batch_size=2, shuffle=-1), ValueError, r"`shuffle`: -1"),
    # -- layers -----------------------------------------------------------------------
    ("layer-spatial-transpose-output-padding",
     lambda: L.SpatialConv2DTranspose(4, 3, strides=2, output_padding=1, name="up"), ValueError,
     r"'up': Received output_padding=\(1, 1\); spatial transposed convolutions support "
     r"output_padding=None only.*Keep this layer replicated"),
    ("layer-spatial-transpose-dilation",
     lambda: L.SpatialConv3DTranspose(4, 3, dilation_rate=2, name="up"), ValueError,
     r"'up': Received dilation_rate=\(2, 2, 2\); .*dilation_rate=1 only"),
    ("layer-filter-dense-units", lambda: L.FilterParallelDense(0), ValueError, r"units=0"),
    ("layer-channel-dense-units", lambda: L.ChannelParallelDense(-3), ValueError,
     r"units=-3"),
    ("layer-filter-conv-filters", lambda: L.FilterParallelConv2D(0, 3), ValueError,
     r"filters=0"),
    ("layer-filter-conv3d-indivisible",
     lambda: in_world_of(4, 4, lambda: L.FilterParallelConv3D(6, 3, name="v")), ValueError,
     r"'v': filters=6 is not divisible by the 4 ranks of the 'model' group .*use a multiple "
     r"of 4 \(e\.g\. 4 or 8\) or a group size that divides 6"),
    ("layer-channel-conv3d-indivisible",
     lambda: in_world_of(4, 4, lambda: L.ChannelParallelConv3D(4, 3, name="v").build(
         (None, 4, 4, 4, 6))), ValueError, r"'v': input channels=6 is not divisible by the 4"),
    ("layer-conv3d-kernel-size", lambda: L.FilterParallelConv3D(4, (3, 3)), ValueError,
     r"`kernel_size`, expected a positive int or a tuple of 3 of them\. Received: "
     r"kernel_size=\(3, 3\)"),
    ("transform-f-conv3d-filters",
     lambda: in_world_of(2, 2, lambda: tfhybrid.transform(volume_model(5), "f")), ValueError,
     r"'conv3d' \(Conv3D\) cannot be made filter-parallel under strategy 'f': filters=5 is "
     r"not divisible by the model group size 2\. Use fallback='replicate'"),
    ("transform-c-conv3d-channels",
     lambda: in_world_of(4, 4, lambda: tfhybrid.transform(volume_model(4, 2), "c")),
     ValueError, r"'conv3d' \(Conv3D\).*its 2 input channels are not divisible by the model "
     r"group size 4\. Use fallback='replicate'.*or run on 2 ranks"),
    ("transform-p-stages-not-model-group",
     lambda: in_world_of(2, 2, lambda: tfhybrid.transform(mlp(), "p", stages=4)), ValueError,
     r"stages=4, but the model groups of this grid have 2 ranks.*"
     r"tfhybrid.init\(model_parallel=4\)"),
    ("transform-p-one-stage", lambda: tfhybrid.transform(mlp(), "p"), ValueError,
     r"strategy='p' needs at least 2 stages.*model_parallel=S"),
    ("transform-p-more-stages-than-cuts",
     lambda: in_world_of(4, 4, lambda: tfhybrid.transform(mlp(), "p", stages=4)), ValueError,
     r"stages=4 for model 'mlp', which can be cut at only 1 places.*Use stages <= 2"),
    ("transform-p-micro-batches-0",
     lambda: in_world_of(2, 2, lambda: tfhybrid.transform(mlp(), "p", micro_batches=0)),
     ValueError, r"micro_batches=0; expected a positive integer"),
    ("p-micro-batches-not-dividing",
     lambda: __import__("tfhybrid.transformer.pipeline", fromlist=["x"]).check_micro_batches(
         4, 6), ValueError, r"micro_batches=4, which does not divide the local batch of 6 "
                            r"rows.*Use micro_batches in \[1, 2, 3, 6\]"),
    ("layer-output-layout", lambda: L.FilterParallelDense(4, output_layout="sharded"),
     ValueError, r"output_layout='sharded'; expected one of"),
    ("layer-group", lambda: L.FilterParallelDense(4, group="rows"), ValueError,
     r"invalid group name: 'rows'"),
    ("layer-from-wrong-layer", lambda: L.FilterParallelDense.from_layer(keras.layers.Conv2D(2, 3)),
     TypeError, r"from_layer expects a keras\.layers\.Dense; received Conv2D"),
    ("layer-from-unbuilt", lambda: L.FilterParallelDense.from_layer(keras.layers.Dense(2)),
     ValueError, r"is not built"),
    ("layer-sync-bn-synchronized", lambda: L.SyncBatchNormalization(synchronized=True),
     ValueError, r"synchronized=True"),
    ("layer-sync-bn-no-groups", lambda: L.SyncBatchNormalization(groups=()), ValueError,
     r"groups=\(\)"),
    ("layer-modulo-b-over-k-without-body", lambda: L.ModuloLayer(scheme="B/K"), ValueError,
     r"pass body="),
    ("layer-modulo-scheme", lambda: L.ModuloLayer(scheme="KB"), ValueError, r"scheme='KB'"),
    ("layer-modulo-b-without-body", lambda: L.ModuloLayer(scheme="B"), ValueError,
     r"scheme='B' runs the model-parallel region K times.*pass body="),
    ("layer-shard-axis", lambda: L.ShardLayer(axis="x"), ValueError, r"axis='x'"),
    # -- point-to-point primitives (tfhybrid.comm.p2p; checked before any collective) ----
    ("p2p-send-recv-dst", lambda: in_world_of(4, 1, lambda: p2p.send_recv(
        np.zeros((2, 3), "float32"), 0, 4, group="world")), ValueError,
     r"send_recv: Received an invalid value for `dst`: dst=4; expected the index of a rank "
     r"of the world group, an integer in \[0, 4\)"),
    ("p2p-gather-to-root", lambda: in_world_of(4, 2, lambda: p2p.gather_to(
        np.zeros((2, 3), "float32"), root=2, group="model")), ValueError,
     r"gather_to: Received an invalid value for `root`: root=2.*\[0, 2\)"),
    ("p2p-scatter-sizes-length", lambda: in_world_of(4, 1, lambda: p2p.scatter_from(
        np.zeros((2, 3), "float32"), 0, [1, 1], group="world")), ValueError,
     r"sizes=\[1, 1\]; expected 4 non-negative integers"),
    ("p2p-scatter-sizes-sum", lambda: in_world_of(4, 1, lambda: p2p.scatter_from(
        np.zeros((3, 3), "float32"), 0, [1, 1, 0, 0], group="world")), ValueError,
     r"sizes=\[1, 1, 0, 0\]; expected row counts adding up to the 3 rows of x"),
    ("p2p-token-scalar", lambda: p2p.token(np.float32(0)), ValueError,
     r"token: .*expected a tensor of rank >= 1"),
    # -- losses of outputs split into spatial blocks (s/ds) ------------------------------
    ("split-output-loss-reduction-none", lambda: split_output_loss(
        keras.losses.SparseCategoricalCrossentropy(reduction=None)), ValueError,
     r"loss 'sparse_categorical_crossentropy' of the split output 'seg' has reduction=None.*"
     r"Use 'sum_over_batch_size'"),
    ("split-output-loss-own-call", lambda: split_output_loss(_OwnCall(name="own")),
     ValueError, r"loss 'own' of the split output 'seg' overrides Loss.__call__.*Override `call`"),
    ("volumes-sample-weight-without-y", lambda: tfhybrid.data.volumes(
        np.zeros((4, 4, 4, 4, 1), "float32"), batch_size=2,
        sample_weight=np.ones(4, "float32")), ValueError,
     r"Received sample_weight without y; give the labels"),
    ("volumes-weights-per-output-count", lambda: tfhybrid.data.volumes(
        np.zeros((4, 4, 4, 4, 1), "float32"), (np.zeros((4, 4, 4, 4)), np.zeros((4, 1))),
        batch_size=2, sample_weight=(np.ones(4, "float32"),)), ValueError,
     r"Received 1 sample_weight sources for 2 label sources; give one per output"),
    # -- Keras' own save/load on a transformed model with split layers ------------------
    ("keras-save-of-split-model", lambda: on_filter_split("save", "/tmp/never.keras"),
     ValueError, r"model.save\(\) of transformed model 'mlp' would write only this rank's part"
     r".*Use tfhybrid.save\(model, path\) on every rank"),
    ("keras-save-weights-of-split-model",
     lambda: on_filter_split("save_weights", "/tmp/never.weights.h5"), ValueError,
     r"save_weights\(\).*tfhybrid.gather\(model\) on every rank"),
    ("keras-load-weights-into-split-model",
     lambda: on_filter_split("load_weights", "/tmp/never.weights.h5"), ValueError,
     r"Load full weights into the original model before tfhybrid.transform.*tfhybrid.load"),
    # -- Horovod's Keras API (written for tf.keras 2) on a transformed model ------------
    ("horovod-keras-optimizer", lambda: on_filter_split(
        "compile", horovod_keras().DistributedOptimizer(keras.optimizers.SGD(0.1)), "mse"),
     ValueError, r"horovod.tensorflow.keras.DistributedOptimizer \(SGD\).*"
     r"Use tfhybrid.DistributedOptimizer\(keras.optimizers.SGD\(...\)\)"),
    ("horovod-keras-callback", lambda: on_filter_split(
        "fit", np.zeros((2, 8), "float32"), np.zeros((2, 4), "float32"), 2, 1, 0,
        [horovod_keras().callbacks.BroadcastGlobalVariablesCallback(0)]), ValueError,
     r"Horovod's Keras callback BroadcastGlobalVariablesCallback.*"
     r"Use tfhybrid.callbacks.BroadcastGlobalVariablesCallback\(...\)"),
    # -- oracle and ParaDL files (API) ------------------------------------------------
    ("oracle-unknown-strategy",
     lambda: oracle.rank(oracle.profile(mlp()), 4, 64, MACHINE, strategies=("dp",)),
     ValueError, r"unknown strategies \['dp'\]"),
    ("oracle-bad-fallback",
     lambda: oracle.predict(oracle.profile(mlp()), "f", 2, 64, MACHINE, fallback="skip"),
     ValueError, r"fallback='skip'.*'replicate'"),
    ("oracle-missing-machine", lambda: oracle.as_machine("/no/such/machine.json"), ValueError,
     r"does not exist; create one with"),
    ("oracle-machine-missing-keys", lambda: oracle.as_machine({"alpha": 1e-5}), ValueError,
     r"lacks required keys \['beta'\]"),
    ("oracle-machine-unknown-key",
     lambda: oracle.as_machine({"alpha": 0, "beta": 0, "flop_rate": 1e9, "bandwidth": 1}),
     ValueError, r"Unknown machine keys \['bandwidth'\]"),
    ("paradl-net-malformed", lambda: paradl_io.parse_net_text("CONV1|3x8x8"), ValueError,
     r"\.net line 1"),
    ("paradl-lc-malformed", lambda: paradl_io.parse_lc_text("CONV1 yes"), ValueError,
     r"\.lc line 1"),
    ("paradl-plat-zero-bandwidth",
     lambda: paradl_io.machine_from_plat({"LATENCY": 1e-6, "BANDWIDTH": 0, "NODE_SPEED": 1e12}),
     ValueError, r"BANDWIDTH=0.*positive"),
    ("paradl-plat-not-a-number", lambda: paradl_io.parse_plat_text("BANDWIDTH|fast|B/s"),
     ValueError, r"\.plat line 1"),
]


@pytest.mark.parametrize("fn,exc,phrase", [c[1:] for c in API], ids=[c[0] for c in API])
def test_api_bad_input(fn, exc, phrase):
    with pytest.raises(exc) as info:
        fn()
    message = str(info.value)
    assert type(info.value) is exc or issubclass(type(info.value), exc)
    assert re.search(phrase, message, re.S), message
    assert "Traceback" not in message


# -- CLI ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("bad_inputs")
    paths = {
        "bad.json": '{"alpha": 1e-5,',
        "list.json": "[1, 2]",
        "corrupt.keras": "not a zip file",
        "zero_flops.json": json.dumps({"alpha": 1e-5, "beta": 1e-9, "flop_rate": 0}),
        "unknown_key.json": json.dumps({"alpha": 1e-5, "beta": 1e-9, "flop_rate": 1e9,
                                        "bandwidth": 1e9}),
        "bad.net": "garbage line\n",
        "empty.net": "# no layers\nModel|empty\n",
        "ok.net": "Input|100x3x8x8\nCONV1|3x8x8|3x4x3x3|4x8x8\nFC1|256|256x10|10\n",
        "bad.lc": "0 CONV9 |1\n1 FC1 |0\n",
        "zero.plat": "LATENCY|5e-7|s\nBANDWIDTH|0|B/s\nNODE_SPEED|7.8e12|FLOP/s\n",
        "bad.plat": "LATENCY|fast|s\n",
        "ok.plat": "LATENCY|5e-7|s\nBANDWIDTH|12.5e9|B/s\nNODE_SPEED|7.8e12|FLOP/s\n",
    }
    for name, text in paths.items():
        (d / name).write_text(text)
    keras.Sequential([keras.Input((4,))], name="empty").save(str(d / "empty.keras"))
    i = keras.Input((4,))
    keras.Model(i, keras.layers.Flatten()(i), name="flat").save(str(d / "flat.keras"))
    (d / "outdir").mkdir()
    return {k: str(d / k) for k in list(paths) + ["empty.keras", "flat.keras", "outdir"]}


def fill(argv, files):
    """``{name}`` in an argument -> the path of the fixture's file ``name``."""
    return [re.sub(r"\{([^}]+)\}", lambda m: files[m.group(1)], a) for a in argv]


def run_cli(argv):
    """(exit code, stderr) of ``tfhybrid ARGV`` run in this process."""
    err, out = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        try:
            code = cli.main(argv)
        except SystemExit as exit_:
            code = exit_.code
    return code, err.getvalue(), out.getvalue()


PLAN = ["plan", "alexnet", "--np", "4", "--batch", "64", "--machine", MACHINE]
PARADL = ["plan", "--paradl-net", "{ok.net}", "--paradl-plat", "{ok.plat}", "--np", "4",
          "--batch", "64"]

# (id, argv ({name} = a file of the fixture), regex on stderr, expected number of lines)
CLI = [
    ("plan-unknown-strategy", PLAN + ["--strategies", "d,dp"],
     r"--strategies 'd,dp': unknown strategy 'dp'; expected a comma-separated subset", 1),
    ("plan-empty-strategies", PLAN + ["--strategies", ""], r"--strategies '': unknown", 1),
    ("plan-np-0", ["plan", "alexnet", "--np", "0", "--batch", "64"],
     r"--np 0: expected a positive integer", 1),
    ("plan-batch-negative", ["plan", "alexnet", "--np", "4", "--batch", "-8"],
     r"--batch -8: expected a positive integer", 1),
    ("plan-np-not-int", ["plan", "alexnet", "--np", "four", "--batch", "64"],
     r"argument --np: invalid int value: 'four' \(see `tfhybrid plan --help`\)", 1),
    ("plan-dataset-size-0", PLAN + ["--dataset-size", "0"], r"--dataset-size 0", 1),
    ("plan-unknown-model", ["plan", "vgg17", "--np", "4", "--batch", "64"],
     r"MODEL 'vgg17': unknown model; expected a \.keras file or one of", 1),
    ("plan-missing-keras-file", ["plan", "/no/such/m.keras", "--np", "4", "--batch", "64"],
     r"MODEL /no/such/m\.keras: file not found", 1),
    ("plan-no-model", ["plan", "--np", "4", "--batch", "64"], r"MODEL: missing", 1),
    ("plan-empty-model", ["plan", "{empty.keras}", "--np", "4", "--batch", "64",
                          "--machine", MACHINE],
     r"empty\.keras: model 'empty' has no layer with weights or compute \(an empty model\)", 1),
    ("plan-model-without-compute", ["plan", "{flat.keras}", "--np", "4", "--batch", "64",
                                    "--machine", MACHINE], r"an empty model", 1),
    ("plan-missing-machine", ["plan", "alexnet", "--np", "4", "--batch", "64", "--machine",
                              "/no/such/m.json"],
     r"--machine /no/such/m\.json: file not found; create one with `horovodrun", 1),
    ("plan-machine-is-dir", ["plan", "alexnet", "--np", "4", "--batch", "64", "--machine",
                             "{outdir}"], r"--machine .*outdir: is a directory", 1),
    ("plan-malformed-machine", ["plan", "alexnet", "--np", "4", "--batch", "64", "--machine",
                                "{bad.json}"],
     r"--machine .*bad\.json: not valid JSON \(.* at line 1 column 16\)", 1),
    ("plan-machine-not-an-object", ["plan", "alexnet", "--np", "4", "--batch", "64",
                                    "--machine", "{list.json}"],
     r"list\.json: TypeError: `machine` must be a dict.*received list", 1),
    ("plan-corrupt-keras-file", ["plan", "{corrupt.keras}", "--np", "4", "--batch", "64",
                                 "--machine", MACHINE],
     r"MODEL .*corrupt\.keras: .*give a model saved with model\.save", 1),
    ("plan-machine-zero-flops", ["plan", "alexnet", "--np", "4", "--batch", "64", "--machine",
                                 "{zero_flops.json}"],
     r"zero_flops\.json: .*`flop_rate`=0\.0; expected a positive", 1),
    ("plan-machine-unknown-key", ["plan", "alexnet", "--np", "4", "--batch", "64", "--machine",
                                  "{unknown_key.json}"],
     r"unknown_key\.json: Unknown machine keys \['bandwidth'\]", 1),
    ("plan-json-dir-missing", PLAN + ["--json", "/no/such/dir/plan.json"],
     r"--json /no/such/dir/plan\.json: directory /no/such/dir does not exist", 1),
    ("plan-png-dir-missing", PLAN + ["--png", "/no/such/dir/plan.png"],
     r"--png /no/such/dir/plan\.png: directory /no/such/dir does not exist", 1),
    ("plan-json-is-dir", PLAN + ["--json", "{outdir}"], r"--json .*outdir: is a directory", 1),
    ("plan-paradl-missing-net", ["plan", "--paradl-net", "/no/such.net", "--paradl-plat",
                                 "{ok.plat}", "--np", "4", "--batch", "64"],
     r"--paradl-net /no/such\.net: file not found", 1),
    ("plan-paradl-malformed-net", ["plan", "--paradl-net", "{bad.net}", "--paradl-plat",
                                   "{ok.plat}", "--np", "4", "--batch", "64"],
     r"--paradl-net .*bad\.net: ParaDL \.net line 1 'garbage line'", 1),
    ("plan-paradl-empty-net", ["plan", "--paradl-net", "{empty.net}", "--paradl-plat",
                               "{ok.plat}", "--np", "4", "--batch", "64"],
     r"empty\.net: has no layer lines", 1),
    ("plan-paradl-zero-bandwidth", ["plan", "--paradl-net", "{ok.net}", "--paradl-plat",
                                    "{zero.plat}", "--np", "4", "--batch", "64"],
     r"--paradl-plat .*zero\.plat: ParaDL platform BANDWIDTH=0\.0; expected a positive", 1),
    ("plan-paradl-malformed-plat", ["plan", "--paradl-net", "{ok.net}", "--paradl-plat",
                                    "{bad.plat}", "--np", "4", "--batch", "64"],
     r"bad\.plat: ParaDL \.plat line 1", 1),
    ("plan-paradl-lc-mismatch", PARADL + ["--paradl-lc", "{bad.lc}"],
     r"--paradl-lc .*bad\.lc: Layer configuration entry 0 is 'CONV9'", 1),
    ("plan-paradl-without-machine", ["plan", "--paradl-net", "{ok.net}", "--np", "4",
                                     "--batch", "64"], r"needs the machine: add --paradl-plat",
     1),
    ("plan-paradl-and-model", PARADL + ["vgg16"], r"give one model", 1),
    ("plan-lc-without-net", PLAN + ["--paradl-lc", "{bad.lc}"],
     r"--paradl-lc .*: applies only with --paradl-net", 1),
    ("plan-every-problem-at-once", ["plan", "vgg17", "--np", "0", "--batch", "64",
                                    "--strategies", "zz", "--machine", "/no/m.json",
                                    "--json", "/no/dir/x.json"],
     r"--np 0.*\n.*--strategies 'zz'.*\n.*MODEL 'vgg17'.*\n.*--machine /no/m\.json.*\n"
     r".*--json /no/dir/x\.json", 5),
    ("no-command", [], r"tfhybrid: error: the following arguments are required: command", 1),
    ("unknown-command", ["frobnicate"], r"invalid choice: 'frobnicate'", 1),
    ("calibrate-output-dir-missing", ["calibrate", "-o", "/no/such/dir/m.json"],
     r"-o /no/such/dir/m\.json: directory /no/such/dir does not exist", 1),
    ("calibrate-one-size", ["calibrate", "-o", "{outdir}/m.json", "--sizes", "1"],
     r"--sizes 1: .*at least 2", 1),
    ("calibrate-reps-0", ["calibrate", "-o", "{outdir}/m.json", "--reps", "0"],
     r"--reps 0: expected a positive integer", 1),
    ("calibrate-small-max-bytes", ["calibrate", "-o", "{outdir}/m.json", "--max-bytes", "10"],
     r"--max-bytes 10: expected at least 4096", 1),
    ("calibrate-unknown-model", ["calibrate", "-o", "{outdir}/m.json", "--model", "vgg17"],
     r"--model 'vgg17': unknown model", 1),
]


@pytest.mark.parametrize("argv,phrase,lines", [c[1:] for c in CLI], ids=[c[0] for c in CLI])
def test_cli_bad_input(files, argv, phrase, lines):
    code, err, out = run_cli(fill(argv, files))
    assert code == 2, (code, err, out)
    assert re.search(phrase, err), err
    got = err.strip().splitlines()
    assert len(got) == lines, err
    assert all(line.startswith("tfhybrid") and ": error: " in line for line in got), err
    assert "Traceback" not in err and "wrote" not in out   # refused before doing the work


def test_cli_good_paradl_input_still_plans(files):
    """The fixture's valid files plan (so the bad ones fail for the stated reason)."""
    code, err, out = run_cli(fill(PARADL, files) + ["--strategies", "d,f"])
    assert code == 0, err
    assert " d " in out and " f " in out


@pytest.mark.parametrize("argv,phrase", [
    (["plan", "vgg16", "--np", "4", "--batch", "64", "--strategies", "d,dp", "--json",
      "/no/such/dir/plan.json"], r"unknown strategy 'dp'.*\n.*directory /no/such/dir does not"),
    (["plan", "--paradl-net", "/no/such.net", "--paradl-plat", "/no/such.plat", "--np", "4",
      "--batch", "64"], r"--paradl-net /no/such\.net: file not found.*\n.*--paradl-plat"),
], ids=["console-script-plan-args", "console-script-paradl-files"])
def test_console_script_prints_no_traceback(argv, phrase):
    exe = os.path.join(os.path.dirname(sys.executable), "tfhybrid")
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([exe, *argv], capture_output=True, text=True, timeout=120, env=env,
                          cwd=ROOT)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert re.search(phrase, proc.stderr), proc.stderr
    assert proc.stdout == ""


def test_catalogue_size():
    assert len(API) + len(CLI) + 2 >= 40
