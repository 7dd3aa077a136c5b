"""Process-wide state: Horovod initialisation and the process grid.

``tfhybrid.init`` lives here. The grid is built from the world size that
Horovod reports and registered as process sets by :mod:`tfhybrid.comm`.
"""
from __future__ import annotations

from tfhybrid import errors
from tfhybrid.config import Config
from tfhybrid.process_grid import ProcessGrid

_STATE = {"grid": None, "args": None, "config": None, "hosts": None}


def init(model_parallel: int = 1, config: Config | None = None) -> ProcessGrid:
    """Initialise Horovod and the process grid p = p_data x p_model.

    Call once on every rank, before building models. Consecutive ranks form a
    model group (model-fastest layout); one Horovod process set is registered
    per model group and per data group, identically on every rank.

    Placement across hosts: ``horovodrun -H a:4,b:4`` (and Slurm, MPI) give
    consecutive ranks to the same host, so when ``model_parallel`` divides the
    ranks per host every model group lives inside one host and only the data
    groups' gradient reductions cross the network (as ParaDL and GPipe place
    them). ``init`` gathers every rank's host name (:func:`hosts`);
    :func:`tfhybrid.describe` prints where each model group lives.

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
    size, rank, _ = backend.init(groups=_launched_groups(backend.launched_size(), model_parallel))
    grid = ProcessGrid(size=size, rank=rank, model_parallel=model_parallel)
    backend.register_groups(grid.all_groups())
    set_consistent_seed()   # an unseeded shuffle built after init agrees on every rank
    if size > 1:   # no rank's exit may remove the process sets under the others
        from tfhybrid import exit_barrier
        exit_barrier.install()
    from tfhybrid import watchdog
    _STATE["hosts"] = _gather_hosts(backend, watchdog, rank, size)
    watchdog.start(config, rank=rank, size=size)
    _STATE.update(grid=grid, args=args, config=config)
    return grid


def _gather_hosts(backend, watchdog, rank, size):
    """Every rank's host name (one world allgather of 256 bytes), and for the
    watchdog each rank's address and liveness port (see tfhybrid.watchdog)."""
    import json
    import socket

    host = socket.gethostname()
    if size == 1:
        return (host,)
    port = watchdog.listen()
    addr = watchdog.route_address()
    payload = json.dumps([host[:120], addr, port], separators=(",", ":")).encode()
    rows = [json.loads(b) for b in backend.allgather_bytes(payload)]
    watchdog.set_peers((r, h, a, p) for r, (h, a, p) in enumerate(rows))
    return tuple(h for h, _, _ in rows)


def hosts() -> tuple:
    """The host name (``socket.gethostname()``) of every rank, indexed by
    global rank, gathered by :func:`init`; ``(this host,)`` when running alone.

    Model groups are consecutive ranks (see :mod:`tfhybrid.process_grid`), and
    ``horovodrun -H a:4,b:4`` gives ranks 0-3 to ``a`` and 4-7 to ``b``, so
    with ``model_parallel`` dividing the slots per host every model group
    lives inside one host; :func:`tfhybrid.describe` prints where each group
    lives.

    Raises:
        RuntimeError: when launched on several processes before :func:`init`.
    """
    current_grid()
    if _STATE.get("hosts") is None:
        import socket
        return (socket.gethostname(),)
    return _STATE["hosts"]


def placement(grid=None) -> str:
    """One line naming the hosts each model group of ``grid`` (default: this
    job's) lives on, e.g. ``Model groups by host: 0 [0, 1] h1; 1 [2, 3] h2``."""
    grid = grid or current_grid()
    names = hosts()
    if len(names) != grid.size:
        return ""
    parts = []
    for d in range(grid.data_size):
        ranks = grid.model_group_ranks(d)
        where = list(dict.fromkeys(names[r] for r in ranks))
        parts.append(f"{d} {list(ranks)} {'+'.join(where)}"
                     + (" (spans hosts)" if len(where) > 1 else ""))
    return "Model groups by host: " + "; ".join(parts)


