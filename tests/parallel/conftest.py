"""Shared fixtures for tests run under ``horovodrun -np N`` (every rank runs
the same pytest session, as Horovod's own CI does)."""
import contextlib
import ctypes
import gc
import os
import shutil
import tempfile
import zlib

import numpy as np
import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# The hang watchdog (tfhybrid.watchdog) at a bound no healthy test approaches
# (long eager references on one rank while the others wait in a collective),
# yet one that ends a hung session long before the suite's timeout.
os.environ.setdefault("TFHYBRID_WATCHDOG_SECONDS", "600")
# Horovod's background loop at its default 1 ms cycle burns a sizeable share of a
# core per rank while the rank waits, taken from the ranks that are computing a
# reference or tracing when ranks outnumber cores; a 5 ms cycle burns several
# times less and makes the parallel suite faster on an oversubscribed node.
# Collectives are the same at any cycle time; the integration tests run users'
# scripts at Horovod's default.
os.environ.setdefault("HOROVOD_CYCLE_TIME", "5")
import keras
import tensorflow as tf

import tfhybrid
import tiers
from tfhybrid.comm import backend

# What the imports made lives for the whole session: out of the collector's
# sight, so the full collections below walk only what the tests made.
gc.collect()
gc.freeze()

tf.config.threading.set_intra_op_parallelism_threads(
    int(os.environ.get("TF_NUM_INTRAOP_THREADS", 1)))
tf.config.threading.set_inter_op_parallelism_threads(
    int(os.environ.get("TF_NUM_INTEROP_THREADS", 2)))


def world_size():
    return backend.launched_size()


def all_model_parallel_values():
    """Every model-group size that divides the world: 1, 2, 4."""
    return [m for m in (1, 2, 4) if world_size() % m == 0]


def model_parallel_values():
    """Model-group sizes to test: those that divide the world, except that
    model_parallel=1 (a layer replicated, data groups only) runs at the
    smallest world (it is the same code path at every size) to keep the
    -np 4 pass short: -np 2 -> [1, 2], -np 4 -> [2, 4]."""
    values = all_model_parallel_values()
    return [m for m in values if m > 1] if world_size() > 2 else values


@pytest.fixture(autouse=True)
def _same_keras_names_on_every_rank(request):
    """Reset Keras' auto-name counters before each test.

    Collective names derive from layer names; a test that builds models on
    some ranks only would otherwise shift the names of every later test.
    Every ``_FULL_CLEAR_EVERY`` tests (and on a module change) the clear also
    frees memory: it first drops the gradient functions that
    ``tf.custom_gradient`` registers, under a new name, in TensorFlow's global
    gradient registry each time a graph is traced (Keras' own train step and
    tfhybrid's collectives use it), and never removes. Each entry keeps its
    whole traced graph alive: ~9,300 objects per ``fit`` of plain Keras, so a
    rank's heap grew through the session and the full collection grew with
    it, from 1.7 s at test 330 to 4 s at test 700 (-np 2; 20 % of the
    suite). The previous tests' graphs are traced and done; nothing takes a
    gradient through them again.
    """
    import keras
    _CLEARS["n"] += 1
    module = request.module.__name__
    full = _CLEARS["n"] % _FULL_CLEAR_EVERY == 0 or module != _CLEARS["module"]
    _CLEARS["module"] = module
    if full:
        _forget_traced_custom_gradients()
    keras.utils.clear_session(free_memory=full)
    yield


def _forget_traced_custom_gradients():
    from tensorflow.python.framework import ops
    registry = ops._gradient_registry._registry
    for name in [n for n in registry if n.startswith("CustomGradient-")]:
        del registry[name]


_FULL_CLEAR_EVERY = 10
_CLEARS = {"n": 0, "module": None}


@pytest.fixture
def grid_of():
    """``grid_of(mp)`` (re)initialises tfhybrid with ``model_parallel=mp``."""
    def make(mp):
        if world_size() % mp:
            pytest.skip(f"model_parallel={mp} does not divide world size {world_size()}")
        tfhybrid.shutdown()
        return tfhybrid.init(model_parallel=mp)
    yield make
    tfhybrid.shutdown()


def rng(*key):
    """A numpy Generator every rank can recreate from the same key."""
    return np.random.default_rng(zlib.crc32(repr(key).encode()))


def randn(shape, *key):
    return rng(*key).standard_normal(shape).astype(np.float32)


def compiled_transform(make, strategy, *args):
    """The model of ``make(*args)`` -> (model, compile kwargs), transformed
    under ``strategy`` (fallback="replicate") and compiled with the optimizer
    wrapped in ``tfhybrid.DistributedOptimizer`` (its reference: see
    :func:`reference_once`)."""
    source, kwargs = make(*args)
    model = tfhybrid.transform(source, strategy, fallback="replicate")
    model.compile(optimizer=tfhybrid.DistributedOptimizer(kwargs.pop("optimizer")), **kwargs)
    return model


