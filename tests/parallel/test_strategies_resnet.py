"""keras.applications.ResNet50 (weights=None, 32x32x3, 10 classes) under every
strategy its shapes allow, trained exactly like the single-process original.

Run under ``horovodrun -np 2`` and ``-np 4``. For each strategy one
transformed model is fitted for STEPS step(s) of SGD (global batch 8,
float32), then evaluated and used to predict; its gathered weights must equal
those of single-process ``fit`` of the unmodified model on the same global
batches (``assert_allclose(rtol=1e-4, atol=1e-6)``), its predictions the
single-process predictions of the same rows and its world-averaged
``evaluate`` the single-process ``evaluate`` of the global batch.

Cases: -np 2: d, f (= df on one model group), c, s (= ds on one model group),
gmp. -np 4 (d over 4 ranks is d over 2 with a larger world group, left to
-np 2 for time): f and c over 4 ranks, s on a 2x2 block grid (the stem's 38
padded rows do not split over 4 ranks along height, so a height split would
leave nothing spatial), df, ds and gmp with model groups of 2 (gmp
partitions the 10-unit classifier; 10 does not split over 4). f and c keep
the layers that do not divide (the 10-unit classifier; conv1's 3 input
channels) replicated (``fallback="replicate"``). The spatial region of s/ds is
the default one: the stem (ZeroPadding2D, 7x7/2 conv, ZeroPadding2D,
3x3/2 max pool) and every convolution until conv5_block1, whose 1x1 output
cannot be split, where the activations are gathered (2x2x1024 per example).

Well-posed set-up (measured; why the earlier float32 comparison was "not
exact"). The rewrite is exact: in float64 every strategy checked agrees
with the reference after two steps to 3e-11 (d at -np 2, lr 0.01) and 2e-11
of the updates (s on 2x2, df and gmp at -np 4, lr 0.001). In float32 three numerical
effects, none a tfhybrid bug, make ResNet-50 at initialisation unfit for a
1e-4 comparison, and the set-up avoids each:

1. Residual gain. At Keras' default initialisation ResNet-50 with batch
   norm over 8 examples is chaotic: in float64, perturbing the inputs by
   1e-7 (relative) changes the gradients by up to 16% (0.7% median), and
   single-process float32 gradients differ from float64 by 2% (median).
   Larger batches (32) or 64x64 inputs do not help (measured: as bad or
   worse). The test starts from the same weights with the last batch norm
   of every residual branch (``*_3_bn``) scaled by RESIDUAL_GAMMA = 0.05, the
   "small-init residual" recipe of Goyal et al. (2017); every weight still
   trains, and the step's float32 gradients then agree with float64 to 1.6e-5
   (normwise, worst tensor).
2. TensorFlow's oneDNN graph rewrites (on by default on x86 CPUs) compute a
   *traced* float32 step less accurately than eager execution: traced
   single-process float32 differs from float64 by 1.8e-6 after one step and
   1.6e-4 after two (eager: 1.8e-8; traced with TF_ENABLE_ONEDNN_OPTS=0:
   2.3e-8). The reference and every case therefore run eagerly
   (``run_eagerly=True``: the same Keras fit/evaluate/predict and tfhybrid
   code without tf.function), which also saves 10-25 s of tracing per rank
   and case. The traced path of every rule is covered by test_transform.py.
3. Later steps. A step at lr 0.01 changes conv1's kernel by up to 75% of its
   size (batch norm after a small-weight convolution makes its gradient
   large), and from there float32 round-off is amplified again: after two
   steps strategies differ by 1e-7 (d, f, c) up to 1.5e-3 (d at lr 0.01), and
   even at lr 0.001 the s (2x2 grid) and df cases at -np 4 reached 2e-6 and
   1.7e-4 (inputs scaled by 10), while float64 stays exact. So the float32
   test trains one step at lr 0.001 (updates up to 3e-3); exactness over
   several steps is what the float64 runs above establish.

atol 1e-6: conv biases feed a batch norm, so their true gradient is zero and
they hold only round-off (~1e-8) without relative precision; 1e-6 is 7x
the largest difference measured for one step (1.4e-7: s on 2x2 and gmp at
-np 4; the others 5e-10 to 5e-9; printed with ``-s``) and below the updates. Beyond the issue's criterion each weight's
*update* must match to 5% where it exceeds 1e-5 (measured: well under 1%),
so a wrong gradient scale on weights that barely move is caught too.

The single-process reference is computed once by rank 0 and cached in a
file whose path is the same on every rank (keyed by a digest of the set-up,
its code and the library versions, so a changed set-up recomputes it); the
other ranks wait in an all-reduce meanwhile.
"""
import hashlib
import inspect
import os
import tempfile

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfhybrid
from tfhybrid.comm import backend
from tfhybrid.layers import SpatialZeroPadding2D
from tfhybrid.transform import gather, transform
from tfhybrid.transform.api import info_of

