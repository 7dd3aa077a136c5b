"""Hang watchdog: end the job when a collective or a step stops making progress.

Horovod's own stall check never fires under Gloo (horovod 0.28.1), so a rank
that diverges from the others (an extra collective on one rank, training
stopped on one rank only, layers named differently) would hang every rank
forever. tfhybrid watches for that itself, in pure Python (no Horovod here):

- :mod:`tfhybrid.comm.backend` reports every *eager* collective while it runs
  (tfhybrid's name for it, the operation and the group's ranks), and every
  collective *traced* into a ``tf.function`` (inside a compiled step the
  individual collectives are invisible; tracing counts as progress, so a long
  first-step trace is not a hang);
- :class:`WatchdogCallback` reports Keras' train/test/predict steps and
  measures the median step time;
- :func:`activity` reports any other block of code (custom training loops).

Only time spent inside such an activity counts: Python running between steps
is never watched. A daemon thread (started by :func:`tfhybrid.init` on
multi-process jobs) checks once a second. When an activity has made no
progress for longer than the bound, it prints one paragraph to stderr (rank,
the collective or step it waits in, the group, the last collectives traced,
how long, the likely causes and how to change the bound), waits
:data:`GRACE_SECONDS` so that the other hung ranks print theirs, and ends the
process with exit code :data:`EXIT_CODE`; ``horovodrun`` then tears the job
down.

Silent peers: :func:`tfhybrid.init` gathers every rank's host, an address on
the route to the launcher's rendezvous server and the port of a small TCP
listener this module runs (:func:`listen`, answering nothing: a completed
connection is the answer). When the watchdog fires it first probes every
other rank (:data:`PROBE_SECONDS`) and names those that do not answer with
their hosts: a host cut off from the network, a crashed host or a killed
process, instead of a rank that merely diverged.

The bound: ``Config(watchdog_seconds=S)`` or the environment variable
``TFHYBRID_WATCHDOG_SECONDS=S`` (which wins; ``0`` or ``off`` turns the
watchdog off) fix it; by default it is
``max(FLOOR_SECONDS, STEP_FACTOR x median step time)`` = max(100 s, 10 x the
median step), so with steps under 10 s a hang ends the job about 100-105 s
after the fault and a rank that pauses up to ~90 s (a slow checkpoint, a
75 s stall) does not kill a healthy job.
"""
from __future__ import annotations

import collections
import contextlib
import faulthandler
import functools
import itertools
import math
import os
import socket
import statistics
import sys
import threading
import time

import keras

ENV_VAR = "TFHYBRID_WATCHDOG_SECONDS"
#: Shortest default bound (seconds): above a 75 s pause of one rank, with margin,
#: and low enough that the job ends within 2 minutes of a hang.
FLOOR_SECONDS = 100.0
#: The default bound is at least this many median step times.
STEP_FACTOR = 10.0
#: How often the watchdog thread checks (seconds).
POLL_SECONDS = 1.0
#: After printing, wait this long before exiting so other hung ranks print too.
GRACE_SECONDS = 3.0
#: How long the probe of the other ranks waits for each of them (seconds).
PROBE_SECONDS = 2.0
#: Exit code of a process the watchdog ends (as timeout(1)).
EXIT_CODE = 124
_OFF = ("0", "off", "false", "no", "none", "disable", "disabled")


def parse_env(value):
    """The bound set by ``TFHYBRID_WATCHDOG_SECONDS``.

    Returns ``None`` when unset or empty (no override), ``0.0`` when the
    watchdog is turned off (``0``, ``off``, ``false``), else the bound in seconds.

    Raises:
        ValueError: for anything else (negative or not a number).
    """
    if value is None or not str(value).strip():
        return None
    text = str(value).strip().lower()
    if text in _OFF:
        return 0.0
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1.0
    if not seconds > 0 or seconds == float("inf"):
        raise ValueError(f"Received an invalid value for the environment variable {ENV_VAR}: "
                         f"{value!r}; expected a positive number of seconds, or 0/off to turn "
                         "the watchdog off.")
    return seconds


