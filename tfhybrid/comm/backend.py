"""The only module of tfhybrid that imports Horovod.

It owns Horovod's initialisation, the registry of process sets (one per
group of ranks, registered identically on every rank), deterministic
collective names, and thin wrappers around ``horovod.tensorflow``'s raw ops
(without Horovod's data-parallel gradients: callers define their own).

When Horovod is not installed or the job was not started by ``horovodrun``,
the world is a single process and every collective is the identity, so the
rest of the package runs and tests in one process.

Reduce-scatter avoids Horovod's own reducescatter. Under Gloo (the CPU path,
``horovodrun --gloo``) horovod 0.28.1 runs it with Gloo's legacy
``ReduceScatterHalvingDoubling``, the only bound-buffer algorithm Horovod
uses. Its sends size the connection's socket send buffer to the message
(``SO_SNDBUF`` = min(bytes, 32 MiB); Gloo only ever raises it, and an explicit
``SO_SNDBUF`` turns off the kernel's autotuning for good). A small first
reduce-scatter on a process set (an activation gradient of a few KB) thus
locks the sockets to the halving/doubling partners at a few KB (4.6 KB, the
kernel minimum, and 8.3 KB seen). Every later large collective on those
connections (gradient-bucket allreduces, weight allgathers) then moves one
64 KB loopback segment at a time, each waiting ~200 ms for the delayed ACK /
tail-loss probe, with all ranks idle and no stall warning: 40 MB allreduce
0.8 s -> 38 s after one 16-float reducescatter (plain Horovod, -np 4).
:func:`reducescatter` uses an alltoall (Gloo's unbound buffers never touch
``SO_SNDBUF``) and a local sum.

Process sets are *static* when they can be: ``tfhybrid.init`` passes the
grid's model and data groups (and neighbouring ranks of model groups larger
than two) to :func:`init`, which hands them to ``hvd.init(process_sets=[...])``. With ``process_sets="dynamic"`` Horovod's
background thread runs one more world-wide allgather in every cycle (to agree
on sets being added or removed), so every collective waits for all ranks'
background threads twice per cycle: a chain of 8-float allreduces at -np 4 on
the 2-core box took 10.9-11.6 ms each with dynamic sets, 5.0-5.3 ms static
(1.16 ms either way at -np 2). A group registered later (block-grid
sub-groups, halo pairs of 2-D splits, another grid, calibration's blocks)
starts Horovod again with static sets: the known ones in the same order (so
their ids and the graphs traced with them stay valid), then the new ones
(:func:`register_groups`; ~0.6 s plus ~0.1 s per set at -np 4 here, and a
world of 4 has at most 11 groups). With 10 sets the chain took 4.9-5.4 ms
static, 7.8 ms dynamic. After ``TFHYBRID_STATIC_RESTARTS`` (16) such restarts
a job switches to dynamic sets for good; ``TFHYBRID_PROCESS_SETS=dynamic``
starts dynamic.

Elastic runs (``horovodrun --min-np/--max-np``, which exports
``HOROVOD_ELASTIC=1``) register no process sets: a collective over a group
smaller than the world runs as one *world* alltoall in which every rank
sends only to the members of its own group (:func:`groups_over_world`).
Horovod 0.28.1 cannot survive a lost worker while process sets exist: its
background thread, on the way down, negotiates the removal of each set over
the broken global Gloo context, and the ``gloo::IoException`` that throws
there is uncaught (``terminate called``), so the survivors abort instead of
recovering. Over the world alone, a lost worker fails the pending operations
with Horovod's shutdown error, which the elastic loop handles. Nor does an
elastic run start Horovod with *dynamic* process sets: their world allgather
in every cycle runs with the process-set table locked, so after a lost worker
it blocks until the Gloo timeout, and a collective the step enqueues meanwhile
waits for that lock. The timeout's exception releases it just as Horovod
shuts down: the collective can pass Horovod's shutdown check before the flag
is set and enter the queue after Horovod has failed the queued operations,
then never completes, and the survivor's step hangs (until the watchdog ends
it) instead of failing and re-forming. The groups of
one collective must partition the world, every group issuing it under the
same name (the grid's model and data groups do: every strategy run by
``tfhybrid.transform`` except ``p`` and ``ls``, whose transfers run on pairs).
Allgather, allreduce and broadcast then send a copy of their input to each
member (k times the bytes of a ring for a group of k), exact all the same.
"""
from __future__ import annotations