def assert_weights_like(got_model, reference, rtol=1e-4, atol_of_scale=1e-5):
    """``got_model``'s weights equal ``reference``'s (a model, or its
    ``get_weights()`` list) within ``rtol``, and an absolute tolerance of
    ``atol_of_scale`` x the largest weight: an entry whose gradients are
    rounding error only (a bias before a BatchNormalization, or under Adam,
    which divides by sqrt(v)) moves by rounding error."""
    want = reference if isinstance(reference, list) else reference.get_weights()
    got = got_model.get_weights()
    assert len(got) == len(want)
    scale = max(float(np.max(np.abs(w))) for w in want)
    for a, e, v in zip(got, want, got_model.weights):
        np.testing.assert_allclose(a, e, rtol=rtol, atol=atol_of_scale * scale, err_msg=v.path)


@contextlib.contextmanager
def floatx(dtype):
    """Keras' default float type and dtype policy set to ``dtype`` inside the block.

    The policy too: Keras fixes the global policy from floatx when the first
    layer is built and keeps it until ``clear_session``.
    """
    before, policy = keras.config.floatx(), keras.config.dtype_policy()
    keras.config.set_floatx(dtype)
    keras.config.set_dtype_policy(dtype)
    try:
        yield
    finally:
        keras.config.set_floatx(before)
        keras.config.set_dtype_policy(policy)


@pytest.fixture(scope="module", autouse=True)
def _release_memory_after_module():
    """Give what a module's models freed back to the system before the next module.

    Four ranks may share a small node's memory through one long session per
    world size; glibc keeps freed heap in the process unless trimmed, so each
    module's peak would stay resident under the next one's (the ResNet-50
    module after the VGG16 modules would not fit 4 ranks in 24 GB).
    """
    yield
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):     # not glibc: nothing to trim
        pass


def pytest_configure(config):
    config.addinivalue_line("markers", "parallel: needs horovodrun")


# Modules whose models take the most memory (VGG16/ResNet-50, float64): they run
# first, while the processes are fresh: each rank's resident set grows by a few GB
# over a session (freed memory the allocator keeps in pieces), and the VGG16
# float64 test run late would need most of a rank's share of a 24 GB node again
# on top of it.
_MEMORY_HEAVY_FIRST = ("test_strategies_vgg16_float64", "test_strategies_resnet",
                       "test_strategies_apps")


def _module_rank(item):
    name = item.module.__name__.rsplit(".", 1)[-1]
    return _MEMORY_HEAVY_FIRST.index(name) if name in _MEMORY_HEAVY_FIRST else \
        len(_MEMORY_HEAVY_FIRST)


def pytest_collection_modifyitems(config, items):
    """The memory-heavy modules first (:data:`_MEMORY_HEAVY_FIRST`; the same order on
    every rank), then the core tier that ``make test`` runs (:mod:`tiers`)
    unless ``TFHYBRID_TEST_FULL=1`` (``make test-full``).

    Every rank deselects the same items (the world size is the same
    everywhere), so collectives still pair up. That every line of
    full_tier.txt still names a test is checked by tests/unit/test_test_tiers.py.
    """
    items.sort(key=_module_rank)        # stable: the collection order otherwise
    if tiers.full_tier():
        return
    size = int(os.environ.get("HOROVOD_SIZE", "1") or 1)
    by_id = {}
    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        by_id[item.nodeid.split("tests/parallel/", 1)[-1]] = (item, params.get("mode") == "eager")
    kept, left, _ = tiers.select([(i, eager) for i, (_, eager) in by_id.items()], size)
    if left:
        config.hook.pytest_deselected(items=[by_id[i][0] for i in left])
        items[:] = [by_id[i][0] for i in kept]


def pytest_sessionstart(session):
    """Per-rank JUnit file: expand ``{rank}`` in --junitxml."""
    xml = getattr(session.config.option, "xmlpath", None)
    if xml and "{rank}" in xml:
        rank = os.environ.get("HOROVOD_RANK", "0")
        path = xml.replace("{rank}", rank)
        session.config.option.xmlpath = path
        plugin = session.config._store.get(__import__("_pytest.junitxml", fromlist=["xml_key"]).xml_key, None)
        if plugin is not None:
            plugin.logfile = os.path.normpath(os.path.abspath(path))


def job_dir():
    """A directory every rank of this horovodrun job names alike (the job's
    rendezvous port), for files one rank writes and the others read.

    Removed when the session ends (after the final barrier), so suites leave
    nothing behind in the temp directory.
    """
    port = os.environ.get("HOROVOD_GLOO_RENDEZVOUS_PORT", f"alone-{os.getpid()}")
    path = os.path.join(tempfile.gettempdir(), f"tfhybrid-test-job-{port}")
    os.makedirs(path, exist_ok=True)
    return path


