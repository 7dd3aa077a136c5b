"""Run user-style scripts under real ``horovodrun`` (no barriers added by the harness).

The standard: each way a user writes a script is a test. A test writes
(or names) a script, launches it with :func:`launch` at 2 or 4 processes and
checks the exit code, the output and the time from launch to exit. Scripts
print machine-readable lines ``RESULT <json>`` that :func:`results` parses
(one dict per rank that printed one).

The single-process reference runs the same script with ``np=1`` (plain
``python``, no horovodrun), so a script compares itself with single-process
training by being run twice.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

# The full tier (make test-full) also runs the user scripts marked full_tier: more
# world sizes and kinds of the same checks.
from tests.tier_marks import FULL_TIER, full_tier  # noqa: F401  (re-exported)

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ROOT / "tests" / "user_scripts"
HOROVODRUN = Path(sys.executable).parent / "horovodrun"


class Run:
    """Outcome of one launch: ``rc``, ``out`` (stdout+stderr), ``seconds``."""

    def __init__(self, rc, out, seconds):
        self.rc, self.out, self.seconds = rc, out, seconds

    def __repr__(self):
        return f"Run(rc={self.rc}, seconds={self.seconds:.1f}, out=...{self.out[-3000:]})"


def env_for(extra=None):
    env = dict(os.environ, TF_NUM_INTRAOP_THREADS="1", TF_NUM_INTEROP_THREADS="2",
               OMP_NUM_THREADS="1", TF_CPP_MIN_LOG_LEVEL="2", PYTHONUNBUFFERED="1",
               PYTHONPATH=str(ROOT))
    # The parallel suite's own Horovod stall settings must not leak into user scripts.
    for key in ("HOROVOD_STALL_CHECK_TIME_SECONDS", "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS"):
        env.pop(key, None)
    env.update(extra or {})
    return env


def launch(script, np=2, args=(), timeout=300, env=None) -> Run:
    """Run ``script`` (a path, or a name in tests/user_scripts) on ``np`` processes.

    ``np=1`` runs plain ``python`` (the single-process reference). The
    timeout is a safety net: a test that reaches it reports a hang.
    """
    path = Path(script)
    if not path.is_absolute() and not path.exists():
        path = SCRIPTS / script
    cmd = [sys.executable, str(path), *map(str, args)]
    if np > 1:
        cmd = [str(HOROVODRUN), "-np", str(np), "--gloo", *cmd]
    start = time.time()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env_for(env), capture_output=True,
                              text=True, timeout=timeout)
        rc, out = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as err:
        rc = "timeout"
        out = ((err.stdout or b"").decode(errors="replace") if isinstance(err.stdout, bytes)
               else (err.stdout or "")) + ((err.stderr or b"").decode(errors="replace")
                                             if isinstance(err.stderr, bytes) else (err.stderr or ""))
    run = Run(rc, out, time.time() - start)
    if rc != 0:   # shown under "Captured stdout" if the test fails (an assert's repr is cut)
        print(f"--- {path.name} (np={np}) exit {rc} after {run.seconds:.1f} s; output tail:\n"
              f"{out[-8000:]}", flush=True)
    return run


_RESULT = re.compile(r"RESULT (\{.*\})")


def results(run: Run) -> list:
    """The ``RESULT {json}`` dicts the ranks printed, in output order."""
    return [json.loads(m.group(1)) for m in _RESULT.finditer(run.out)]


# socketserver's report of a request whose client went away, printed by the
# horovodrun driver's rendezvous HTTP server (horovod/runner/http/http_server.py)
# when a worker dies or is stopped while it reads a key: the driver's own
# stderr, not a worker's, and it does not change the run.
_DRIVER_DROPPED_REQUEST = re.compile(
    r"-{40}\nException occurred during processing of request from [^\n]*\n"
    r"Traceback \(most recent call last\):\n(?:[ \t][^\n]*\n)*?"
    r"(?:BrokenPipeError|ConnectionResetError)[^\n]*\n-{40}\n")


def without_driver_dropped_requests(out: str) -> str:
    """``out`` without the driver's reports of requests from a worker that went away.

    Only reports whose frames include Horovod's rendezvous server
    (``http_server.py``) and that end in a broken or reset connection are
    removed; any other traceback stays in the text.
    """
    return _DRIVER_DROPPED_REQUEST.sub(
        lambda m: "" if "horovod/runner/http/http_server.py" in m.group(0) else m.group(0), out)
