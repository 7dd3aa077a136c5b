"""Process-wide state: Horovod initialisation and the process grid.

``tfhybrid.init`` lives here. The grid is built from the world size that
Horovod reports and registered as process sets by :mod:`tfhybrid.comm`.
"""
from __future__ import annotations

from tfhybrid.config import Config
from tfhybrid.process_grid import ProcessGrid

_STATE = {"grid": None, "args": None, "config": None}


def init(model_parallel: int = 1, config: Config | None = None) -> ProcessGrid:
    """Initialise Horovod and the process grid p = p_data x p_model.

    Call once on every rank, before building models. Consecutive ranks form a
    model group (model-fastest layout); one Horovod process set is registered
    per model group and per data group, identically on every rank.

    Args:
        model_parallel: Size of a model group (p_model). Must divide the
            world size.
        config: Optional :class:`tfhybrid.Config` (Horovod tuning, stall
            timeouts, GPU pinning).

    Returns:
        The :class:`tfhybrid.process_grid.ProcessGrid` of this rank.

    Raises:
        ValueError: if ``model_parallel`` does not divide the world size, or
            if tfhybrid was already initialised with different arguments.

    Example:
        >>> grid = tfhybrid.init(model_parallel=2)   # under horovodrun -np 4
        >>> grid.data_size, grid.model_size
        (2, 2)
    """
    config = config or Config()
    if not isinstance(config, Config):
        raise TypeError(f"Received an invalid `config`: {config!r}; expected tfhybrid.Config.")
    args = (model_parallel, config)
    if _STATE["grid"] is not None:
        if args == _STATE["args"]:
            return _STATE["grid"]
        raise ValueError(
            f"tfhybrid is already initialised with model_parallel={_STATE['args'][0]}; "
            f"received model_parallel={model_parallel}. Call tfhybrid.shutdown() first "
            "to build a different grid.")
    from tfhybrid.comm import backend  # local: keeps grid/config importable alone

    config.apply()
    if config.pin_gpu:
        _pin_gpu()
    size, rank, _ = backend.init()
    grid = ProcessGrid(size=size, rank=rank, model_parallel=model_parallel)
    backend.register_groups(grid.all_groups())
    from tfhybrid import guards   # an unseeded shuffle built after init agrees on every rank
    guards.set_consistent_seed()
    if size > 1:   # no rank's exit may remove the process sets under the others
        from tfhybrid import exit_barrier
        exit_barrier.install()
    from tfhybrid import watchdog
    watchdog.start(config, rank=rank, size=size)
    _STATE.update(grid=grid, args=args, config=config)
    return grid


def _pin_gpu():
    """One GPU per process by local rank, with memory growth (no-op on CPU)."""
    import os

    import tensorflow as tf

    gpus = tf.config.list_physical_devices("GPU")
    if not gpus:
        return
    local = int(os.environ.get("HOROVOD_LOCAL_RANK", os.environ.get("OMPI_COMM_WORLD_LOCAL_RANK", 0)))
    for gpu in gpus:
        tf.config.experimental.set_memory_growth(gpu, True)
    tf.config.set_visible_devices(gpus[local % len(gpus)], "GPU")


def shutdown():
    """Forget the grid so :func:`init` may be called with other arguments.

    Horovod itself stays initialised until the process exits; process sets
    already registered are reused by later grids.
    """
    _STATE.update(grid=None, args=None, config=None)


def is_initialized() -> bool:
    return _STATE["grid"] is not None


def current_grid() -> ProcessGrid:
    """The grid of :func:`init`; a one-process grid when running alone.

    Raises:
        RuntimeError: when the job was launched on several processes and
            :func:`init` was not called.
    """
    if _STATE["grid"] is not None:
        return _STATE["grid"]
    from tfhybrid.comm import backend

    if backend.launched_size() > 1:
        raise RuntimeError("tfhybrid is not initialised: call tfhybrid.init(model_parallel=...) "
                           "on every rank before using parallel layers or collectives.")
    return ProcessGrid(size=1, rank=0, model_parallel=1)


def grid() -> ProcessGrid:
    """This rank's process grid (see :class:`tfhybrid.process_grid.ProcessGrid`)."""
    return current_grid()


def is_root() -> bool:
    """True on global rank 0 (use for logging, progress bars and saving)."""
    return current_grid().rank == 0
