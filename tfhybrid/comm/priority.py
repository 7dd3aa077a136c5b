"""Communication before compute on a busy CPU: the compute threads' nice value.

On CPU ranks back-propagation keeps every core a rank may use busy, while the
threads that move its gradients (Horovod's background thread, which starts each
collective, and Gloo's, which send and receive) mostly sleep on a socket. When
data arrives or a bucket is ready they wake and queue behind the compute
threads for the CPU, so the link idles between transfers that back-propagation
was meant to hide. With the compute threads a few nice levels below them, the
kernel runs a waking communication thread first: between two test hosts at
250 Mbit/s (one core per rank, a VGG-like model, 256 KiB buckets), the share
of communication hidden behind back-propagation went from 0.44-0.48 to
0.60-0.65 (``bench/wire.py``, docs/benchmarks.md).

:func:`lower_compute_priority` raises (by ``levels``) the nice value of every
thread of the process but Horovod's and Gloo's, which ``hvd.init`` has just
started (tfhybrid starts Horovod only where it is not running, so every other
thread then computes or feeds compute: the main thread, TensorFlow's pools);
the threads they start later inherit it. Horovod's and Gloo's threads keep the
process's priority. Raising a nice value needs no privilege; lowering it again
does, so it happens once per thread and threads Horovod starts again after a
restart (an elastic reset, a new process set) run at the compute threads'
priority unless the process may lower a nice value (root, ``CAP_SYS_NICE`` or
``RLIMIT_NICE``).

Linux only (per-thread nice values through ``/proc/self/task``); elsewhere a
no-op. ``TFHYBRID_COMM_PRIORITY`` (set by :class:`tfhybrid.Config`'s
``comm_priority``, default 10; 0 turns it off) gives the levels.
"""
from __future__ import annotations

import os

ENV = "TFHYBRID_COMM_PRIORITY"
DEFAULT_LEVELS = 10
_TASKS = "/proc/self/task"
_DONE = {"base": None}


def levels_from_env(env=None) -> int:
    """The nice levels ``TFHYBRID_COMM_PRIORITY`` asks for (default 10).

    Raises:
        ValueError: not an integer from 0 to 19.

    Example:
        >>> levels_from_env({}), levels_from_env({"TFHYBRID_COMM_PRIORITY": "0"})
        (10, 0)
    """
    raw = (os.environ if env is None else env).get(ENV, "").strip()
    if not raw:
        return DEFAULT_LEVELS
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if not 0 <= value <= 19:
        raise ValueError(f"{ENV}={raw!r}: expected an integer from 0 (off) to 19, the nice "
                         "levels the compute threads (every thread but Horovod's and Gloo's) "
                         f"run below the communication threads (default {DEFAULT_LEVELS}).")
    return value


def compute_threads(keep=(), tasks=_TASKS) -> list:
    """Thread ids of this process but ``keep`` (the communication threads)."""
    return sorted(thread_ids(tasks) - set(keep))


def lower_compute_priority(levels=None, keep=(), tasks=_TASKS) -> list:
    """Run every thread of the process but ``keep`` ``levels`` nice values below the
    process's own priority (taken the first time, from the main thread); returns
    the thread ids changed. Idempotent: a thread already there is left alone.

    Called right after ``hvd.init`` with ``keep`` the threads it started, every
    other thread (the main thread, TensorFlow's pools, the script's own) computes
    or feeds compute; threads they start later inherit the value."""
    levels = levels_from_env() if levels is None else int(levels)
    if levels <= 0 or not hasattr(os, "setpriority") or not os.path.isdir(tasks):
        return []
    if _DONE["base"] is None:
        _DONE["base"] = os.getpriority(os.PRIO_PROCESS, os.getpid())
    target = min(19, _DONE["base"] + levels)
    changed = []
    for tid in compute_threads(keep, tasks):
        try:
            if os.getpriority(os.PRIO_PROCESS, tid) < target:
                os.setpriority(os.PRIO_PROCESS, tid, target)
                changed.append(tid)
        except OSError:          # ended meanwhile, or not ours to change
            continue
    return changed


def restore_priority(tids) -> None:
    """Give ``tids`` (threads Horovod started again, which inherited the compute
    threads' nice value) the process's own priority, where the process may lower
    a nice value; elsewhere they keep it."""
    if _DONE["base"] is None or not hasattr(os, "setpriority"):
        return
    for tid in tids:
        try:
            if os.getpriority(os.PRIO_PROCESS, tid) > _DONE["base"]:
                os.setpriority(os.PRIO_PROCESS, tid, _DONE["base"])
        except OSError:
            continue


def thread_ids(tasks=_TASKS) -> set:
    """This process's thread ids (empty where ``/proc`` has none)."""
    try:
        return {int(t) for t in os.listdir(tasks)}
    except OSError:
        return set()