import contextlib
import functools
import os
import re
import threading
import warnings
import weakref

import tensorflow as tf

from tfhybrid import errors
from tfhybrid import hooks
from tfhybrid.comm import priority

_LOCK = threading.Lock()
_STATE = {"hvd": None, "mpi_ops": None, "initialized": False, "sets": {}, "over_world": False,
          "static": False, "restarts": 0}
# Horovod restarts that add static process sets before a job switches to dynamic
# sets (a restart costs ~0.6 s + ~0.1 s per set at -np 4 here; a world of 4 has
# at most 11 groups, so the test suites and real jobs stay static)
_MAX_STATIC_RESTARTS = int(os.environ.get("TFHYBRID_STATIC_RESTARTS", "16"))

_LAUNCH_ENV_SIZE = ("HOROVOD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE")


def launched_size() -> int:
    """World size announced by the launcher's environment (1 if none)."""
    for key in _LAUNCH_ENV_SIZE:
        if os.environ.get(key):
            return int(os.environ[key])
    return 1


def _import_horovod():
    try:
        import horovod.tensorflow as hvd  # noqa: WPS433 (the one allowed import)
        from horovod.tensorflow import mpi_ops
    except ImportError as err:
        if launched_size() > 1:
            raise RuntimeError(
                "This job was launched on several processes but horovod.tensorflow "
                f"cannot be imported ({err}). Install the project environment with "
                "`make env` (it builds horovod 0.28.1 with Gloo).") from err
        return None, None
    return hvd, mpi_ops


def init(groups=None):
    """Initialise Horovod once. Returns (size, rank, local_rank).

    ``groups``: the groups of ranks to register as *static* process sets
    (``tfhybrid.init`` passes its grid's model and data groups, computed from
    the launcher's world size; None: none yet). An elastic run or
    ``TFHYBRID_PROCESS_SETS=dynamic``: dynamic process sets. See the module
    docstring for why static sets are preferred and how a later group is
    added to them.

    Whoever initialises first (``tfhybrid.init``, ``tfhybrid calibrate`` or a
    direct call) gets tfhybrid's default Horovod settings (Gloo timeout 600 s
    instead of 30 s, stall shutdown) unless already exported: Horovod reads
    them once, at this point.
    """
    with _LOCK:
        if not _STATE["initialized"]:
            from tfhybrid.config import Config  # pure Python
            Config().apply()
            hvd, mpi_ops = _import_horovod()
            if hvd is not None and not hvd.is_initialized():
                from tfhybrid.comm import hostcheck
                hostcheck.check()   # a multi-host job stock Horovod cannot start
                slow = hostcheck.slow_link_warning()
                if slow:
                    warnings.warn(slow, RuntimeWarning, stacklevel=2)
            over_world = hvd is not None and _groups_over_world_env()
            static = None
            if hvd is not None:
                # a script's own dynamic Horovod is kept as it is
                keep = hvd.is_initialized() and os.environ.get("HOROVOD_DYNAMIC_PROCESS_SETS") == "1"
                if not keep and not over_world and \
                        os.environ.get("TFHYBRID_PROCESS_SETS") != "dynamic":
                    static = _new_groups(groups or (), tuple(range(launched_size())))
                if not keep:
                    if hvd.is_initialized():
                        # The script called hvd.init() first (a Horovod habit): its
                        # Horovod has none of tfhybrid's process sets, and without
                        # dynamic ones none can be added ("Set HOROVOD_DYNAMIC_PROCESS_SETS=1
                        # ..." from add_process_set). Horovod starts again with them;
                        # hvd.rank()/size() are unchanged.
                        hvd.shutdown()
                    if static is not None:
                        _STATE["sets"].update(zip(static, _init_static(hvd, static)))
                    else:
                        _init_without_sets(hvd, over_world)
            _STATE.update(hvd=hvd, mpi_ops=mpi_ops, initialized=True, over_world=over_world,
                          static=static is not None)
    return size(), rank(), local_rank()


def _new_groups(groups, world):
    """The groups of ``groups`` that need a process set, as tuples of ints, in
    order, each once: more than one rank, not ``world``, not registered yet."""
    out = []
    for ranks in groups:
        ranks = tuple(int(r) for r in ranks)
        if len(ranks) > 1 and ranks != world and ranks not in _STATE["sets"] \
                and ranks not in out:
            out.append(ranks)
    return out


