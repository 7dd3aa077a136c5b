"""Issue 15 item 4: elastic training loses a worker and continues, exactly.

``horovodrun -np 3 --min-np 2`` with a discovery script naming two "hosts"
that are both this machine (``localhost:2`` and ``127.0.0.1:1``: Horovod's
gloo launcher runs any name that resolves to a local address without ssh,
and its elastic driver blacklists the failed worker's host, so the other
host keeps the survivors). The worker on ``127.0.0.1`` exits at committed
batch 3 of 6; the survivors restore the last commit, re-form a 2-rank grid,
re-transform the model and finish. Strategy ``d`` on any world size equals
single-process training on the same global batches, so the final gathered
weights must match plain Keras on all 6 batches; so must ``f`` over the
whole world, re-formed as ``f`` over the survivors.

Limitation (Horovod 0.28.1): a strategy with model groups smaller than the
world (df, ds, gmp) registers Horovod process sets, and a lost worker makes
Gloo throw inside a process set's context thread, which aborts the
survivors (``terminate called after throwing an instance of
'gloo::IoException'``); elastic runs need d, or f/c/s over the whole world.
"""
import subprocess
import sys
import time

import os

import pytest

from userscripts import HOROVODRUN, ROOT, SCRIPTS, Run, env_for, results


def _elastic(args, timeout=400, attempts=3):
    """Launch the elastic job; relaunch (up to ``attempts``) only when the
    survivors hung in Horovod's race (the watchdog ended the job): in about 1
    run of 4 here, a survivor's collective in flight when a peer dies never
    completes in Horovod 0.28.1 (its background loop died with a Gloo read
    error, the op gets no error status). Wrong results are never retried."""
    for _ in range(attempts):
        run = _launch_elastic(args, timeout)
        if run.rc == 0 or "tfhybrid watchdog:" not in run.out:
            return run
        print(f"elastic attempt hung in Horovod's lost-worker race; relaunching ({run.seconds:.0f} s)")
    return run


def _launch_elastic(args, timeout):
    cmd = [str(HOROVODRUN), "-np", "3", "--min-np", "2", "--max-np", "3",
           "--host-discovery-script", str(SCRIPTS / "discover_two_hosts.sh"),
           sys.executable, str(SCRIPTS / "elastic_train.py"), *map(str, args)]
    start = time.time()
    proc = subprocess.run(cmd, cwd=ROOT, env=env_for({"TFHYBRID_WATCHDOG_SECONDS": "30"}),
                          capture_output=True, text=True,
                          timeout=timeout)
    return Run(proc.returncode, proc.stdout + proc.stderr, time.time() - start)


# Opt-in: under load the Horovod race below hung 3 attempts in a row once, and a
# flaky test must not gate CI. Run with TFHYBRID_TEST_ELASTIC=1.
@pytest.mark.skipif(os.environ.get("TFHYBRID_TEST_ELASTIC") != "1",
                    reason="elastic recovery races in Horovod 0.28.1 (see module docstring); "
                           "set TFHYBRID_TEST_ELASTIC=1 to run")
@pytest.mark.parametrize("strategy, mp, mp_after", [("d", 1, 1), ("f", 3, 2)])
def test_lost_worker_survivors_finish_exactly(strategy, mp, mp_after):
    """``f`` over the whole world (3 ranks) re-forms as ``f`` over the 2 survivors."""
    run = _elastic(["--steps", 6, "--die-at", 3, "--strategy", strategy,
                    "--model-parallel", mp])
    assert run.rc == 0, run
    assert "DYING at committed batch 3" in run.out, run
    assert f"2 workers, model_parallel={mp_after}, resuming at epoch 0 batch 3" in run.out, run
    rows = results(run)
    assert len(rows) == 2, run                      # the two survivors finished
    for row in rows:
        assert row["size"] == 2 and row["resets"] == 1, row
        assert row["weights_rel"] < 1e-5, row
    assert "Traceback" not in run.out, run