def default_bound(median_step_seconds=None, floor=FLOOR_SECONDS, factor=STEP_FACTOR) -> float:
    """``max(floor, factor x median step time)`` (the floor alone before any step ended)."""
    if not median_step_seconds:
        return float(floor)
    return max(float(floor), factor * float(median_step_seconds))


class Activity:
    """Something in progress that must complete: a collective, a step, a block."""

    __slots__ = ("kind", "name", "op", "ranks", "step", "detail", "start", "owner")

    def __init__(self, kind, name, op=None, ranks=None, step=None, detail=None, start=None,
                 owner=None):
        self.kind, self.name, self.op = kind, name, op
        self.ranks = tuple(ranks) if ranks is not None else None
        self.step, self.detail = step, detail
        self.start = time.monotonic() if start is None else start
        self.owner = owner           # (thread id, frame) that must still run it, or None

    def alive(self, frames=None) -> bool:
        """False when the owner frame left its thread's stack (an exception
        ended the step between its begin and end callbacks)."""
        if self.owner is None:
            return True
        tid, owner = self.owner
        frame = (sys._current_frames() if frames is None else frames).get(tid)
        while frame is not None:
            if frame is owner:
                return True
            frame = frame.f_back
        return False

    def describe(self) -> str:
        if self.kind == "collective":
            group = f"ranks {list(self.ranks)}" if self.ranks is not None else "its group"
            return f"collective {self.name!r} ({self.op} over {group})"
        if self.kind in ("train", "test", "predict"):
            text = f"{self.kind} step {self.step}"
            return text + (f" ({self.detail})" if self.detail else "")
        if self.kind == "api":
            return f"{self.name}()"
        return f"{self.name!r}" + (f" ({self.detail})" if self.detail else "")


def _fmt_traced(traced):
    return ", ".join(f"{name!r} ({op} over ranks {list(ranks)})" if ranks is not None
                     else f"{name!r} ({op})" for op, name, ranks in traced)