from conftest import randn, rng, world_size
from test_spatial_conv import GRAD, check_against, grid_of_split, valid_size

N = world_size()
HW, CLASSES, BATCH, STEPS, LR = 32, 10, 8, 1, 0.001
RESIDUAL_GAMMA, INPUT_SCALE = 0.05, 1.0
RTOL, ATOL = 1e-4, 1e-6
UPDATE_RTOL, UPDATE_MIN = 5e-2, 1e-5
LOSS = "sparse_categorical_crossentropy"


def resnet50():
    """The unmodified keras.applications.ResNet50, residual-branch gammas x 0.05."""
    keras.utils.set_random_seed(1)
    model = keras.applications.ResNet50(weights=None, input_shape=(HW, HW, 3),
                                        classes=CLASSES)
    for layer in model.layers:
        if layer.name.endswith("_3_bn"):
            layer.gamma.assign(layer.gamma * RESIDUAL_GAMMA)
    return model


def data():
    """(train x, train y, eval x, eval y): STEPS global batches and one eval batch."""
    x = INPUT_SCALE * randn((STEPS * BATCH, HW, HW, 3), "resnet50", "x")
    y = rng("resnet50", "y").integers(0, CLASSES, size=STEPS * BATCH).astype(np.int32)
    xe = INPUT_SCALE * randn((BATCH, HW, HW, 3), "resnet50", "eval")
    ye = rng("resnet50", "eval-y").integers(0, CLASSES, size=BATCH).astype(np.int32)
    return x, y, xe, ye


def batches(x, y):
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH, drop_remainder=True)


# -- the single-process reference (rank 0, once) --------------------------------------

def single_process_run():
    """fit / predict / evaluate of the unmodified model in this process alone."""
    x, y, xe, ye = data()
    model = resnet50()
    model.compile(optimizer=keras.optimizers.SGD(LR), loss=LOSS, metrics=["accuracy"],
                  jit_compile=False, run_eagerly=True)
    model.fit(batches(x, y), epochs=1, shuffle=False, verbose=0)
    out = {f"w{i}": w for i, w in enumerate(model.get_weights())}
    out["predict"] = model.predict(xe, batch_size=BATCH, verbose=0)
    logs = model.evaluate(xe, ye, batch_size=BATCH, return_dict=True, verbose=0)
    out["loss"], out["accuracy"] = logs["loss"], logs["accuracy"]
    return out


def _reference_path():
    """Same on every rank: a digest of the set-up, the code and the library versions."""
    parts = [inspect.getsource(f) for f in (resnet50, data, batches, single_process_run)]
    parts += [repr((HW, CLASSES, BATCH, STEPS, LR, RESIDUAL_GAMMA, INPUT_SCALE)), keras.__version__,
              tf.__version__, np.__version__]
    digest = hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]
    return os.path.join(tempfile.gettempdir(), f"tfhybrid_resnet50_reference_{digest}.npz")