def _init_static(hvd, groups):
    """``hvd.init`` with ``groups`` as static process sets, in order (Horovod
    numbers them 1, 2, ...); returns the sets."""
    sets = [hvd.ProcessSet(list(ranks)) for ranks in groups]
    _hvd_init(hvd, process_sets=sets)
    return sets


def _hvd_init(hvd, **kwargs):
    """``hvd.init(**kwargs)`` (Horovod not running), then every other thread below
    the communication threads in CPU priority (:mod:`tfhybrid.comm.priority`):
    Horovod's and Gloo's threads, which this call starts, keep the process's
    priority (where a restart started them from a lowered thread, they get it back
    where the process may)."""
    before = priority.thread_ids()
    hvd.init(**kwargs)
    levels = priority.levels_from_env()
    if levels and hvd.size() > 1:     # alone, nothing communicates
        started = priority.thread_ids() - before
        priority.restore_priority(started)
        priority.lower_compute_priority(levels, keep=started)


def _init_without_sets(hvd, over_world):
    """``hvd.init`` with no static process sets: with dynamic ones, or, when groups
    run over the world (elastic runs; the module docstring says why), with the
    world's set alone. ``hvd.init(process_sets="dynamic")`` exports
    ``HOROVOD_DYNAMIC_PROCESS_SETS=1``, which every later ``hvd.init`` of the
    process would follow: the world-only start removes it first."""
    if not over_world:
        _hvd_init(hvd, process_sets="dynamic")
        return
    os.environ.pop("HOROVOD_DYNAMIC_PROCESS_SETS", None)
    _hvd_init(hvd)


def _restart(hvd, new=(), dynamic=False):
    """Shut Horovod down and start it again with the known process sets in
    their order, then ``new`` (static sets), or with dynamic sets (the known
    ones added again in their order). Collective: every rank calls it from
    :func:`register_groups` with the same groups. Horovod numbers sets 1, 2,
    ... in registration order, statically and dynamically alike, so the ids
    that traced graphs carry stay the same (checked). A world barrier first:
    a rank that shut Horovod down while another still waited in a collective
    failed that collective ("Process set provided does not exist"). Layers
    register their groups while a step is traced (a block grid's neighbour
    pairs), so the barrier runs eagerly, outside the graph being built."""
    known = list(_STATE["sets"])
    with tf.init_scope():
        barrier()
    hvd.shutdown()
    if dynamic:
        _hvd_init(hvd, process_sets="dynamic")
        sets = [hvd.add_process_set(list(ranks)) for ranks in known]
    else:
        sets = _init_static(hvd, known + list(new))
    _STATE["restarts"] += 1
    for ranks, ps in zip(known, sets):
        if ps.process_set_id != _STATE["sets"][ranks].process_set_id:
            raise RuntimeError(
                f"Horovod gave the process set {list(ranks)} the id {ps.process_set_id} "
                f"after starting again (was {_STATE['sets'][ranks].process_set_id}). Set "
                "TFHYBRID_PROCESS_SETS=dynamic to start with dynamic process sets.")
    _STATE["sets"].update(zip(known + list(new), sets))
    _STATE["static"] = not dynamic
    _exit_barrier_last()


def _exit_barrier_last():
    """``hvd.init`` registers Horovod's shutdown with ``atexit`` each time it
    runs; after a restart that shutdown would run before tfhybrid's exit
    barrier (handlers run last-registered first), so a rank ending its script
    took its process sets from ranks still in a collective. Register the
    barrier again, after it (a no-op unless ``tfhybrid.init`` installed it)."""
    hooks.call("horovod_restarted")    # tfhybrid.exit_barrier.reinstall


def _groups_over_world_env() -> bool:
    """Elastic runs (``HOROVOD_ELASTIC=1``, set by ``horovodrun --min-np``), or
    ``TFHYBRID_GROUPS_OVER_WORLD=1`` (0 turns it off; tests use it to check the
    world-alltoall collectives in ordinary runs)."""
    forced = os.environ.get("TFHYBRID_GROUPS_OVER_WORLD")
    if forced not in (None, ""):
        return forced == "1"
    return os.environ.get("HOROVOD_ELASTIC") == "1"


def is_initialized() -> bool:
    return _STATE["initialized"]


def _hvd():
    if not _STATE["initialized"]:
        raise errors.not_initialized()
    return _STATE["hvd"]


def size() -> int:
    hvd = _hvd()
    return hvd.size() if hvd is not None else 1


