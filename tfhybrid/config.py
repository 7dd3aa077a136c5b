"""Runtime configuration: one validated object, translated to Horovod's env.

Horovod reads its tuning knobs from environment variables at ``hvd.init``;
:func:`tfhybrid.init` applies a :class:`Config` before initialising it, so
this is the one place where tfhybrid's settings become Horovod's.
"""
from __future__ import annotations

import dataclasses
import os


@dataclasses.dataclass(frozen=True)
class Config:
    """tfhybrid runtime settings (all optional).

    Attributes:
        fusion_threshold_bytes: Horovod's runtime tensor-fusion buffer
            (HOROVOD_FUSION_THRESHOLD); None keeps Horovod's default (128 MiB).
        cycle_time_ms: Horovod background-loop cycle (HOROVOD_CYCLE_TIME);
            None keeps Horovod's default (1 ms... 5 ms depending on version).
        stall_check_seconds: Warn when ranks wait on a collective this long
            (HOROVOD_STALL_CHECK_TIME_SECONDS).
        stall_shutdown_seconds: Abort the job when ranks are stalled this long
            (HOROVOD_STALL_SHUTDOWN_TIME_SECONDS), so a failed or diverged rank
            brings the job down instead of hanging it. 0 disables; otherwise it
            must be >= ``stall_check_seconds`` (Horovod 0.28.1 silently drops a
            shorter shutdown, so Config refuses it).
        gloo_timeout_seconds: How long a Gloo collective may wait for a peer
            (HOROVOD_GLOO_TIMEOUT_SECONDS; Horovod's default of 30 s is shorter
            than one slow rank's eager step on a loaded machine). Keep it above
            the watchdog's bound (the defaults are, for steps under a minute):
            then a node lost from the network is reported by the watchdog,
            naming the silent ranks and their hosts, before Gloo times out
            (``python -m tfhybrid.docs multinode``).
        elastic_gloo_timeout_seconds: The Gloo timeout in elastic runs
            (``horovodrun --min-np``, which exports HOROVOD_ELASTIC=1) instead
            of ``gloo_timeout_seconds``: it bounds how long a survivor takes
            to notice a lost worker. Gloo 0.28.1's receive into an unbound
            buffer ignores a peer's closed connection, so a survivor whose
            ring neighbour is a survivor that already stopped its Horovod
            loop waits this long before failing and recovering.
        pin_gpu: Pin one GPU per process by its node-local rank
            (:func:`tfhybrid.local_rank`: horovodrun, MPI or Slurm variables)
            and enable memory growth (ignored without GPUs).
        watchdog: End the job when a collective or a step makes no progress
            for ``watchdog_seconds`` (see :mod:`tfhybrid.watchdog`; Horovod's
            stall check never fires under Gloo). False turns it off.
        watchdog_seconds: The watchdog's bound in seconds; None (default):
            max(100 s, 10 x the median step time). The environment variable
            TFHYBRID_WATCHDOG_SECONDS overrides it (0 or off: no watchdog).
        guards: Consistency guards on transformed models (see
            :mod:`tfhybrid.guards`): at the start of ``fit`` and after the
            first two steps and every ``guard_every_steps`` steps, ranks that
            must feed the same rows compare a checksum of their batch and
            ranks that must hold the same weights compare a checksum of them;
            a mismatch raises on every rank. False turns them off.
        guard_every_steps: Period of the guards after the first steps (0:
            only at the start of each ``fit`` and its first two steps).
        average_metrics: ``evaluate`` of a transformed model (also
            ``fit``'s validation) and each ``fit`` epoch's logs (what
            callbacks and the History see) give the metrics of the whole
            global data set, identical on every rank: the metrics' states
            (totals, counts, confusion counts) are summed over the ranks
            before ``result()``. False: each rank's own values, as plain Keras
            does.
        comm_priority: How many nice levels every other thread of the process
            (the main thread, TensorFlow's pools) runs below Horovod's and
            Gloo's communication threads (TFHYBRID_COMM_PRIORITY; 0 to 19, 0
            turns it off). On CPU
            ranks back-propagation keeps the cores busy while the threads
            that move the gradients sleep on a socket; when a bucket is ready
            or data arrives they then run first, so the link does not idle
            behind compute (between two hosts at 250 Mbit/s the share of
            communication hidden behind back-propagation rose from 0.44-0.48
            to 0.60-0.65). It changes this process's threads only, at ``init``, and
            needs no privilege. See :mod:`tfhybrid.comm.priority`.

    Example:
        >>> tfhybrid.init(model_parallel=2, config=tfhybrid.Config(cycle_time_ms=2))
    """

    fusion_threshold_bytes: int | None = None
    cycle_time_ms: float | None = None
    stall_check_seconds: int = 60
    stall_shutdown_seconds: int = 300
    gloo_timeout_seconds: int = 600
    elastic_gloo_timeout_seconds: int = 60
    pin_gpu: bool = True
    watchdog: bool = True
    watchdog_seconds: float | None = None
    guards: bool = True
    guard_every_steps: int = 1000
    average_metrics: bool = True
    comm_priority: int = 10

    def __post_init__(self):
        for field in ("fusion_threshold_bytes", "cycle_time_ms"):
            v = getattr(self, field)
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0):
                raise ValueError(f"Received an invalid value for `{field}`: {field}={v!r}; "
                                 "expected a non-negative number or None.")
        for field in ("stall_check_seconds", "stall_shutdown_seconds", "gloo_timeout_seconds",
                      "elastic_gloo_timeout_seconds"):
            v = getattr(self, field)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"Received an invalid value for `{field}`: {field}={v!r}; "
                                 "expected a non-negative integer.")
        _check_horovod_rules(self)

        if not isinstance(self.watchdog, bool):
            raise ValueError(f"Received an invalid value for `watchdog`: watchdog={self.watchdog!r}; "
                             "expected True or False.")
        v = self.watchdog_seconds
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))
                              or not 0 < v < float("inf")):
            raise ValueError(f"Received an invalid value for `watchdog_seconds`: "
                             f"watchdog_seconds={v!r}; expected a positive number of seconds or "
                             "None (default bound); use watchdog=False to turn the watchdog off.")
        if not isinstance(self.guards, bool):
            raise ValueError(f"Received an invalid value for `guards`: guards={self.guards!r}; "
                             "expected True or False.")
        v = self.guard_every_steps
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(f"Received an invalid value for `guard_every_steps`: "
                             f"guard_every_steps={v!r}; expected a non-negative integer "
                             "(0: only at the start of fit); use guards=False to turn them off.")
        v = self.comm_priority
        if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= 19:
            raise ValueError(f"Received an invalid value for `comm_priority`: "
                             f"comm_priority={v!r}; expected an integer from 0 (off) to 19, "
                             "the nice levels compute threads run below the communication "
                             "threads (default 10).")
        if not isinstance(self.average_metrics, bool):
            raise ValueError(f"Received an invalid value for `average_metrics`: "
                             f"average_metrics={self.average_metrics!r}; expected True (evaluate "
                             "returns global metrics) or False (each rank's own).")

    def horovod_env(self) -> dict:
        """The Horovod environment variables this config sets."""
        env = {
            "HOROVOD_STALL_CHECK_TIME_SECONDS": str(self.stall_check_seconds),
            "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": str(self.stall_shutdown_seconds),
            "HOROVOD_GLOO_TIMEOUT_SECONDS": str(
                self.elastic_gloo_timeout_seconds if os.environ.get("HOROVOD_ELASTIC") == "1"
                else self.gloo_timeout_seconds),
            "TFHYBRID_COMM_PRIORITY": str(self.comm_priority),
        }
        if self.fusion_threshold_bytes is not None:
            env["HOROVOD_FUSION_THRESHOLD"] = str(int(self.fusion_threshold_bytes))
        if self.cycle_time_ms is not None:
            env["HOROVOD_CYCLE_TIME"] = str(self.cycle_time_ms)
        return env

    def apply(self):
        """Export :meth:`horovod_env`, keeping values the user already exported."""
        for key, value in self.horovod_env().items():
            os.environ.setdefault(key, value)