class Watchdog:
    """The per-process registry of activities and the thread that checks them."""

    def __init__(self):
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._active = {}
        self._durations = collections.defaultdict(lambda: collections.deque(maxlen=101))
        self._traced = collections.deque(maxlen=4)
        self._traced_count = 0
        self._last_trace = None
        self._last_done = None       # the last step completed, for context
        self.seconds = None          # fixed bound; None: default_bound from step times
        self.enabled = False
        self.rank, self.size = 0, 1
        self.floor, self.factor = FLOOR_SECONDS, STEP_FACTOR
        self.grace = GRACE_SECONDS
        self._thread = None
        self._fired = False
        self.peers = ()              # (rank, host, address, port) of every rank, from init
        self.exit = os._exit         # replaced by tests

    # -- configuration ---------------------------------------------------
    def configure(self, seconds=None, enabled=True, rank=0, size=1, env=None):
        """Set the bound (``seconds`` None: default from step times), the rank
        and size for messages; ``env`` (default ``os.environ``) may override."""
        override = parse_env((os.environ if env is None else env).get(ENV_VAR))
        if override is not None:
            seconds, enabled = (override or None), (override > 0)
        self.seconds = float(seconds) if seconds else None
        self.enabled = bool(enabled)
        self.rank, self.size = int(rank), int(size)

    def start(self):
        """Start the checking thread once (a daemon: it never blocks exit)."""
        with self._lock:
            if self._thread is None and self.enabled:
                self._thread = threading.Thread(target=self._run, name="tfhybrid-watchdog",
                                                daemon=True)
                self._thread.start()

    # -- reports ---------------------------------------------------------
    def begin(self, kind, name, op=None, ranks=None, step=None, detail=None, owner=None):
        """Record an activity in progress; returns a token for :meth:`end`.

        ``owner``: a frame of the current thread that runs the activity until
        :meth:`end` (for activities ended by a later call, such as a step
        between two callbacks: if that frame is gone, an exception ended the
        activity and it is dropped)."""
        token = next(self._ids)
        act = Activity(kind, name, op, ranks, step, detail,
                       owner=(threading.get_ident(), owner) if owner is not None else None)
        with self._lock:
            self._active[token] = act
        return token

    def end(self, token, record=False):
        """The activity ``token`` completed (``record``: keep its duration as a step time)."""
        with self._lock:
            act = self._active.pop(token, None)
            if act is not None and record:
                self._durations[act.kind].append(time.monotonic() - act.start)
                self._last_done = act.describe()

    def traced(self, op, name, ranks=None):
        """A collective was traced into a ``tf.function`` (counts as progress)."""
        with self._lock:
            self._traced.append((op, name, tuple(ranks) if ranks is not None else None))
            self._traced_count += 1
            self._last_trace = time.monotonic()

    # -- the check -------------------------------------------------------
    def median_step(self, kind=None):
        """Median duration of the completed steps of ``kind`` (any kind: the largest)."""
        with self._lock:     # the main thread appends while the watchdog thread reads
            samples = [list(d) for k, d in self._durations.items() if d and kind in (None, k)]
        medians = [statistics.median(d) for d in samples]
        return max(medians) if medians else None

    def bound(self, kind=None) -> float:
        """Seconds an activity of ``kind`` may go without progress."""
        if self.seconds:
            return self.seconds
        step_kind = kind if kind in ("train", "test", "predict") else None
        return default_bound(self.median_step(step_kind), self.floor, self.factor)

    def waited(self, act, now):
        """Seconds without progress: since the activity began, or, for a step,
        since the last collective traced during it (tracing is progress)."""
        since = act.start
        if act.kind in ("train", "test", "predict", "block") and self._last_trace is not None:
            since = max(since, self._last_trace)
        return now - since

    def expired(self, now=None):
        """``(activity, waited, bound)`` of the activity past its bound that has
        waited longest, or None."""
        now = time.monotonic() if now is None else now
        with self._lock:
            acts = list(self._active.items())
        worst = None
        for token, act in acts:
            if act.kind == "api":      # context for the message only; its collectives expire
                continue
            waited, bound = self.waited(act, now), self.bound(act.kind)
            if waited <= bound:
                continue
            if not act.alive():
                self.end(token)
                continue
            if worst is None or waited - bound > worst[1] - worst[2]:
                worst = (act, waited, bound)
        return worst

    def silent_peers(self, timeout=PROBE_SECONDS):
        """The ``(rank, host, address)`` of the other ranks whose listener does
        not accept a TCP connection within ``timeout`` (probed in parallel);
        empty when every rank answers or the peers are unknown."""
        peers = [p for p in self.peers if p[0] != self.rank and p[2] and p[3]]
        answered = set()

        def probe(peer):
            try:
                with socket.create_connection((peer[2], peer[3]), timeout=timeout):
                    answered.add(peer[0])
            except OSError:
                pass

        threads = [threading.Thread(target=probe, args=(p,), daemon=True) for p in peers]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout + 1.0)
        return [(r, host, addr) for r, host, addr, _ in peers if r not in answered]

    def _silent_text(self, silent):
        if not silent:
            return ""
        by_host = {}
        for r, host, addr in silent:
            by_host.setdefault((host, addr), []).append(r)
        names = "; ".join(f"rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))} on host "
                          f"{host} ({addr})" for (host, addr), rs in by_host.items())
        verb = "answer" if len(silent) > 1 else "answers"
        return (f" Silent: {names} {verb} no connection within {PROBE_SECONDS:g} s: that host "
                "is cut off from the network or down, or those processes are gone (see "
                "python -m tfhybrid.docs multinode).")

    def message(self, act, waited, bound, silent=()) -> str:
        """The one-paragraph report printed when ``act`` expired (``silent``:
        :meth:`silent_peers`)."""
        with self._lock:
            others = [a for a in self._active.values() if a is not act]
            traced, count = list(self._traced), self._traced_count
        text = (f"tfhybrid watchdog: rank {self.rank} of {self.size} has waited "
                f"{math.ceil(waited)} s (bound {bound:g} s) in {act.describe()}")
        if others:
            text += ", inside " + ", ".join(a.describe() for a in others)
        elif self._last_done and act.kind == "collective":
            text += f", after {self._last_done}"
        text += "." + self._silent_text(silent)
        if act.kind != "collective" and not any(a.kind == "collective" for a in others):
            if traced:
                text += (f" It runs traced collectives (invisible one by one); the last "
                         f"{len(traced)} of {count} traced in this process: {_fmt_traced(traced)}.")
            else:
                text += " No tfhybrid collective was traced in this process."
        hints = [a.detail for a in others if a.kind == "api" and a.detail]
        if hints:
            text += " " + hints[0]      # the outermost call: the one the script made
        text += (" The other ranks are not completing it with this rank. Most likely the ranks "
                 "diverged: one rank issued a collective the others do not (e.g. "
                 "tfhybrid.callbacks.average_logs or a broadcast called on some ranks only), "
                 "stopped training on its own (model.stop_training = True or TerminateOnNaN on "
                 "one rank only: stop on every rank, e.g. from averaged logs), or built its "
                 "layers under different auto-generated names (an extra layer built on one "
                 "rank: give layers explicit names or build the same layers everywhere) so "
                 "collective names differ; or a rank died or is far slower than the others. "
                 f"Ending the job (exit code {EXIT_CODE}). To allow longer waits, set "
                 "tfhybrid.Config(watchdog_seconds=...) or the environment variable "
                 f"{ENV_VAR}=seconds (0 turns the watchdog off); the default bound is "
                 f"max({self.floor:.0f} s, {self.factor:g} x the median step time).")
        return text

    def fire(self, act, waited, bound):
        """Print the report, give other ranks :attr:`grace` seconds to print
        theirs, and end the process."""
        if self._fired:
            return
        self._fired = True
        try:
            silent = self.silent_peers()
        except Exception:  # noqa: BLE001 (the report must be printed whatever the probe does)
            silent = ()
        msg = self.message(act, waited, bound, silent)
        try:
            os.write(2, ("\n" + msg + "\n").encode(errors="replace"))
        except OSError:
            print(msg, file=sys.stderr, flush=True)
        self.dump_stacks()
        time.sleep(self.grace)
        self.exit(EXIT_CODE)

    def dump_stacks(self):
        """Print where every Python thread of this process stands (the main
        thread's frame shows the step, callback or collective it waits in)."""
        try:
            os.write(2, f"tfhybrid watchdog: Python stacks of rank {self.rank}:\n".encode())
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        except (OSError, ValueError, RuntimeError):
            pass                       # no usable stderr: the report above is what there is

    def _run(self):
        while True:
            time.sleep(POLL_SECONDS)
            if not self.enabled:
                continue
            try:
                worst = self.expired()
            except Exception as err:  # noqa: BLE001 (the watchdog must outlive a bad check)
                print(f"tfhybrid watchdog: check failed ({err!r}); still watching.",
                      file=sys.stderr, flush=True)
                continue
            if worst is not None:
                self.fire(*worst)