def rank() -> int:
    hvd = _hvd()
    return hvd.rank() if hvd is not None else 0


def local_rank() -> int:
    hvd = _hvd()
    return hvd.local_rank() if hvd is not None else 0


def local_size() -> int:
    hvd = _hvd()
    return hvd.local_size() if hvd is not None else 1


def register_groups(groups):
    """Register a Horovod process set for each tuple of ranks (collective).

    Every rank must call this with the same list in the same order. Groups of
    one rank and the whole world need no process set; groups already
    registered are skipped, so the call is idempotent.
    """
    hvd = _hvd()
    new = _new_groups(groups, tuple(range(size())))
    if new and _STATE["static"]:
        if _STATE["restarts"] < _MAX_STATIC_RESTARTS:
            _restart(hvd, new)
            return
        _restart(hvd, dynamic=True)    # a job that keeps adding groups: restart no more
    for ranks in new:
        if _STATE["over_world"]:     # elastic: no process sets (see the module docstring)
            if list(ranks) != sorted(set(ranks)):
                raise ValueError(
                    f"Received the group {list(ranks)} in an elastic run; expected distinct "
                    "ranks in increasing order (its collectives run over the world).")
            _STATE["sets"][ranks] = None
            continue
        _STATE["sets"][ranks] = hvd.add_process_set(list(ranks))


def allgather_bytes(payload: bytes, width: int = 256) -> list:
    """Every rank's ``payload`` in rank order: one world allgather of ``width``
    bytes (``tfhybrid.init`` gathers each rank's host with it). ``payload``
    must not contain NUL bytes; a single process returns ``[payload]``.

    Raises:
        ValueError: when ``payload`` is longer than ``width`` bytes.
    """
    payload = bytes(payload)
    if len(payload) > width:
        raise ValueError(f"Received {len(payload)} bytes for allgather_bytes; expected at most "
                         f"{width}.")
    if _STATE["hvd"] is None or size() == 1:
        return [payload]
    row = tf.constant([list(payload.ljust(width, b"\0"))], dtype=tf.uint8)
    world = tuple(range(size()))
    out = allgather(row, world, "init.hosts").numpy()
    return [bytes(r).rstrip(b"\0") for r in out]


def process_set_mode() -> str:
    """``"static"`` (Horovod started with tfhybrid's process sets and has needed
    no other), ``"dynamic"``, or ``"none"`` (one process, or an elastic run)."""
    if _STATE["hvd"] is None or _STATE["over_world"]:
        return "none"
    return "static" if _STATE["static"] else "dynamic"


def groups_over_world() -> bool:
    """True when collectives on groups smaller than the world run as world
    alltoalls without Horovod process sets (elastic runs: ``HOROVOD_ELASTIC=1``)."""
    return _STATE["over_world"]


def _over_world(ranks) -> bool:
    """Whether a collective on ``ranks`` runs as a world alltoall (elastic mode)."""
    if not _STATE["over_world"]:
        return False
    ranks = tuple(ranks)
    if len(ranks) <= 1 or ranks == tuple(range(size())):
        return False
    process_set(ranks)    # the usual error when the group was never registered
    return True


def process_set(ranks):
    """The Horovod process set of ``ranks`` (global set for the whole world)."""
    hvd = _hvd()
    ranks = tuple(ranks)
    if ranks == tuple(range(size())):
        return hvd.global_process_set
    try:
        return _STATE["sets"][ranks]
    except KeyError:
        raise ValueError(
            f"No Horovod process set is registered for ranks {list(ranks)}. Groups "
            "are registered collectively: call tfhybrid.comm.register_groups("
            f"[{list(ranks)}, ...]) on every rank first.") from None


_SAFE = re.compile(r"[^A-Za-z0-9_.]")
_GRAPH_NAMES = weakref.WeakKeyDictionary()


def collective_name(base: str) -> str:
    """A name every rank derives identically for one collective.

    Inside a ``tf.function`` the name is made unique across the whole graph,
    whatever the name scope (Horovod drops scopes, so a layer called twice or
    recomputed would otherwise collide); tracing is identical on every rank,
    so the names match. Eagerly, collectives run one at a time and the base
    name is reused.
    """
    base = "tfh." + _SAFE.sub("_", base)
    if tf.executing_eagerly():
        return base
    used = _GRAPH_NAMES.setdefault(tf.compat.v1.get_default_graph(), {})
    count = used.get(base, 0)
    used[base] = count + 1
    return base if count == 0 else f"{base}_{count}"


