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
from tfhybrid.config import Config
from tfhybrid.grid import Group, ProcessGrid
from tfhybrid.runtime import grid, init, is_initialized, is_root, shutdown

from tfhybrid import callbacks, checkpoint, data  # noqa: E402
from tfhybrid.checkpoint import load, save  # noqa: E402
from tfhybrid import watchdog  # noqa: E402
from tfhybrid.optimizer import DistributedOptimizer  # noqa: E402
from tfhybrid.transform import describe, gather, transform  # noqa: E402  (shadows the subpackage name)

__version__ = "0.1.0"

__all__ = ["init", "shutdown", "grid", "is_root", "is_initialized", "Config", "Group",
           "ProcessGrid", "__version__"]
__all__ += ["DistributedOptimizer", "callbacks", "checkpoint", "data", "save", "load"]
__all__ += ["watchdog"]
__all__ += ["transform", "gather", "describe"]