_WATCHDOG = Watchdog()


def get() -> Watchdog:
    """The process's :class:`Watchdog`."""
    return _WATCHDOG


_LISTENER = {"socket": None}


def listen():
    """Start (once) the liveness listener: a daemon thread accepting TCP
    connections on an ephemeral port of every address and closing them.
    Returns the port, or None when no socket can be opened."""
    if _LISTENER["socket"] is None:
        try:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind(("0.0.0.0", 0))
            sock.listen(64)
        except OSError:
            return None

        def serve():
            while True:
                try:
                    conn, _ = sock.accept()
                    conn.close()
                except OSError:
                    return

        threading.Thread(target=serve, name="tfhybrid-watchdog-listener", daemon=True).start()
        _LISTENER["socket"] = sock
    return _LISTENER["socket"].getsockname()[1]


def route_address(environ=None):
    """This host's address on the route to the launcher's rendezvous server
    (``HOROVOD_GLOO_RENDEZVOUS_ADDR``; no packet is sent), the address other
    ranks reach this one at; None outside a ``horovodrun --gloo`` job."""
    env = os.environ if environ is None else environ
    target = env.get("HOROVOD_GLOO_RENDEZVOUS_ADDR")
    if not target:
        return None
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            sock.connect((target, int(env.get("HOROVOD_GLOO_RENDEZVOUS_PORT") or 9)))
            return sock.getsockname()[0]
    except (OSError, ValueError):
        return None