# Where each launcher announces a process's rank among the processes of its
# node, in the order they are read: horovodrun first (it may run inside a
# Slurm allocation or under mpirun, whose variables its ranks inherit), then
# the MPI launchers, then Slurm's srun (a batch script's own SLURM_LOCALID=0
# is inherited by whatever it launches).
LOCAL_RANK_VARIABLES = (
    ("HOROVOD_LOCAL_RANK", "horovodrun"),
    ("OMPI_COMM_WORLD_LOCAL_RANK", "Open MPI mpirun"),
    ("MV2_COMM_WORLD_LOCAL_RANK", "MVAPICH2 mpirun"),
    ("MPI_LOCALRANKID", "MPICH / Intel MPI Hydra mpiexec"),
    ("PMI_LOCAL_RANK", "PMI process managers (MPICH, Cray)"),
    ("PALS_LOCAL_RANKID", "Cray PALS mpiexec"),
    ("SLURM_LOCALID", "Slurm srun"),
)


def local_rank_from_env(environ=None):
    """This process's node-local rank as announced by its launcher.

    Pure: reads only ``environ`` (default ``os.environ``), so it works before
    Horovod starts and in tests. The first variable of
    :data:`LOCAL_RANK_VARIABLES` that is set wins.

    Returns:
        ``(local_rank, variable)``; ``(0, None)`` when no launcher variable is
        set (a single process).

    Raises:
        ValueError: when the variable is not a non-negative integer, naming
            the variable and its value.

    Example:
        >>> local_rank_from_env({"SLURM_LOCALID": "3"})
        (3, 'SLURM_LOCALID')
        >>> local_rank_from_env({"HOROVOD_LOCAL_RANK": "1", "SLURM_LOCALID": "0"})
        (1, 'HOROVOD_LOCAL_RANK')
    """
    import os

    environ = os.environ if environ is None else environ
    for name, launcher in LOCAL_RANK_VARIABLES:
        value = environ.get(name)
        if value is None or value.strip() == "":
            continue
        try:
            local = int(value)
        except ValueError:
            local = -1
        if local < 0:
            raise ValueError(
                f"Received {name}={value!r} (set by {launcher}); expected the process's "
                f"node-local rank, a non-negative integer. Unset {name} or launch with "
                "horovodrun, mpirun or srun, which set it.")
        return local, name
    return 0, None


def gpu_for_local_rank(local, n_gpus):
    """Index of the visible GPU that the process of node-local rank ``local`` takes.

    One process per GPU: local rank r takes GPU r. When the launcher already
    restricted each process to its own GPU (``CUDA_VISIBLE_DEVICES`` set per
    task, e.g. ``srun --gpus-per-task=1`` or one GPU per Kubernetes pod), one
    GPU is visible and every process takes index 0. With more processes than
    GPUs on a node, processes share GPUs round-robin (``local % n_gpus``).

    Returns:
        The index into ``tf.config.list_physical_devices("GPU")``, or None
        when there is no GPU.

    Example:
        >>> gpu_for_local_rank(3, 4), gpu_for_local_rank(3, 1), gpu_for_local_rank(5, 4)
        (3, 0, 1)
    """
    if n_gpus <= 0:
        return None
    return local % n_gpus


def local_rank() -> int:
    """This process's rank among the processes on its node (0 when alone).

    After :func:`init` this is Horovod's own local rank; before it, the
    launcher's variable (:func:`local_rank_from_env`: horovodrun, Open MPI,
    MVAPICH2, MPICH/Hydra, PMI, Cray PALS or Slurm ``srun``). Use it to pick
    a per-node resource, e.g. a scratch directory or a data shard cache.

    Example:
        >>> tfhybrid.local_rank()   # under `horovodrun -np 8 -H a:4,b:4`: 0..3 on each node
        0
    """
    if _STATE["grid"] is not None:
        from tfhybrid.comm import backend

        if backend.is_initialized():
            return backend.local_rank()
    return local_rank_from_env()[0]


