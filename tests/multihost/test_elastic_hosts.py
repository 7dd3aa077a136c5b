"""Elastic jobs across two test hosts (tests/multihost/hosts.py): ``horovodrun
--gloo -np 2 --min-np 1 --max-np 2 --host-discovery-script ... --network-interface
eth0`` launched on h1, one rank on each host, training elastic_script.py (STEPS
global batches, a commit after each; the ranks wait at gates after the
commits of batches LOSS and BACK while the test changes the hosts). The
discovery script prints the file ``hosts`` that the test writes. Two ways of
losing h2 at gate LOSS:

- ``removed``: h2 leaves the discovery list (a scale-down, a preemption the
  scheduler announces). The driver tells rank 0; the next commit raises
  Horovod's ``HostsUpdatedInterrupt`` on both ranks, h2's rank is told at
  Horovod's next rendezvous that it is no longer part of the job and ends,
  h1 goes on from that commit (LOSS + 1) at 1 rank.
- ``lost``: h2 is cut off the network (nft, both ways) and its rank killed, as
  a host that loses power would be, and leaves the discovery list. The rank
  on h1 notices when its next collective times out (HOROVOD_GLOO_TIMEOUT_SECONDS
  = GLOO_TIMEOUT), Horovod's driver when its ssh session to h2 ends (ssh
  keep-alives, KEEPALIVE; without them the session to a cut-off host never
  ends and the survivor waits at Horovod's rendezvous for good); the driver
  blacklists h2 (``--blacklist-cooldown-range 1 2`` lets it back later), and
  h1 goes on from the last commit (LOSS) at 1 rank.

At gate BACK (1 rank) h2 is listed again: the driver starts a new rank on it
and the job grows back to 2 ranks from the next commit (BACK + 1). Each case
checks

- the fits: from batch 0 on 2 ranks, from the commit on 1, from BACK + 1 on 2
  (``df``: its layers split over both hosts on 2 ranks, whole on 1), and
  every batch trained once as the job saw it (no commit lost, none redone);
- the running loss of the 1-rank stretch and the last fit's History against
  one plain Keras process trained batch after batch;
- the final gathered weights against that process (largest difference over
  the largest weight below 1e-5, as tests/integration/test_elastic.py). That
  process is also the run resumed from the commit: tfhybrid restores weights,
  slots and step count exactly, and the global batch does not depend on the
  world size;
- the ranks at the end: rank 0 on h1 (2 resets) and rank 1 a new process on
  h2, no rank of the first attempt left on h2, the survivor noticing a lost
  host no sooner than its Gloo timeout, and no watchdog report.

The core tier runs ``d`` with the host lost (~2 min here); the full tier adds
``d`` removed and ``df`` (model groups of 2 spanning the hosts) both ways.
"""
import json
import os
import re
import signal
import subprocess
import time

import numpy as np
import pytest

from jobs import ROOT, Lines, processes_on, run_plain, start_elastic

from tests.tier_marks import full_tier   # make test-full runs every case; make test a core

SCRIPT = ROOT / "tests" / "multihost" / "elastic_script.py"
STEPS, LOSS, BACK = 9, 3, 6
GLOO_TIMEOUT = 40           # s; must exceed a new rank's start (ssh, TensorFlow import)
KEEPALIVE = {"ServerAliveInterval": 2, "ServerAliveCountMax": 3}
ENV = {"HOROVOD_GLOO_TIMEOUT_SECONDS": str(GLOO_TIMEOUT)}
START = 300                 # s for the job to reach its first gate on a loaded machine
_RESULT = re.compile(r"RESULT (\{.*\})")
OUT = r"(?:^|<stdout>:)"     # a line a rank printed (horovodrun prefixes "[r]<stdout>:")


