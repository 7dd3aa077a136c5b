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
            brings the job down instead of hanging it. 0 disables.
        gloo_timeout_seconds: How long a Gloo collective may wait for a peer
            (HOROVOD_GLOO_TIMEOUT_SECONDS; Horovod's default of 30 s is shorter
            than one slow rank's eager step on a loaded machine).
        pin_gpu: Pin one GPU per process by Horovod local rank and enable
            memory growth (ignored without GPUs).
        watchdog: End the job when a collective or a step makes no progress
            for ``watchdog_seconds`` (see :mod:`tfhybrid.watchdog`; Horovod's
            stall check never fires under Gloo). False turns it off.
        watchdog_seconds: The watchdog's bound in seconds; None (default):
            max(100 s, 10 x the median step time). The environment variable
            TFHYBRID_WATCHDOG_SECONDS overrides it (0 or off: no watchdog).

    Example:
        >>> tfhybrid.init(model_parallel=2, config=tfhybrid.Config(cycle_time_ms=2))
    """

    fusion_threshold_bytes: int | None = None
    cycle_time_ms: float | None = None
    stall_check_seconds: int = 60
    stall_shutdown_seconds: int = 300
    gloo_timeout_seconds: int = 600
    pin_gpu: bool = True
    watchdog: bool = True
    watchdog_seconds: float | None = None

    def __post_init__(self):
        for field in ("fusion_threshold_bytes", "cycle_time_ms"):
            v = getattr(self, field)
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0):
                raise ValueError(f"Received an invalid value for `{field}`: {field}={v!r}; "
                                 "expected a non-negative number or None.")
        for field in ("stall_check_seconds", "stall_shutdown_seconds", "gloo_timeout_seconds"):
            v = getattr(self, field)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"Received an invalid value for `{field}`: {field}={v!r}; "
                                 "expected a non-negative integer.")

        if not isinstance(self.watchdog, bool):
            raise ValueError(f"Received an invalid value for `watchdog`: watchdog={self.watchdog!r}; "
                             "expected True or False.")
        v = self.watchdog_seconds
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))
                              or not 0 < v < float("inf")):
            raise ValueError(f"Received an invalid value for `watchdog_seconds`: "
                             f"watchdog_seconds={v!r}; expected a positive number of seconds or "
                             "None (default bound); use watchdog=False to turn the watchdog off.")

    def horovod_env(self) -> dict:
        """The Horovod environment variables this config sets."""
        env = {
            "HOROVOD_STALL_CHECK_TIME_SECONDS": str(self.stall_check_seconds),
            "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": str(self.stall_shutdown_seconds),
            "HOROVOD_GLOO_TIMEOUT_SECONDS": str(self.gloo_timeout_seconds),
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