def set_peers(peers):
    """Record ``(rank, host, address, port)`` of every rank (from :func:`tfhybrid.init`)."""
    _WATCHDOG.peers = tuple(tuple(p) for p in peers)


def start(config=None, rank=0, size=1):
    """Configure from a :class:`tfhybrid.Config` (and ``TFHYBRID_WATCHDOG_SECONDS``)
    and start the thread when enabled and ``size > 1`` (called by :func:`tfhybrid.init`).

    Raises:
        ValueError: for an invalid ``TFHYBRID_WATCHDOG_SECONDS``.
    """
    seconds = getattr(config, "watchdog_seconds", None)
    enabled = getattr(config, "watchdog", True)
    _WATCHDOG.configure(seconds=seconds, enabled=enabled and size > 1, rank=rank, size=size)
    _WATCHDOG.start()
    return _WATCHDOG


#: Threads whose collectives are never watched: the exit barrier
#: (:mod:`tfhybrid.exit_barrier`) has its own, longer bound.
UNWATCHED_THREADS = ("tfhybrid-exit-barrier",)
_LOCAL = threading.local()


@contextlib.contextmanager
def unwatched():
    """Collectives of the current thread inside this block are not watched
    (for waits with their own bound, such as the barrier at exit)."""
    before = getattr(_LOCAL, "unwatched", False)
    _LOCAL.unwatched = True
    try:
        yield
    finally:
        _LOCAL.unwatched = before


def _is_unwatched():
    return getattr(_LOCAL, "unwatched", False) or \
        threading.current_thread().name in UNWATCHED_THREADS


@contextlib.contextmanager
def collective(op, name, ranks):
    """Report an eager collective while it runs (used by :mod:`tfhybrid.comm.backend`)."""
    if _is_unwatched():
        yield
        return
    token = _WATCHDOG.begin("collective", name, op=op, ranks=ranks)
    try:
        yield
    finally:
        _WATCHDOG.end(token)


def traced(op, name, ranks=None):
    """Report a collective traced into a ``tf.function`` (used by the backend)."""
    _WATCHDOG.traced(op, name, ranks)


@contextlib.contextmanager
def activity(name, detail=None):
    """Watch a block of code: the job ends when it runs longer than the bound
    (collectives traced meanwhile count as progress).

    Use it around each step of a custom training loop whose collectives run
    inside a ``tf.function``, so that a diverged rank ends the job instead of
    hanging it.

    Example:
        >>> for step, batch in enumerate(ds):
        ...     with tfhybrid.watchdog.activity("custom step", detail=f"step {step}"):
        ...         loss = train_step(batch)
    """
    token = _WATCHDOG.begin("block", name, detail=detail)
    try:
        yield
    finally:
        _WATCHDOG.end(token)


def collective_api(name, hint=None):
    """Decorator: calls of a collective tfhybrid function (``tfhybrid.save``,
    ``load``, ``gather``...) are named in the message of a collective that
    hangs inside them, with ``hint`` (default: call it on every rank, e.g.
    not under ``if tfhybrid.is_root():``). The call itself has no bound:
    only the collectives it runs do (a long write on rank 0 is not a hang)."""
    hint = hint or (f"{name}() is collective: every rank must call it, in the same order; "
                    f"called under `if tfhybrid.is_root():` (as with hvd.rank() == 0 in "
                    f"Horovod scripts) it leaves rank 0 waiting here for ranks that never "
                    f"come. Call it on every rank.")

    def decorate(function):
        @functools.wraps(function)
        def wrapper(*args, **kwargs):
            token = _WATCHDOG.begin("api", name, detail=hint)
            try:
                return function(*args, **kwargs)
            finally:
                _WATCHDOG.end(token)
        return wrapper
    return decorate