def resumes(fault):
    """Where the 1-rank and the final 2-rank fits start. The gates wait after
    their batch's commit. A lost host fails the next batch's collectives: the
    survivor goes on from the commit at LOSS. A host taken off the list is
    noticed by the next commit (LOSS + 1), which raises Horovod's interrupt on
    every rank after saving; the job goes on from it. A host listed again
    likewise joins at the commit after BACK."""
    return (LOSS if fault == "lost" else LOSS + 1), BACK + 1


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    out = tmp_path_factory.mktemp("plain_elastic")
    run = run_plain(SCRIPT, [out, "d", 1, STEPS])
    assert run.rc == 0, run
    got = dict(np.load(out / "plain.npz"))
    return got.pop("losses"), got


def rank_processes(name):
    """Pids of elastic_script.py processes on host ``name``."""
    return processes_on(name, "elastic_script.py")


def _write(path, text):
    tmp = path.with_suffix(".new")
    tmp.write_text(text)
    os.replace(tmp, path)           # the discovery script never reads half a file


def _stop(proc):
    """End a job that is still running: horovodrun ends its ranks on SIGTERM."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
    for name in ("h1", "h2"):
        for pid in rank_processes(name):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def run_case(hosts, tmp_path, strategy, mp, fault):
    """One elastic job: h2 goes at gate LOSS (``fault``), comes back at gate BACK.
    Returns the job's Lines and the measured seconds."""
    listing = tmp_path / "hosts"
    calls = tmp_path / "discovery_calls"
    discover = tmp_path / "discover.sh"
    discover.write_text(f"#!/bin/sh\necho >> {calls}\ncat {listing}\n")
    discover.chmod(0o755)
    # h1 first, then both: Horovod keeps the order in which hosts appeared, so rank 0
    # starts on h1 (hosts discovered together are ordered by a Python set)
    _write(listing, "h1:1\n")
    seconds = {}
    one, two = resumes(fault)
    with hosts.ssh_client_options(**KEEPALIVE):
        proc = start_elastic(hosts, SCRIPT, discover, 2, 1, 2,
                             args=[tmp_path, strategy, mp, STEPS, f"{LOSS},{BACK}"], env=ENV,
                             options=["--blacklist-cooldown-range", 1, 2])
        job = Lines(proc)
        began = time.monotonic()
        try:
            deadline = time.monotonic() + 60
            while not (calls.exists() and calls.read_text()):
                assert time.monotonic() < deadline and proc.poll() is None, job.text[-6000:]
                time.sleep(0.1)
            _write(listing, "h1:1\nh2:1\n")
            seconds["start"] = job.wait_for(OUT + rf"GATE {LOSS} 2\b", timeout=START) - began
            first_h2 = rank_processes("h2")
            assert first_h2, "no rank on h2"
            if fault == "lost":
                hosts.cut("h2")
                for pid in first_h2:
                    os.kill(pid, signal.SIGKILL)
            _write(listing, "h1:1\n")
            if fault == "removed":
                job.wait_for(OUT + r"HOSTS UPDATED 1\b", timeout=30)
            (tmp_path / f"go_{LOSS}").touch()
            went = time.monotonic()
            resumed = job.wait_for(OUT + rf"FIT {one} 1 1\b", timeout=GLOO_TIMEOUT + 120)
            seconds["detect"] = resumed - went
            job.wait_for(OUT + rf"GATE {BACK} 1\b", timeout=120)
            if fault == "lost":
                hosts.restore("h2")
            seconds["h2_left"] = rank_processes("h2")
            _write(listing, "h1:1\nh2:1\n")
            job.wait_for(OUT + r"HOSTS UPDATED 2\b", timeout=30)
            (tmp_path / f"go_{BACK}").touch()
            went = time.monotonic()
            joined = job.wait_for(OUT + rf"FIT {two} 2 {mp}\b", timeout=GLOO_TIMEOUT + 120)
            seconds["rejoin"] = joined - went
            seconds["rc"] = job.finish(timeout=300)
            seconds["total"] = time.monotonic() - began
        finally:
            hosts.restore("h2")
            _stop(proc)
            (tmp_path / "job.log").write_text(job.text)
    seconds["left"] = rank_processes("h1") + rank_processes("h2")
    return job, seconds


