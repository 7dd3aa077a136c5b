"""Launching jobs on the test hosts (tests/multihost/hosts.py) and the plain
single-process reference; the interpreter and its Horovod build; the lines
of a running job."""
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

from hosts import IFACE, PREFIX

ROOT = Path(__file__).resolve().parents[2]
PATCH = "0100-gloo-process-set-interface"


def python():
    """The ranks' interpreter: TFHYBRID_MULTIHOST_PYTHON, else the one running pytest."""
    return os.environ.get("TFHYBRID_MULTIHOST_PYTHON") or sys.executable


def horovod_patches(py=None):
    """Patches of the Horovod that ``py`` imports (empty: stock build)."""
    out = subprocess.run(
        [py or python(), "-c", "import horovod.tfhybrid_patches as p; print(*p.PATCHES)"],
        capture_output=True, text=True, timeout=120)
    return tuple(out.stdout.split()) if out.returncode == 0 else ()


class Run:
    """Outcome of one launch: ``rc``, ``out`` (stdout+stderr), ``seconds``."""

    def __init__(self, rc, out, seconds):
        self.rc, self.out, self.seconds = rc, out, seconds

    def __repr__(self):
        return f"Run(rc={self.rc}, seconds={self.seconds:.1f}, out=...{self.out[-4000:]})"


def _job(hosts, script, slots, args, env):
    py = python()
    hvdrun = str(Path(py).parent / "horovodrun")
    spec = ",".join(f"{name}:{slots}" for name in hosts.names)
    cmd = [hvdrun, "--gloo", "-np", str(slots * len(hosts.names)), "-H", spec,
           "--network-interface", IFACE, "--start-timeout", "120",
           py, str(script), *map(str, args)]
    return cmd, _env(script, env), spec


def _env(script, env):
    run_env = dict(os.environ, TF_NUM_INTRAOP_THREADS="1", TF_NUM_INTEROP_THREADS="2",
                   OMP_NUM_THREADS="1", TF_CPP_MIN_LOG_LEVEL="2", PYTHONUNBUFFERED="1",
                   PYTHONPATH=os.pathsep.join([str(ROOT), str(Path(script).parent)]))
    for key in ("HOROVOD_STALL_CHECK_TIME_SECONDS", "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS"):
        run_env.pop(key, None)
    run_env.update(env or {})
    return run_env


def start(hosts, script, slots, args=(), env=None):
    """Like :func:`launch` without waiting: a Popen on h1 (stdout and stderr
    merged, text lines), for tests that act while the job runs."""
    cmd, run_env, _ = _job(hosts, script, slots, args, env)
    return subprocess.Popen(hosts.command(hosts.names[0], cmd), cwd=ROOT, env=run_env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, bufsize=1)


def start_elastic(hosts, script, discovery, np, min_np, max_np, args=(), env=None,
                  options=()):
    """``horovodrun`` elastic on h1 (Popen like :func:`start`): ``np`` ranks to
    start with, ``min_np``..``max_np`` later, the hosts and slots that the
    executable ``discovery`` prints; ``options``: more horovodrun options."""
    py = python()
    cmd = [str(Path(py).parent / "horovodrun"), "--gloo", "-np", str(np),
           "--min-np", str(min_np), "--max-np", str(max_np),
           "--host-discovery-script", str(discovery), "--network-interface", IFACE,
           "--start-timeout", "120", *map(str, options), py, str(script), *map(str, args)]
    return subprocess.Popen(hosts.command(hosts.names[0], cmd), cwd=ROOT,
                            env=_env(script, env), text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, bufsize=1)


def launch(hosts, script, slots, args=(), timeout=600, env=None):
    """``horovodrun`` on h1 over the test hosts, ``slots`` ranks on each."""
    cmd, run_env, spec = _job(hosts, script, slots, args, env)
    start = time.time()
    try:
        proc = hosts.run(hosts.names[0], cmd, timeout=timeout, cwd=ROOT, env=run_env)
        rc, out = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as err:
        rc = "timeout"
        out = "".join(x.decode(errors="replace") if isinstance(x, bytes) else (x or "")
                      for x in (err.stdout, err.stderr))
    run = Run(rc, out, time.time() - start)
    print(f"--- {Path(script).name} on {spec}: exit {rc} after {run.seconds:.1f} s", flush=True)
    if rc != 0:
        print(out[-8000:], flush=True)
    return run


def run_plain(script, args=(), timeout=600):
    """The single-process reference: plain ``python script`` on this machine."""
    env = dict(os.environ, TF_NUM_INTRAOP_THREADS="1", TF_NUM_INTEROP_THREADS="2",
               OMP_NUM_THREADS="1", TF_CPP_MIN_LOG_LEVEL="2", PYTHONUNBUFFERED="1",
               PYTHONPATH=str(ROOT))
    for key in list(env):
        if key.startswith("HOROVOD_"):
            env.pop(key)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(Path(script).parent)])
    proc = subprocess.run([python(), str(script), *map(str, args)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)
    return Run(proc.returncode, proc.stdout + proc.stderr, 0.0)


class Lines:
    """The lines of a running job, read by a thread; wait for a pattern."""

    def __init__(self, proc):
        self.proc, self.lines, self.times = proc, [], []
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self):
        for line in self.proc.stdout:
            self.lines.append(line)
            self.times.append(time.monotonic())

    def wait_for(self, pattern, timeout):
        """The time (monotonic) the first line matching ``pattern`` arrived."""
        deadline = time.monotonic() + timeout
        regex = re.compile(pattern)
        seen = 0
        while time.monotonic() < deadline:
            for i in range(seen, len(self.lines)):
                if regex.search(self.lines[i]):
                    return self.times[i]
            seen = len(self.lines)
            if self.proc.poll() is not None and not self._thread.is_alive():
                break
            time.sleep(0.1)
        raise AssertionError(f"no line matching {pattern!r}; output:\n{self.text[-6000:]}")

    def finish(self, timeout):
        rc = self.proc.wait(timeout=timeout)
        self._thread.join(10)
        return rc

    @property
    def text(self):
        return "".join(self.lines)

    def times_of(self, pattern):
        """``(match, time)`` of every line matching ``pattern`` so far."""
        regex = re.compile(pattern)
        return [(m, t) for line, t in zip(list(self.lines), list(self.times))
                for m in [regex.search(line)] if m]


def processes_on(name, script):
    """Pids of the processes running ``script`` (a file name) on test host ``name``."""
    pids = subprocess.run(["ip", "netns", "pids", f"{PREFIX}-{name}"], capture_output=True,
                          text=True).stdout.split()
    out = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if script.encode() in f.read():
                    out.append(int(pid))
        except OSError:
            pass
    return out