@pytest.fixture(scope="module")
def reference():
    """The reference arrays, computed by rank 0 only (every rank waits for it)."""
    tfhybrid.shutdown()
    grid = tfhybrid.init(model_parallel=1)
    path, ok = _reference_path(), 1.0
    if grid.rank == 0 and not os.path.exists(path):
        try:
            keras.config.set_floatx("float32")
            result = single_process_run()
            np.savez(path + ".tmp.npz", **result)
            os.replace(path + ".tmp.npz", path)
        except Exception:  # noqa: BLE001 - every rank must reach the all-reduce below
            ok = 0.0
    # Lockstep: the other ranks wait here while rank 0 trains (no rank raises before it).
    done = backend.allreduce(tf.constant([ok]), tuple(range(grid.size)), "resnet50.reference")
    tfhybrid.shutdown()
    keras.utils.clear_session()
    if float(done.numpy()[0]) != grid.size:
        pytest.fail(f"rank 0 could not compute the single-process reference ({path})")
    with np.load(path) as z:
        return {k: z[k] for k in z.files}


# -- the strategies -------------------------------------------------------------------

# (strategy, model_parallel, options, plan kind that must appear)
CASES = {
    2: [("d", 1, {}, "syncbn"),
        ("f", 2, {"fallback": "replicate"}, "filter"),
        ("c", 2, {"fallback": "replicate"}, "channel"),
        ("s", 2, {}, "spatial"),
        ("gmp", 2, {"ccr_threshold": 0}, "filter")],
    4: [("f", 4, {"fallback": "replicate"}, "filter"),
        ("c", 4, {"fallback": "replicate"}, "channel"),
        ("s", 4, {"spatial": (2, 2)}, "spatial"),
        ("df", 2, {"fallback": "replicate"}, "filter"),
        ("ds", 2, {}, "spatial"),
        ("gmp", 2, {"ccr_threshold": 0}, "filter")],
}.get(N, [])