@pytest.fixture(scope="session", autouse=True)
def _world_barrier_at_session_end():
    """No rank ends the session before every rank is done: a rank that exits runs
    Horovod's shutdown, which removes the process sets under ranks still running a
    test whose last collectives use only their own group. Then the first rank of
    the job removes the job's shared directory."""
    yield
    if backend.is_initialized():
        backend.barrier()
    if os.environ.get("HOROVOD_RANK", "0") == "0":
        port = os.environ.get("HOROVOD_GLOO_RENDEZVOUS_PORT", f"alone-{os.getpid()}")
        shutil.rmtree(os.path.join(tempfile.gettempdir(), f"tfhybrid-test-job-{port}"),
                      ignore_errors=True)


# -- single-process references computed once --------------------------------------------

def reference_once(compute, *key):
    """``compute()``'s result, computed by rank 0 only and read by every rank.

    A parallel test compares the transformed model with the unmodified one
    trained in one process. If every rank trained that reference itself, at
    -np 4 four copies of the same single-process run would share the cores.
    Here rank 0 runs ``compute`` once and writes its result (anything pickle
    takes: arrays, lists, dicts, floats) to a file the other ranks read.
    ``make test`` (scripts/run_tests.py) gives its -np 2 and -np 4 sessions
    one directory (``TFHYBRID_TEST_REFERENCES``, removed at its end), so a
    reference that does not depend on the world size is computed once per
    run; without it, once per horovodrun job (:func:`job_dir`).

    ``key``: every input the result depends on (arrays by their bytes,
    functions by name) -- the code is the same throughout one run. ``compute``
    must set the seeds it needs; the process-wide state it changes on rank 0
    (Keras' layer-name counters, Python's, NumPy's and TensorFlow's global
    random state, Keras' global seed generator) is put back, so every rank
    leaves this call alike. Collective: every rank calls it at the same point,
    and a failure on rank 0 fails every rank (no rank waits for a file).
    """
    import hashlib
    import pickle

    digest = hashlib.sha256()
    _digest(digest, (getattr(compute, "__module__", ""), getattr(compute, "__qualname__", "")))
    _digest(digest, key)
    folder = os.environ.get("TFHYBRID_TEST_REFERENCES") or job_dir()
    path = os.path.join(folder, f"reference-{digest.hexdigest()[:24]}.pkl")
    if not backend.is_initialized():
        tfhybrid.init()
    error = None
    if backend.rank() == 0 and not os.path.exists(path):
        try:
            with _process_state_kept():
                result = compute()
            tmp = f"{path}.{os.getpid()}.tmp"
            with open(tmp, "wb") as f:
                pickle.dump(result, f, protocol=pickle.HIGHEST_PROTOCOL)
            os.replace(tmp, path)
        except Exception as err:  # noqa: BLE001 - raised on every rank just below
            error = err
    backend.raise_together(error, "the single-process reference (computed by rank 0)")
    with open(path, "rb") as f:
        return pickle.load(f)


def _digest(h, value):
    """Feed ``value`` into the hash ``h``: arrays by dtype, shape and bytes,
    callables by module and name, containers element by element."""
    if isinstance(value, np.ndarray):
        h.update(f"array{value.dtype}{value.shape}".encode())
        h.update(np.ascontiguousarray(value).tobytes())
    elif isinstance(value, (list, tuple)):
        h.update(f"{type(value).__name__}{len(value)}(".encode())
        for v in value:
            _digest(h, v)
        h.update(b")")
    elif isinstance(value, dict):
        h.update(f"dict{len(value)}(".encode())
        for k in sorted(value, key=repr):
            _digest(h, k)
            _digest(h, value[k])
        h.update(b")")
    elif callable(value) and hasattr(value, "__qualname__"):
        h.update(f"fn:{value.__module__}.{value.__qualname__}".encode())
    else:
        h.update(f"{type(value).__name__}:{value!r}".encode())


@contextlib.contextmanager
def _process_state_kept():
    """Put back what building and training models on one rank changes and the
    ranks must agree on: Keras' auto-name counters (collective names come from
    layer names), Python's and NumPy's global random state, TensorFlow's
    global seed and op-seed counter, Keras' global seed generator."""
    import random

    from keras.src.backend.common import global_state
    from tensorflow.python.eager import context

    names = dict(global_state.get_global_attribute("object_name_uids", {}) or {})
    py_state, np_state = random.getstate(), np.random.get_state()
    ctx = context.context()
    tf_seed, tf_rng = ctx._seed, getattr(ctx, "_rng", None)
    tf_rng_state = None if tf_rng is None else tf_rng.getstate()
    generator = global_state.get_global_attribute("global_seed_generator")
    generator_state = None if generator is None else np.array(generator.state.numpy())
    try:
        yield
    finally:
        uids = global_state.get_global_attribute("object_name_uids")
        if uids is not None:
            uids.clear()
            uids.update(names)
        random.setstate(py_state)
        np.random.set_state(np_state)
        ctx._seed, ctx._rng = tf_seed, tf_rng    # not _set_global_seed: it clears caches
        if tf_rng is not None:
            tf_rng.setstate(tf_rng_state)
        global_state.set_global_attribute("global_seed_generator", generator)
        if generator is not None:
            generator.state.assign(generator_state)