# -- raw collectives along axis 0 (no gradients registered by us) ----------

_RECORDERS = []   # lists collecting the collectives issued inside recording_collectives()


@contextlib.contextmanager
def recording_collectives():
    """Record every collective issued (run eagerly or traced) inside this context.

    Yields a list that fills with ``(op, name, ranks, inputs, splits)`` per
    call: ``inputs`` the input tensors (symbolic when traced: their shapes
    and dtypes are what counts), ``splits`` the alltoall row counts (None
    for other ops). ``tfhybrid.callbacks.Profile`` replays them alone to time
    each phase of a step.

    Example:
        >>> with recording_collectives() as calls:
        ...     tf.function(lambda: model(x, training=True)).get_concrete_function()
        >>> sorted({op for op, *_ in calls})
    """
    calls = []
    _RECORDERS.append(calls)
    try:
        yield calls
    finally:
        _RECORDERS.remove(calls)


def _watched(op, name, ranks, run, inputs=(), splits=None):
    """``run(collective name)`` with the watchdog told: an eager collective is
    watched while it runs; a traced one is recorded (tracing is progress)."""
    name = collective_name(name)
    if _RECORDERS:
        _RECORDERS[-1].append((op, name, tuple(ranks), tuple(inputs), splits))
    if tf.executing_eagerly():
        try:
            with hooks.call("collective", op, name, ranks):   # tfhybrid.watchdog
                return run(name)
        except tf.errors.OpError as err:
            raise _explained(err, op, name) from err
    hooks.call("traced", op, name, ranks)
    return run(name)


_MISMATCH = "Mismatched"     # Horovod's coordinator: "Mismatched ALLREDUCE tensor shapes" ...


def _explained(err, op, name):
    """``err`` with the usual cause said first when Horovod found the ranks in
    different collectives (a rank sent another tensor under this op)."""
    if _MISMATCH not in (err.message or ""):
        return err
    hint = (f"tfhybrid: the ranks reached different collectives: this rank ran {op} "
            f"{name!r} while another rank ran another one. Usually a collective call made on "
            "some ranks only, e.g. under `if tfhybrid.is_root():`: calling a transformed model "
            "whose layers are split (model(x): its layers exchange activations), predict, "
            "evaluate, tfhybrid.gather or tfhybrid.save. Call it on every rank, or call "
            "full = tfhybrid.gather(model) on every rank and run full(x) on one. Horovod: ")
    return type(err)(err.node_def, err.op, hint + err.message)


# -- group collectives as world alltoalls (elastic runs, no process sets) ------

def _world_alltoall(x, splits, ranks, name):
    """Alltoall of ``x`` within the group ``ranks`` issued as a world alltoall:
    rows ``splits[i]`` go to member i, nothing to other ranks (whose own
    groups, issuing the same name, send nothing here). Returns the blocks
    received from the members in group order and their row counts."""
    m = _STATE["mpi_ops"]
    ranks = tuple(ranks)
    splits = tf.cast(splits if tf.is_tensor(splits) else tf.constant(splits, tf.int32), tf.int32)
    world_splits = tf.scatter_nd(tf.constant([[r] for r in ranks]), splits, [size()])
    out, counts = _watched("alltoall", name, ranks, lambda nm: m.alltoall(
        x, splits=world_splits, name=nm, ignore_name_scope=True,
        process_set=_STATE["hvd"].global_process_set), (x,), splits)
    return out, tf.gather(counts, list(ranks))


def _copies_to_members(x, ranks, name, send=True):
    """Every member receives ``x`` flattened from each sender (``send`` False:
    this rank sends nothing); returns the received copies, one row per sender
    in group order (rows of ``tf.size(x)`` elements)."""
    k = len(ranks)
    flat = tf.reshape(x, [-1])
    n = tf.size(flat, out_type=tf.int32)
    if send:
        payload, splits = tf.tile(flat, [k]), tf.fill([k], n)
    else:
        payload, splits = flat[:0], tf.zeros([k], tf.int32)
    out, _ = _world_alltoall(payload, splits, ranks, name)
    return tf.reshape(out, [-1, n])