def _pin_gpu():
    """One GPU per process by node-local rank, with memory growth (no-op on CPU)."""
    import tensorflow as tf

    gpus = tf.config.list_physical_devices("GPU")
    if not gpus:
        return
    local, _ = local_rank_from_env()
    for gpu in gpus:
        tf.config.experimental.set_memory_growth(gpu, True)
    tf.config.set_visible_devices(gpus[gpu_for_local_rank(local, len(gpus))], "GPU")


def _launched_groups(size, model_parallel):
    """The process sets Horovod starts with (static: see tfhybrid/comm/backend.py)
    for the launcher's world size: the grid's model and data groups and, in model
    groups of more than two ranks, each pair of neighbouring ranks (the stage
    pairs of ``p`` and the ``pairs`` halo method of a 1-D split; a later group
    restarts Horovod with the known sets and it). None when that grid is invalid: the
    grid built after Horovod starts raises the usual error."""
    try:
        grid = ProcessGrid(size=size, rank=0, model_parallel=model_parallel)
    except (ValueError, TypeError):
        return None
    groups = list(grid.all_groups())
    for d in range(grid.data_size):
        ranks = grid.model_group_ranks(d)
        if len(ranks) > 2:
            groups += [tuple(ranks[i:i + 2]) for i in range(len(ranks) - 1)]
    return tuple(groups)


def shutdown():
    """Forget the grid so :func:`init` may be called with other arguments.

    Horovod itself stays initialised until the process exits; process sets
    already registered are reused by later grids.
    """
    _STATE.update(grid=None, args=None, config=None)


def reform(model_parallel: int) -> ProcessGrid:
    """Re-form the process grid with model groups of ``model_parallel``, keeping
    ``init``'s config (collective: call on every rank with the same value).

    ``transform(strategy="auto")`` uses it when the oracle's best grid differs
    from ``init``'s. Models transformed earlier keep the grid they were built for.

    Raises:
        tfhybrid.errors.NotInitializedError: before :func:`init`.
    """
    config = current_config()
    shutdown()
    return init(model_parallel=model_parallel, config=config)


def current_config() -> Config:
    """The :class:`tfhybrid.Config` given to :func:`init` (a default one if none was)."""
    current_grid()   # raises the "not initialised" error first
    return _STATE["config"] or Config()


def config_or_default() -> Config:
    """The :class:`tfhybrid.Config` given to :func:`init`, or a default one
    (also before :func:`init`, without its "not initialised" error)."""
    return _STATE.get("config") or Config()


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
        raise errors.not_initialized()
    return ProcessGrid(size=1, rank=0, model_parallel=1)


def grid() -> ProcessGrid:
    """This rank's process grid (see :class:`tfhybrid.process_grid.ProcessGrid`)."""
    return current_grid()


def is_root() -> bool:
    """True on global rank 0 (use for logging, progress bars and saving)."""
    return current_grid().rank == 0


def rank() -> int:
    """This process's global rank, ``0 .. size() - 1`` (as ``hvd.rank()``); 0
    when running alone.

    Raises:
        RuntimeError: when launched on several processes before :func:`init`.
    """
    return current_grid().rank


def size() -> int:
    """The number of processes in the job (as ``hvd.size()``): the grid's
    ``p = p_data x p_model``; 1 when running alone.

    Raises:
        RuntimeError: when launched on several processes before :func:`init`.
    """
    return current_grid().size


def set_consistent_seed():
    """Set TensorFlow's global seed to one broadcast from rank 0, unless the
    script set one (called by :func:`tfhybrid.init`).

    Collective on every rank, whether or not this rank has a seed: the ranks
    may differ there (a worker that joins an elastic job has not run the
    script's ``keras.utils.set_random_seed`` yet, the others have), and a
    broadcast issued by some ranks only would fail or wait."""
    import numpy as np
    import tensorflow as tf
    from tensorflow.python.eager import context

    from tfhybrid.comm import backend

    if backend.size() == 1:
        return
    seed = tf.constant([np.random.SeedSequence().entropy % (2**31 - 1)], tf.int64)
    seed = int(backend.broadcast(seed, 0, tuple(range(backend.size())), "guard.seed").numpy()[0])
    if context.global_seed() is None:
        tf.random.set_seed(seed)
