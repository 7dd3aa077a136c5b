"""tfhybrid: hybrid data/model/spatial parallelism for unmodified Keras 3 models.

Typical use, launched with ``horovodrun -np N python train.py``::

    import keras, tfhybrid
    tfhybrid.init(model_parallel=2)
    model = tfhybrid.transform(make_model(), strategy="df")
    model.compile(optimizer=tfhybrid.DistributedOptimizer(keras.optimizers.SGD(0.01)),
                  loss="sparse_categorical_crossentropy")
    model.fit(tfhybrid.data.shard(dataset), callbacks=tfhybrid.callbacks.standard(),
              verbose=tfhybrid.is_root())
"""
import importlib
import importlib.util

from tfhybrid.config import Config
from tfhybrid.process_grid import Group, ProcessGrid
from tfhybrid.runtime import (grid, init, is_initialized, is_root, local_rank, rank, shutdown,
                              size)

__version__ = "0.1.0"


def _register_hooks():
    """Provide the calls that lower levels make into higher ones (see
    :mod:`tfhybrid.hooks`); each imports its module on first use, so ``import
    tfhybrid`` stays free of TensorFlow."""
    from tfhybrid import hooks

    def collective(op, name, ranks):       # comm.backend: an eager collective runs
        from tfhybrid import watchdog
        return watchdog.collective(op, name, ranks)

    def traced(op, name, ranks=None):       # comm.backend: a collective was traced
        from tfhybrid import watchdog
        return watchdog.traced(op, name, ranks)

    def horovod_restarted():                # comm.backend: hvd.init ran again
        from tfhybrid import exit_barrier
        exit_barrier.reinstall()

    def current_grid():                     # comm.primitives: the grid of tfhybrid.init
        from tfhybrid import runtime
        return runtime.current_grid()

    def agree_on_root(variables, name):     # optimizer.distributed: replicas start equal
        from tfhybrid import callbacks
        return callbacks.agree_on_root(variables, name)

    def as_functional(model, flatten=False):   # oracle.profile: nested models inlined
        from tfhybrid.transformer.graph import as_functional
        return as_functional(model, flatten=flatten)

    def allreduce_link(machine_path, p, span):   # optimizer: bucket_bytes="auto"
        from tfhybrid.oracle.machine import allreduce_link
        return allreduce_link(machine_path, p, span)

    for function in (collective, traced, horovod_restarted, current_grid,
                     agree_on_root, as_functional, allreduce_link):
        hooks.register(function.__name__, function)


_register_hooks()

# Everything below needs TensorFlow/Keras; it is imported on first use, so the
# pure modules (tfhybrid.process_grid, tfhybrid.spatial_geometry,
# tfhybrid.oracle.formulas, tfhybrid.oracle.machine) import without them.
_LAZY = {
    "callbacks": ("tfhybrid.callbacks", None),
    "checkpoint": ("tfhybrid.checkpoint", None),
    "data": ("tfhybrid.data", None),
    "watchdog": ("tfhybrid.watchdog", None),
    "layers": ("tfhybrid.layers", None),
    "oracle": ("tfhybrid.oracle", None),
    "save": ("tfhybrid.checkpoint", "save"),
    "load": ("tfhybrid.compose", "load"),
    "DistributedOptimizer": ("tfhybrid.optimizer", "DistributedOptimizer"),
    "transform": ("tfhybrid.compose", "transform"),
    "gather": ("tfhybrid.transformer", "gather"),
    "describe": ("tfhybrid.transformer", "describe"),
}


def __getattr__(name):
    """Import the TensorFlow-dependent parts of the API on first use (PEP 562)."""
    if name not in _LAZY:
        if name.startswith("_") or importlib.util.find_spec(f"tfhybrid.{name}") is None:
            raise AttributeError(f"module 'tfhybrid' has no attribute {name!r}")
        return importlib.import_module(f"tfhybrid.{name}")   # any subpackage, e.g. optimizer
    module, attr = _LAZY[name]
    value = importlib.import_module(module)
    if attr is not None:
        value = getattr(value, attr)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY))


__all__ = ["init", "shutdown", "grid", "is_root", "is_initialized", "local_rank", "rank", "size",
           "Config",
           "Group", "ProcessGrid", "__version__"]
__all__ += ["DistributedOptimizer", "callbacks", "checkpoint", "data", "save", "load"]
__all__ += ["watchdog"]
__all__ += ["transform", "gather", "describe"]