def _world_allreduce(x, ranks, name, average, prescale, postscale):
    x = tf.convert_to_tensor(x)
    if prescale != 1.0:
        x = x * tf.cast(prescale, x.dtype)
    total = tf.reduce_sum(_copies_to_members(x, ranks, name), axis=0)   # group order
    scale = postscale / len(ranks) if average else postscale
    if scale != 1.0:
        total = total * tf.cast(scale, total.dtype)
    out = tf.reshape(total, tf.shape(x))
    out.set_shape(x.shape)
    return out


def _world_grouped_allreduce(tensors, ranks, name, average, prescale, postscale):
    tensors = [tf.convert_to_tensor(t) for t in tensors]
    if len({t.dtype for t in tensors}) > 1:
        return [_world_allreduce(t, ranks, f"{name}.{i}", average, prescale, postscale)
                for i, t in enumerate(tensors)]
    sizes = [tf.size(t, out_type=tf.int32) for t in tensors]
    flat = tf.concat([tf.reshape(t, [-1]) for t in tensors], 0)
    total = _world_allreduce(flat, ranks, name, average, prescale, postscale)
    out = [tf.reshape(part, tf.shape(t))
           for part, t in zip(tf.split(total, tf.stack(sizes), num=len(tensors)), tensors)]
    for o, t in zip(out, tensors):
        o.set_shape(t.shape)
    return out


# Horovod 0.28.1's TensorFlow ops take no bfloat16 (mixed_bfloat16 activations
# crossed by f/c/s layers failed with "DataType bfloat16 not in list of allowed
# values"): such tensors travel as float32 (exact both ways) and come back cast.
_CARRIERS = {tf.bfloat16: tf.float32}


def _carried(function):
    """Run collective ``function`` on ``x`` cast to a dtype Horovod carries."""
    @functools.wraps(function)
    def wrapper(x, *args, **kwargs):
        x = tf.convert_to_tensor(x)
        carrier = _CARRIERS.get(x.dtype)
        if carrier is None:
            return function(x, *args, **kwargs)
        out = function(tf.cast(x, carrier), *args, **kwargs)
        if isinstance(out, tuple):     # alltoall(received=True): (blocks, counts)
            return (tf.cast(out[0], x.dtype),) + tuple(out[1:])
        return tf.cast(out, x.dtype)
    return wrapper


@_carried
def allgather(x, ranks, name):
    if _over_world(ranks):
        k = len(tuple(ranks))
        n = tf.shape(x, out_type=tf.int32)[0]
        out, _ = _world_alltoall(tf.concat([x] * k, 0), tf.fill([k], n), ranks, name)
        out.set_shape(tf.TensorShape([None]).concatenate(x.shape[1:]))
        return out
    return _watched("allgather", name, ranks, lambda nm: _STATE["mpi_ops"].allgather(
        x, name=nm, ignore_name_scope=True, process_set=process_set(ranks)), (x,))


@_carried
def allreduce(x, ranks, name, average=False, prescale=1.0, postscale=1.0):
    if _over_world(ranks):
        return _world_allreduce(x, tuple(ranks), name, average, prescale, postscale)
    m = _STATE["mpi_ops"]
    return _watched("allreduce", name, ranks, lambda nm: m._allreduce(
        x, name=nm, op=m.Average if average else m.Sum, prescale_factor=prescale,
        postscale_factor=postscale, ignore_name_scope=True, process_set=process_set(ranks)),
        (x,))


def grouped_allreduce(tensors, ranks, name, average=False, prescale=1.0, postscale=1.0):
    """One grouped allreduce per dtype (Horovod's takes one dtype: a model of
    float32 and float64 layers failed with "types ... that don't all match")."""
    tensors = [tf.convert_to_tensor(t) for t in tensors]
    dtypes = [t.dtype for t in tensors]
    carried = [tf.cast(t, _CARRIERS[t.dtype]) if t.dtype in _CARRIERS else t for t in tensors]
    kinds = list(dict.fromkeys(t.dtype for t in carried))
    if len(kinds) <= 1:
        out = _grouped_allreduce(carried, ranks, name, average, prescale, postscale)
    else:
        out = [None] * len(tensors)
        for kind in kinds:
            chosen = [i for i, t in enumerate(carried) if t.dtype == kind]
            part = _grouped_allreduce([carried[i] for i in chosen], ranks,
                                      f"{name}.{kind.name}", average, prescale, postscale)
            for i, o in zip(chosen, part):
                out[i] = o
    return [o if o.dtype == d else tf.cast(o, d) for o, d in zip(out, dtypes)]


