"""A world barrier when a multi-process script ends normally.

When a rank's script ends, Horovod shuts down in that process and takes its
process sets with it; ranks still inside a collective of their own model or
data group (the last forward pass of ``evaluate``/``predict``, a
``gather``...) then fail with ``Process set provided does not exist``. So
that user scripts need no barrier of their own, :func:`install` (called by
:func:`tfhybrid.init` on multi-process jobs) registers an ``atexit`` handler
that waits for every rank before Horovod shuts down. It runs after
Horovod's own registration, hence before Horovod's shutdown (``atexit`` runs
handlers in reverse order).

It never hangs a failing job:

- a rank that ends with an uncaught exception (recorded by a chained
  ``sys.excepthook``) or calls ``sys.exit`` with a non-zero status skips the barrier and exits at once, so Horovod's shutdown ends the
  ranks waiting for it, as without tfhybrid;
- the wait is bounded: after :func:`bound_seconds` the rank gives up with a
  one-line message and exits (Horovod's shutdown then ends the others).

The bound is :data:`DEFAULT_SECONDS` (long enough for rank 0 to save a
large checkpoint while the others wait); the environment variable
``TFHYBRID_EXIT_BARRIER_SECONDS`` changes it (``0`` turns the barrier off).
"""
from __future__ import annotations

import atexit
import os
import sys
import threading

ENV_VAR = "TFHYBRID_EXIT_BARRIER_SECONDS"
#: Longest wait at exit for the other ranks (seconds).
DEFAULT_SECONDS = 300.0

_STATE = {"installed": False, "failed": False}


def bound_seconds() -> float:
    """The exit barrier's bound in seconds (0: no barrier).

    Raises:
        ValueError: if ``TFHYBRID_EXIT_BARRIER_SECONDS`` is not a number >= 0.
    """
    raw = os.environ.get(ENV_VAR, "").strip()
    if not raw:
        return DEFAULT_SECONDS
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value >= 0:
        raise ValueError(f"Received an invalid value for the environment variable {ENV_VAR}: "
                         f"{raw!r}; expected seconds >= 0 (0 turns the exit barrier off).")
    return value


def install():
    """Register the exit barrier once per process (idempotent)."""
    if _STATE["installed"]:
        return
    bound_seconds()                      # a bad value fails at init, not at exit
    previous_hook = sys.excepthook

    def excepthook(kind, value, traceback):
        _STATE["failed"] = True
        previous_hook(kind, value, traceback)

    sys.excepthook = excepthook
    _wrap_exit()
    atexit.register(_barrier_at_exit)
    _STATE["installed"] = True


def reinstall():
    """Register the exit barrier again (after an elastic re-initialisation of
    Horovod, whose own atexit shutdown was registered later and would run first)."""
    if _STATE["installed"]:
        atexit.unregister(_barrier_at_exit)
        atexit.register(_barrier_at_exit)


def _wrap_exit():
    """Record a non-zero ``sys.exit`` status (atexit cannot see the exit code)."""
    original = sys.exit

    def exit(status=None):
        if status not in (None, 0):
            _STATE["failed"] = True
        original(status)

    exit.__doc__ = original.__doc__
    sys.exit = exit


def _barrier_at_exit():
    from tfhybrid.comm import backend

    try:
        if _STATE["failed"] or not backend.is_initialized() or backend.size() <= 1:
            return
    except ValueError:      # Horovod already shut down (its atexit ran first): nothing to wait for
        return
    bound = bound_seconds()
    if bound == 0:
        return
    outcome = {}

    def wait():
        try:
            backend.barrier()
            outcome["ok"] = True
        except Exception as err:   # noqa: BLE001 (Horovod already shut down elsewhere)
            outcome["error"] = err

    thread = threading.Thread(target=wait, name="tfhybrid-exit-barrier", daemon=True)
    thread.start()
    thread.join(bound)
    if thread.is_alive():
        print(f"tfhybrid: rank {backend.rank()} waited {bound:g} s at exit for the other "
              "ranks to end their scripts and gives up; if a rank was still working, raise "
              f"the bound with {ENV_VAR}=<seconds>.", file=sys.stderr, flush=True)
