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
    "load": ("tfhybrid.checkpoint", "load"),
    "DistributedOptimizer": ("tfhybrid.optimizer", "DistributedOptimizer"),
    "transform": ("tfhybrid.transformer", "transform"),
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