# Horovod parses these environment variables with strtol into a C int.
_INT_MAX = 2**31 - 1


def _check_horovod_rules(config):
    """Refuse values Horovod 0.28.1 would ignore, truncate or misread silently.

    Rules (horovod/common/stall_inspector.cc, operations.cc, gloo_context.cc):
    a stall shutdown time below the stall check time disables the shutdown
    (one warning in the log); a check time of 0 checks on every cycle and
    warns about every collective; a Gloo timeout of 0 fails every
    rendezvous; the integer knobs are read into a C int (fusion: int64);
    ``nan``/``inf`` are not numbers Horovod can use.
    """
    import math

    for field in ("fusion_threshold_bytes", "cycle_time_ms"):
        v = getattr(config, field)
        if v is not None and not math.isfinite(v):
            raise ValueError(f"Received an invalid value for `{field}`: {field}={v!r}; "
                             "expected a finite non-negative number or None (Horovod's "
                             "default).")
    v = config.fusion_threshold_bytes
    if v is not None and (float(v) != int(v) or v >= 2**63):
        raise ValueError(f"Received an invalid value for `fusion_threshold_bytes`: "
                         f"fusion_threshold_bytes={v!r}; expected a whole number of bytes "
                         "below 2**63 (Horovod reads an integer), e.g. 64 * 2**20.")
    for field in ("stall_check_seconds", "stall_shutdown_seconds", "gloo_timeout_seconds",
                  "elastic_gloo_timeout_seconds"):
        v = getattr(config, field)
        if v > _INT_MAX:
            raise ValueError(f"Received an invalid value for `{field}`: {field}={v!r}; "
                             f"expected at most {_INT_MAX} seconds (Horovod reads a C int and "
                             "would wrap the value around).")
    if config.stall_check_seconds == 0:
        raise ValueError(
            "Received an invalid value for `stall_check_seconds`: stall_check_seconds=0; "
            "expected a positive number of seconds: Horovod would check on every cycle and "
            "warn about every collective not yet ready on all ranks. Use e.g. "
            "stall_check_seconds=60 (the default).")
    if 0 < config.stall_shutdown_seconds < config.stall_check_seconds:
        raise ValueError(
            f"Received stall_shutdown_seconds={config.stall_shutdown_seconds} below "
            f"stall_check_seconds={config.stall_check_seconds}: Horovod 0.28.1 then disables "
            "the stall shutdown (it only logs 'will not shutdown'). Use stall_shutdown_seconds "
            f">= stall_check_seconds (e.g. Config(stall_check_seconds="
            f"{min(config.stall_check_seconds, config.stall_shutdown_seconds)}, "
            f"stall_shutdown_seconds={config.stall_shutdown_seconds}) or stall_shutdown_seconds="
            f"{config.stall_check_seconds}), or 0 for no shutdown.")
    for field, default in (("gloo_timeout_seconds", 600), ("elastic_gloo_timeout_seconds", 60)):
        if getattr(config, field) == 0:
            raise ValueError(
                f"Received an invalid value for `{field}`: {field}=0; "
                "expected a positive number of seconds: with 0 every Gloo rendezvous and "
                f"collective wait times out at once. Use e.g. {field}={default} (the "
                "default).")
