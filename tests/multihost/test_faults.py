"""Faults on the wire between two test hosts (tests/multihost/hosts.py), each
against a job of fault_script.py (strategy df, a model group of 2 spanning h1
and h2, so every step crosses the link) at 2 hosts x 1 rank:

- a host cut off mid-fit: the job ends on every host, non-zero, within
  BOUND + MARGIN s (the watchdog: TFHYBRID_WATCHDOG_SECONDS=BOUND, so the test runs
  fast; the default bound and tfhybrid's Gloo timeout are in
  ``python -m tfhybrid.docs multinode``), with a message naming the silent
  rank and its host;
- a link down for less than the bound, then limited to 1 Mbit/s (``tc tbf``):
  the job finishes with the weights of one undisturbed plain process (no
  false failure);
- sshd missing on h2: the job ends before any training, with ssh's message
  naming h2.
"""
import re
import time

import numpy as np
import pytest

from jobs import ROOT, Lines, launch, processes_on, run_plain, start

from tests.tier_marks import full_tier   # make test-full runs every case; make test a core

SCRIPT = ROOT / "tests" / "multihost" / "fault_script.py"
BOUND = 30                      # the watchdog's bound in these jobs (seconds)
# what may come on top of the bound: the probe of the silent peers (2 s), the
# watchdog's grace (3 s), horovodrun ending the job and the slowest poll here
MARGIN = 25
DOWN = 8                        # seconds the link is down (below BOUND)
ENV = {"TFHYBRID_WATCHDOG_SECONDS": str(BOUND)}


def rank_processes(hosts, name):
    """Pids of fault_script.py processes on host ``name``."""
    return processes_on(name, "fault_script.py")


def test_host_cut_off_ends_the_job(needs_patch, hosts, tmp_path):
    proc = start(hosts, SCRIPT, 1, args=[tmp_path, 50, 8, 2], env=ENV)
    job = Lines(proc)
    try:
        job.wait_for(r"EPOCH 2 ", timeout=300)
        hosts.cut("h2")
        cut = time.monotonic()
        (tmp_path / "resume_2").touch()
        rc = job.finish(timeout=BOUND + MARGIN + 60)
        ended = time.monotonic() - cut
        # the ranks on h2 end themselves too (their own watchdog), though the
        # launcher on h1 cannot reach them
        while rank_processes(hosts, "h2") and time.monotonic() - cut < BOUND + MARGIN:
            time.sleep(0.5)
        h2_left = rank_processes(hosts, "h2")
        h2_ended = time.monotonic() - cut
    finally:
        hosts.restore("h2")
        if proc.poll() is None:
            proc.kill()
    print(f"host cut off: job ended after {ended:.1f} s, h2's rank after <= {h2_ended:.1f} s "
          f"(bound {BOUND} s)")
    out = job.text
    print(next((line for line in out.splitlines() if "tfhybrid watchdog:" in line), "")[:600])
    assert rc != 0, out[-6000:]
    assert "DONE" not in out
    assert ended <= BOUND + MARGIN, (ended, out[-6000:])
    assert not h2_left, f"ranks still running on h2 {h2_ended:.0f} s after the cut: {h2_left}"
    assert re.search(rf"tfhybrid watchdog: rank 0 of 2 has waited \d+ s \(bound {BOUND} s\)",
                     out), out[-6000:]
    assert re.search(r"Silent: rank 1 on host h2 \(10\.213\.47\.12\) answers no connection",
                     out), out[-6000:]


@pytest.fixture(scope="module")
def undisturbed(tmp_path_factory):
    out = tmp_path_factory.mktemp("plain_fault")
    run = run_plain(SCRIPT, [out, 6, 8])
    assert run.rc == 0, run
    return dict(np.load(out / "weights.npz"))


@full_tier
def test_link_down_then_slow_link_finishes_exactly(needs_patch, hosts, undisturbed, tmp_path):
    """Epoch 2 starts with the link down for DOWN s (< BOUND), epochs 4-6
    run over links limited to 1 Mbit/s each way; the weights equal one
    undisturbed plain process's."""
    proc = start(hosts, SCRIPT, 1, args=[tmp_path, 6, 8, "1,3"], env=ENV)
    job = Lines(proc)
    try:
        job.wait_for(r"EPOCH 1 ", timeout=300)
        hosts.cut("h2")
        (tmp_path / "resume_1").touch()
        resumed = time.monotonic()
        time.sleep(DOWN)
        hosts.restore("h2")
        held_up = job.wait_for(r"EPOCH 2 ", timeout=BOUND + 60) - resumed
        job.wait_for(r"EPOCH 3 ", timeout=BOUND + 60)
        for name in hosts.names:
            hosts.limit(name, "1mbit")
        (tmp_path / "resume_3").touch()
        rc = job.finish(timeout=300)
    finally:
        hosts.restore("h2")
        for name in hosts.names:
            hosts.unlimit(name)
        if proc.poll() is None:
            proc.kill()
    out = job.text
    assert rc == 0, out[-6000:]
    seconds = {int(e): float(s) for e, s in re.findall(r"EPOCH (\d+) ([0-9.]+)", out)}
    print(f"link down {DOWN} s: epoch 2 ended {held_up:.1f} s after it began; epoch seconds "
          f"(1 Mbit/s from epoch 4): {seconds}")
    assert sorted(seconds) == list(range(1, 7)), out[-6000:]
    assert held_up >= DOWN - 0.5, held_up        # the outage held the job up
    got = dict(np.load(tmp_path / "weights.npz"))
    assert sorted(got) == sorted(undisturbed)
    scale = max(float(np.max(np.abs(v))) for v in undisturbed.values())
    for key, value in undisturbed.items():
        np.testing.assert_allclose(got[key], value, rtol=1e-4, atol=1e-5 * scale, err_msg=key)


@full_tier
def test_sshd_missing_stops_before_training(needs_patch, hosts, tmp_path):
    hosts.stop_sshd("h2")
    try:
        run = launch(hosts, SCRIPT, 1, args=[tmp_path, 1, 2], timeout=300, env=ENV)
    finally:
        hosts.start_sshd("h2")
    assert run.rc != 0, run
    assert "EPOCH" not in run.out and "DONE" not in run.out, run
    # horovodrun checks every host by ssh before it starts any rank ("ssh not
    # successful for host h2"), unless its cache (~/.horovod, 60 min) remembers an
    # earlier success for these hosts: then the ssh that would start h2's rank
    # fails and horovodrun ends the job. Either way ssh's own line names h2.
    assert re.search(r"ssh: connect to host h2 port 22: Connection refused", run.out), run
    print(f"sshd missing on h2: horovodrun exited {run.rc} after {run.seconds:.1f} s; "
          + ("its ssh check" if "ssh not successful for host h2" in run.out
             else "the rank's ssh (cached check)"))