def run_case(strategy, options):
    """Transform, fit, predict, evaluate, gather: every collective, on every rank."""
    x, y, xe, ye = data()
    original = resnet50()
    initial = original.get_weights()
    pmodel = transform(original, strategy, **options)
    pmodel.compile(optimizer=tfhybrid.DistributedOptimizer(keras.optimizers.SGD(LR)),
                   loss=LOSS, metrics=["accuracy"], jit_compile=False, run_eagerly=True)
    pmodel.fit(tfhybrid.data.shard(batches(x, y), model=pmodel), epochs=1, shuffle=False,
               verbose=0)
    local_eval = tfhybrid.data.shard(batches(xe, ye), model=pmodel)
    predicted = pmodel.predict(local_eval, verbose=0)
    logs = tfhybrid.callbacks.average_logs(
        pmodel.evaluate(local_eval, return_dict=True, verbose=0))
    blocks, index = tfhybrid.data.batch_split(pmodel)
    rows = slice(index * BATCH // blocks, (index + 1) * BATCH // blocks)
    return {"initial": initial, "original": original, "pmodel": pmodel,
            "weights": gather(pmodel).get_weights(), "predicted": predicted, "logs": logs,
            "rows": rows}


def assert_trained_like(weights, reference, initial, names, label):
    expected = [reference[f"w{i}"] for i in range(len(initial))]
    assert len(weights) == len(expected)
    needed = max(float(np.max(np.abs(a - e) - RTOL * np.abs(e))) for a, e in zip(weights, expected))
    worst = max(float(np.max(np.abs(a - e))) / float(np.max(np.abs(e - i)))
                for a, e, i in zip(weights, expected, initial)
                if float(np.max(np.abs(e - i))) > UPDATE_MIN)
    print(f"\n{label}: atol needed at rtol {RTOL}: {needed:.2g}; worst update error "
          f"{worst:.2%}")
    moved = max(float(np.max(np.abs(e - i))) for e, i in zip(expected, initial))
    assert moved > 1e-2, "the reference did not train: the comparison would be vacuous"
    for name, a, e, i in zip(names, weights, expected, initial):
        np.testing.assert_allclose(a, e, rtol=RTOL, atol=ATOL, err_msg=name)
        update = float(np.max(np.abs(e - i)))
        if update > UPDATE_MIN:
            err = float(np.max(np.abs(a - e)))
            assert err <= UPDATE_RTOL * update, (
                f"{name}: update differs by {err:.3g}, {err / update:.2%} of the update")


@pytest.mark.parametrize("strategy,mp,options,kind", CASES,
                         ids=[f"{c[0]}-mp{c[1]}" for c in CASES])
def test_resnet50_fit_evaluate_predict_match_single_process(grid_of, reference, strategy, mp,
                                                            options, kind):
    grid_of(mp)
    out = run_case(strategy, options)
    # Every collective is behind us: assertions can no longer leave a rank hanging.
    plan = info_of(out["pmodel"]).plan
    assert kind in {n.kind for n in plan.nodes}, f"{strategy} partitioned nothing"
    names = [w.path for w in out["original"].weights]
    assert_trained_like(out["weights"], reference, out["initial"], names,
                        f"resnet50 {strategy} mp{mp} np{N}")
    np.testing.assert_allclose(out["predicted"], reference["predict"][out["rows"]],
                               rtol=1e-5, atol=1e-6)
    assert out["logs"]["loss"] == pytest.approx(float(reference["loss"]), rel=1e-5)
    assert out["logs"]["accuracy"] == pytest.approx(float(reference["accuracy"]), abs=1e-6)
    assert all(np.array_equal(a, b) for a, b in
               zip(out["original"].get_weights(), out["initial"]))


# -- SpatialZeroPadding2D against keras.layers.ZeroPadding2D ------------------------

PADDINGS = [((3, 3), (3, 3)), ((1, 1), (1, 1)), ((0, 2), (2, 0)), ((4, 4), (1, 3))]


def _pad_specs():
    if N == 2:
        return [(2, "height"), (2, "width")]
    return [(4, "height"), (4, (2, 2)), (2, "height")] if N == 4 else []


# Traced ("function") only for the stem's padding and the re-blocking one (time).
PAD_CASES = [(p, m) for p in PADDINGS for m in ("eager", "function")
             if m == "eager" or p in (PADDINGS[0], PADDINGS[3])]


@pytest.mark.parametrize("padding,mode", PAD_CASES, ids=str)
@pytest.mark.parametrize("spec", _pad_specs(), ids=str)
def test_spatial_zero_padding_matches_keras(grid_of, spec, padding, mode):
    mp, split = spec
    grid_of(mp)
    grid = grid_of_split(split, 2, mp)
    dims = [valid_size(6, grid[d], 1, 1, tuple(padding[d])) for d in range(2)]
    reference = keras.layers.ZeroPadding2D(padding)
    spatial = SpatialZeroPadding2D(padding, split=split)
    if min(dims) < 0:      # e.g. 3 + 3 rows over 4 ranks: no even split exists
        block = [abs(n) // k for n, k in zip(dims, grid)]
        with pytest.raises(ValueError, match="does not split evenly over"):
            spatial(np.zeros((1, *block, 3), np.float32))
        return
    x = randn((2, *dims, 3), "pad", spec, padding)
    check_against(reference, spatial, x, grid, [mode], ("pad", spec, padding))
    assert GRAD["rtol"] == 1e-4


def test_spatial_zero_padding_round_trips_through_its_config(grid_of):
    grid_of(2)
    layer = SpatialZeroPadding2D(((1, 2), (0, 1)), split="width", name="pad")
    again = SpatialZeroPadding2D.from_config(layer.get_config())
    assert again.padding == ((1, 2), (0, 1)) and again.split == "width"
    copy = SpatialZeroPadding2D.from_layer(keras.layers.ZeroPadding2D(2, name="p"))
    assert copy.padding == ((2, 2), (2, 2)) and copy.name == "p"
    with pytest.raises(TypeError, match="expected a keras.layers.ZeroPadding2D"):
        SpatialZeroPadding2D.from_layer(keras.layers.ReLU())
    with pytest.raises(ValueError, match="channels_last"):
        SpatialZeroPadding2D(1, data_format="channels_first")