class WatchdogCallback(keras.callbacks.Callback):
    """Report Keras' train/test/predict steps to the watchdog.

    Each batch is an activity from ``on_*_batch_begin`` to ``on_*_batch_end``;
    completed batches give the median step time of the default bound. A step
    that hangs (a diverged rank) ends the job after the bound with a message
    naming the step and the collectives it runs. Several instances, or the
    same instance listed twice, are harmless.

    tfhybrid adds it to ``fit``/``evaluate``/``predict`` of transformed models
    itself; add it by hand to other models' calls (``callbacks=[...,
    tfhybrid.watchdog.callback()]``). It does nothing unless
    :func:`tfhybrid.init` started the watchdog (multi-process jobs).

    Example:
        >>> model.fit(ds, callbacks=tfhybrid.callbacks.standard() + [tfhybrid.watchdog.callback()])
    """

    # Steps in progress and step counters are per process, shared by all instances.
    _open = {}
    _count = collections.Counter()
    _epoch = [0]

    def _begin(self, kind, batch):
        if kind in WatchdogCallback._open:       # listed twice: one activity per step
            return
        WatchdogCallback._count[kind] += 1
        detail = (f"epoch {WatchdogCallback._epoch[0] + 1}, batch {batch}" if kind == "train"
                  else f"batch {batch}")
        WatchdogCallback._open[kind] = _WATCHDOG.begin(
            kind, f"{kind} step", step=WatchdogCallback._count[kind], detail=detail,
            owner=_caller_outside_callbacks())

    def _end(self, kind, record=True):
        token = WatchdogCallback._open.pop(kind, None)
        if token is not None:
            _WATCHDOG.end(token, record=record)

    def on_train_begin(self, logs=None):
        self._end("train", record=False)     # left open by an exception in an earlier fit
        WatchdogCallback._count["train"] = 0
        WatchdogCallback._epoch[0] = 0

    def on_epoch_begin(self, epoch, logs=None):
        WatchdogCallback._epoch[0] = epoch

    def on_train_batch_begin(self, batch, logs=None):
        self._begin("train", batch)

    def on_train_batch_end(self, batch, logs=None):
        self._end("train")

    def on_test_begin(self, logs=None):
        self._end("test", record=False)
        WatchdogCallback._count["test"] = 0

    def on_test_batch_begin(self, batch, logs=None):
        self._begin("test", batch)

    def on_test_batch_end(self, batch, logs=None):
        self._end("test")

    def on_predict_begin(self, logs=None):
        self._end("predict", record=False)
        WatchdogCallback._count["predict"] = 0

    def on_predict_batch_begin(self, batch, logs=None):
        self._begin("predict", batch)

    def on_predict_batch_end(self, batch, logs=None):
        self._end("predict")

    def on_train_end(self, logs=None):
        self._end("train")

    def on_test_end(self, logs=None):
        self._end("test")

    def on_predict_end(self, logs=None):
        self._end("predict")


def _caller_outside_callbacks():
    """The first frame up the stack outside this module and Keras' callback
    machinery: ``fit``/``evaluate``/``predict``'s loop, which runs the step."""
    frame = sys._getframe(1)
    while frame is not None:
        if not _in_callbacks(frame.f_code):
            return frame
        frame = frame.f_back
    return None


@functools.lru_cache(maxsize=256)
def _in_callbacks(code) -> bool:
    """Whether ``code`` is this module's or Keras' callback machinery (cached per
    code object: the lookup runs at every step's ``on_train_batch_begin``)."""
    path = os.path.abspath(code.co_filename).replace(os.sep, "/")
    return path == _THIS or "/keras/src/callbacks/" in path


_THIS = os.path.abspath(__file__).replace(os.sep, "/")
_CALLBACK = []


def callback() -> WatchdogCallback:
    """The process's :class:`WatchdogCallback` (one instance, reused)."""
    if not _CALLBACK:
        _CALLBACK.append(WatchdogCallback())
    return _CALLBACK[0]