def _grouped_allreduce(tensors, ranks, name, average, prescale, postscale):
    if _over_world(ranks):
        return _world_grouped_allreduce(tensors, tuple(ranks), name, average, prescale,
                                        postscale)
    m = _STATE["mpi_ops"]
    return _watched("grouped_allreduce", name, ranks, lambda nm: m._grouped_allreduce(
        list(tensors), name=nm, op=m.Average if average else m.Sum, prescale_factor=prescale,
        postscale_factor=postscale, ignore_name_scope=True, process_set=process_set(ranks)),
        tuple(tensors))


def reducescatter(x, ranks, name):
    """Sum of ``x`` over ``ranks``, scattered along axis 0: group rank i gets block i.

    Blocks as Horovod's reducescatter (the first ``n % k`` ranks get one more
    row). Implemented as one :func:`alltoall` of the blocks and a local sum in
    group-rank order, not with Horovod's reducescatter: see the module
    docstring (Gloo's legacy reduce-scatter shrinks the socket send buffers
    and every later large collective crawls). Each rank sends the same
    (k-1)/k of ``x`` as a reduce-scatter does.
    """
    x = tf.convert_to_tensor(x)
    ranks = tuple(ranks)
    k, index = len(ranks), ranks.index(rank())
    n = x.shape[0]
    if n is not None:
        rows = n // k + (index < n % k)
        splits = [n // k + (i < n % k) for i in range(k)]
    else:
        n = tf.shape(x, out_type=tf.int32)[0]
        splits = n // k + tf.cast(tf.range(k) < n % k, tf.int32)
        rows = splits[index]
    blocks = alltoall(x, splits, ranks, name)   # k blocks of `rows` rows, in group order
    shape = tf.concat([tf.stack([k, rows]), tf.shape(x, out_type=tf.int32)[1:]], 0)
    out = tf.reduce_sum(tf.reshape(blocks, shape), axis=0)
    out.set_shape(tf.TensorShape([rows if isinstance(rows, int) else None])
                  .concatenate(x.shape[1:]))
    return out


@_carried
def alltoall(x, splits, ranks, name, received=False):
    """Send rows ``splits[i]`` of ``x`` (consecutive blocks along axis 0) to group
    rank i; return the blocks received from every rank, concatenated along axis 0
    in group-rank order. ``splits``: a list or an int32 tensor. With
    ``received=True`` also the int32 row counts received from each rank."""
    if _over_world(ranks):
        out, counts = _world_alltoall(x, splits, ranks, name)
        return (out, counts) if received else out
    m = _STATE["mpi_ops"]
    splits = splits if tf.is_tensor(splits) else tf.constant(splits, tf.int32)
    out, counts = _watched("alltoall", name, ranks, lambda nm: m.alltoall(
        x, splits=splits, name=nm, ignore_name_scope=True, process_set=process_set(ranks)),
        (x,), splits)
    return (out, counts) if received else out


def zeros_reading(x):
    """Zeros of ``x``'s shape computed from ``x`` (NaN stays NaN).

    Not ``tf.zeros_like``: Grappler folds that into a constant when the shape
    is known and prunes whatever produced ``x``, so a collective feeding only
    this rank's zeros would not run here while the other ranks wait for it.
    """
    return tf.minimum(tf.abs(x), tf.zeros([], x.dtype))


def reduce_to(x, root, ranks, name):
    """Sum of ``x`` over ``ranks`` on global rank ``root``; zeros on the others.

    One :func:`alltoall` in which every rank sends all of ``x`` to ``root``
    (and nothing elsewhere) and ``root`` sums the blocks in group order: each
    non-root rank sends ``x`` once, ``root`` receives ``k - 1`` copies (a
    direct reduce; Horovod has no rooted reduce).
    """
    x = tf.convert_to_tensor(x)
    ranks = tuple(ranks)
    k, at = len(ranks), ranks.index(root)
    n = x.shape[0] if x.shape[0] is not None else tf.shape(x, out_type=tf.int32)[0]
    if isinstance(n, int):
        splits = [n if i == at else 0 for i in range(k)]
    else:
        splits = tf.one_hot(at, k, on_value=n, off_value=0, dtype=tf.int32)
    blocks = alltoall(x, splits, ranks, name)
    if rank() != root:   # zeros that read the (empty) result: the send must run
        return zeros_reading(x) + tf.cast(tf.reduce_sum(blocks), x.dtype)
    shape = tf.concat([[k], tf.shape(x, out_type=tf.int32)], 0)
    out = tf.reduce_sum(tf.reshape(blocks, shape), axis=0)
    out.set_shape(x.shape)
    return out


@_carried
def broadcast(x, root, ranks, name):
    if _over_world(ranks):
        copies = _copies_to_members(x, tuple(ranks), name, send=rank() == root)
        out = tf.reshape(copies, tf.shape(x))   # the one row, from root
        out.set_shape(x.shape)
        return out
    return _watched("broadcast", name, ranks, lambda nm: _STATE["mpi_ops"].broadcast(
        x, root, name=nm, ignore_name_scope=True, process_set=process_set(ranks)), (x,))


def barrier(ranks=None):
    """Block until every rank of ``ranks`` (default: the world) gets here.

    horovod.tensorflow 0.28.1 has no barrier op, so this is a 1-element
    allreduce on the group's process set.
    """
    if _hvd() is None:
        return
    ranks = tuple(ranks) if ranks else tuple(range(size()))
    if len(ranks) > 1:
        allreduce(tf.zeros([1]), ranks, "barrier").numpy()


def raise_together(error, what, ranks=None):
    """A barrier over ``ranks`` (default: the world) that also tells every rank
    whether ``error`` (this rank's exception, or None) happened on any of them;
    then every rank raises: the rank that failed its own error, the others a
    RuntimeError naming ``what``. One process (or one rank in ``ranks``):
    ``error`` is raised, nothing else. :func:`together` wraps it around a block."""
    ranks = tuple(ranks) if ranks else tuple(range(size())) if _hvd() is not None else ()
    failed = False
    if len(ranks) > 1:
        flag = tf.constant([0.0 if error is None else 1.0])
        failed = float(allreduce(flag, ranks, "raise_together").numpy()[0]) > 0
    if error is not None:
        raise error
    if failed:
        raise RuntimeError(f"tfhybrid: {what} failed on another rank (its error is in that "
                           "rank's output); every rank of the group stops here.")


@contextlib.contextmanager
def together(what, ranks=None):
    """Run the block, then :func:`raise_together` (collective): use it around work
    some ranks do alone (rank 0 writing a file, timing compute) instead of
    ending it with a plain barrier. A script or a test that catches the
    exception then finds every rank out of step alike, not one rank gone while
    the others wait in its next collective.

    Example:
        >>> with together("writing the file on rank 0"):
        ...     if rank() == 0:
        ...         write_the_file()
    """
    error = None
    try:
        yield
    except Exception as err:  # noqa: BLE001 - raised by raise_together on every rank
        error = err
    raise_together(error, what, ranks)


def join():
    """Horovod join (for uneven final batches); returns the last rank to join."""
    hvd = _hvd()
    if hvd is None:
        return 0
    with hooks.call("collective", "join", "join", tuple(range(size()))):
        return hvd.join()


# -- elastic (horovodrun --min-np/--max-np) ----------------------------------

def reset():
    """Shut Horovod down and initialise it again for the current workers
    (elastic re-formation); every registered process set is forgotten. An
    elastic run (groups over the world) starts again without dynamic process
    sets, as :func:`init` started it."""
    hvd = _hvd()
    if hvd is None:
        return
    with _LOCK:
        hvd.shutdown()
        _STATE["sets"].clear()
        _STATE["static"] = False
        _init_without_sets(hvd, _STATE["over_world"])
        _exit_barrier_last()


def elastic_object_state(**values):
    """Horovod's elastic ``ObjectState`` holding ``values`` (synced from rank 0)."""
    from horovod.common.elastic import ObjectState

    hvd = _hvd()
    return ObjectState(bcast_object=hvd.broadcast_object, get_rank=hvd.rank, **values)


def elastic_run(func):
    """Horovod's elastic retry loop around ``func(state)``: on a lost worker
    (``HorovodInternalError``, including TensorFlow's wrapping of it) the state
    is restored, Horovod re-initialised (:func:`reset`, which keeps the exit
    barrier after Horovod's shutdown), and ``func`` run
    again after ``state.sync()``."""
    from horovod.common.elastic import run_fn
    from horovod.common.exceptions import HorovodInternalError

    def guarded(state, *args, **kwargs):
        try:
            return func(state, *args, **kwargs)
        except tf.errors.UnknownError as err:
            if "horovod" in str(err).lower():
                raise HorovodInternalError(err) from err
            raise

    return run_fn(guarded, reset)