def check(job, seconds, plain, tmp_path, strategy, mp, fault):
    out = job.text
    tail = out[-8000:]
    one, two = resumes(fault)
    assert seconds["rc"] == 0, tail
    # every fit: where it started, on how many ranks, with which model groups
    fits = [tuple(int(v) for v in m.groups())
            for m, _ in job.times_of(OUT + r"FIT (\d+) (\d+) (\d+) (\d+)")]
    assert [f[:3] for f in fits] == [(0, 2, mp), (one, 1, 1), (two, 2, mp)], (fits, tail)
    # on 2 ranks df splits the layers over the hosts; on 1 rank it holds them whole
    whole = sum(w.size for w in plain[1].values())
    assert [f[3] < whole for f in fits] == [mp > 1, False, mp > 1], (fits, whole)
    # every batch once: from the last commit, nothing lost and nothing redone
    steps = [(int(m.group(1)), int(m.group(2)), float(m.group(3)))
             for m, _ in job.times_of(OUT + r"STEP (\d+) (\d+) (\S+)")]
    assert [s[0] for s in steps] == list(range(1, STEPS + 1)), (steps, tail)
    assert [s[1] for s in steps] == [2] * one + [1] * (two - one) + [2] * (STEPS - two), steps
    losses, weights = plain
    # on 1 rank the running loss covers every row: plain Keras' mean from the commit on
    single = [s[2] for s in steps if s[1] == 1]
    expected = np.cumsum(losses[one:two]) / np.arange(1, two - one + 1)
    np.testing.assert_allclose(single, expected, rtol=1e-4, err_msg="running loss on 1 rank")
    (history,) = [float(m.group(2)) for m, _ in job.times_of(OUT + r"HISTORY (\d+) (\S+)")
                  if int(m.group(1)) == two]
    np.testing.assert_allclose(history, np.mean(losses[two:]), rtol=1e-4,
                               err_msg="History of the last fit")
    got = dict(np.load(tmp_path / "weights.npz"))
    assert sorted(got) == sorted(weights), (sorted(got), sorted(weights))
    rel = max(float(np.max(np.abs(got[k] - w)) / (np.max(np.abs(w)) + 1e-12))
              for k, w in weights.items())
    print(f"elastic {strategy} across hosts, h2 {fault}: start {seconds['start']:.1f} s, loss "
          f"noticed after {seconds['detect']:.1f} s, back after {seconds['rejoin']:.1f} s, job "
          f"{seconds['total']:.1f} s; weights vs plain Keras: max rel diff {rel:.2e}")
    assert rel < 1e-5, rel
    results = sorted((json.loads(m.group(1)) for m in _RESULT.finditer(out)),
                     key=lambda r: r["rank"])
    assert [(r["rank"], r["size"], r["host"], r["resets"]) for r in results] == \
        [(0, 2, "h1", 2), (1, 2, "h2", 0)], (results, tail)
    removed = "h2[0] has been removed from elastic job" in out
    assert removed == (fault == "removed"), tail
    assert not seconds["h2_left"], f"ranks of the first attempt still on h2: {seconds['h2_left']}"
    assert not seconds["left"], f"ranks left after the job: {seconds['left']}"
    if fault == "lost":
        # the survivor noticed by its Gloo timeout, not sooner (nothing told it)
        assert seconds["detect"] >= GLOO_TIMEOUT - 1, seconds
    assert "tfhybrid watchdog:" not in out, tail


@pytest.mark.parametrize("strategy, mp, fault", [
    ("d", 1, "lost"),
    pytest.param("d", 1, "removed", marks=full_tier),
    pytest.param("df", 2, "lost", marks=full_tier),
    pytest.param("df", 2, "removed", marks=full_tier),
])
def test_host_goes_and_comes_back(strategy, mp, fault, needs_patch, hosts, plain, tmp_path):
    job, seconds = run_case(hosts, tmp_path, strategy, mp, fault)
    check(job, seconds, plain, tmp_path, strategy, mp, fault)
