"""Ranks that diverge end the job (tfhybrid.watchdog), timed from the fault.

Every run of ``tests/user_scripts/hang_divergence.py`` is launched at once
(one thread per job) so the jobs cost about their longest one instead of their
sum. The two long waits (the default bound, ~100 s after the fault, and the
75 s pause: BACKGROUND) are launched by tests/integration/conftest.py as soon as
the session is collected, so that mostly idle wall time passes while the other
modules' tests run; the short-bound jobs start with this module (at the end of
the session), so their timing is not measured beside other modules' start-ups.
What the jobs check:

- each divergence case at -np 2 with a short bound (``--watchdog-seconds 30``,
  via ``tfhybrid.Config``) ends non-zero within the bound + margin, and every
  hung rank names what it waits in;
- one case at -np 4 (model groups and data groups);
- ``tfhybrid.save`` or ``model.evaluate`` called on rank 0 only: the report names
  the call and the fix;
- the defaults (no bound given) end a hang within 120 s of the fault;
- a rank pausing 75 s inside one step does not end a healthy job with the defaults.
"""
import re
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.integration.userscripts import launch, results

SCRIPT = "hang_divergence.py"
SHORT = 30.0        # the short bound of the per-case runs
MARGIN = 20.0       # poll (1 s) + grace (3 s) + horovodrun teardown, on a loaded node
DEFAULT_TARGET = 120.0
NO_OVERRIDE = {"TFHYBRID_WATCHDOG_SECONDS": ""}

JOBS = {
    "extra_collective": (2, ["extra_collective", "--watchdog-seconds", SHORT]),
    "stop_one_rank": (2, ["stop_one_rank", "--watchdog-seconds", SHORT]),
    "terminate_nan": (2, ["terminate_nan", "--watchdog-seconds", SHORT]),
    "layer_names": (2, ["layer_names", "--watchdog-seconds", SHORT]),
    "layer_names_np4": (4, ["layer_names", "--watchdog-seconds", SHORT, "--no-guards"]),
    "save_on_root": (2, ["save_on_root", "--watchdog-seconds", SHORT, "--epochs", 1, "--steps", 4]),
    "evaluate_on_root": (2, ["evaluate_on_root", "--watchdog-seconds", SHORT, "--epochs", 1,
                             "--steps", 4]),
    "call_on_root": (2, ["call_on_root", "--watchdog-seconds", SHORT, "--epochs", 1,
                         "--steps", 4]),
    "default_bound": (2, ["stop_one_rank"]),
    "slow_rank": (2, ["slow_rank", "--pause", 75, "--epochs", 1, "--steps", 10]),
}


def _run(job):
    np_, args = JOBS[job]
    start = time.time()
    run = launch(SCRIPT, np=np_, args=args, timeout=400, env=NO_OVERRIDE)
    run.end = start + run.seconds
    faults = [float(t) for t in re.findall(r"FAULT ([0-9.]+)", run.out)]
    run.fault = min(faults) if faults else None
    after = f"{run.end - run.fault:.1f} s after the fault" if run.fault else "no fault"
    # printed by the fixture: this thread may run while another module's test captures output
    run.summary = f"watchdog job {job} (-np {np_}): exit {run.rc} {after}, {run.seconds:.1f} s in all"
    return run


_FUTURES = {}


BACKGROUND = ("default_bound", "slow_rank")


def _start(jobs):
    jobs = [job for job in jobs if job not in _FUTURES]
    if jobs:
        pool = ThreadPoolExecutor(len(jobs), thread_name_prefix="watchdog-job")
        _FUTURES.update({job: pool.submit(_run, job) for job in jobs})
        pool.shutdown(wait=False)


def start_watchdog_jobs():
    """Launch the long-waiting jobs in the background (conftest.py calls it once the
    session is collected)."""
    _start(BACKGROUND)


@pytest.fixture(scope="module")
def runs():
    _start(JOBS)
    done = {job: _FUTURES[job].result() for job in JOBS}
    for run in done.values():
        print(run.summary, flush=True)
    return done


def _reports(run):
    """rank -> the watchdog paragraph that rank printed."""
    return {int(m.group(1)): m.group(0) for m in
            re.finditer(r"tfhybrid watchdog: rank (\d+) of \d+ has waited[^\n]*", run.out)}


def _ended_by_watchdog(run, bound):
    assert run.rc not in (0, "timeout"), run
    assert run.fault is not None, run
    assert run.end - run.fault <= bound + MARGIN, (run.end - run.fault, run)
    reports = _reports(run)
    assert reports, run
    for text in reports.values():
        assert "diverged" in text and "TFHYBRID_WATCHDOG_SECONDS" in text
    return reports


def test_extra_collective_on_one_rank(runs):
    reports = _ended_by_watchdog(runs["extra_collective"], SHORT)
    # rank 0 waits in its extra eager collective, the other in its next train step
    assert "collective 'tfh.metric_average.logs' (allreduce over ranks [0, 1])" in reports[0]
    assert "train step 6" in reports[1] and "tfh." in reports[1]


def test_stop_training_on_one_rank(runs):
    """Rank 1 stops inside an epoch; rank 0 waits in its next step and ends the job.
    This model's ranks feed the same rows, so its epoch logs need no collective
    (the metric states are counted on one rank): rank 1 waits at the epoch's
    end, where the ranks agree on stopping (guards.AgreeOnStop, which makes a
    stop set at an epoch's end on some ranks stop every rank)."""
    reports = _ended_by_watchdog(runs["stop_one_rank"], SHORT)
    assert "train step 6 (epoch 1, batch 5)" in reports[0]
    assert 1 not in reports or "collective 'tfh.guard.stop'" in reports[1], reports


def test_terminate_on_nan_on_one_rank(runs):
    reports = _ended_by_watchdog(runs["terminate_nan"], SHORT)
    assert "train step 6" in reports[0] and "tfh.distributed_sgd" in reports[0]
    # the stopped rank waits at its epoch end, where the metric states are summed
    assert "collective 'tfh.metric_states.sum'" in reports[1]


def test_layer_names_drift_is_caught_by_the_structure_guard(runs):
    """With the guards on (the default) drifted names never reach a collective:
    fit raises tfhybrid.guards.ConsistencyError on every rank before its first step."""
    run = runs["layer_names"]
    assert run.rc not in (0, "timeout"), run
    assert run.out.count("ConsistencyError") >= 2, run
    assert "other layer names" in run.out and "explicit names" in run.out, run
    assert run.end - run.fault <= MARGIN + 10, run


@pytest.mark.parametrize("job", ["layer_names_np4"])
def test_layer_names_drift(runs, job):
    """Without the guards (Config(guards=False)) the watchdog ends the hang."""
    reports = _ended_by_watchdog(runs[job], SHORT)
    assert all("train step 1 (epoch 1, batch 0)" in text for text in reports.values())
    # the traced collective names show the drift: dense_2 on the last rank is dense_1 elsewhere
    last = max(reports)
    assert "tfh.dense_1." in reports[0] and "tfh.dense_2." in reports[last]


def test_save_on_rank_0_only_names_the_call_and_the_fix(runs):
    """A Horovod habit: ``if is_root(): tfhybrid.save(...)``. Rank 0 waits in save's
    first gather while the other rank ends its script; the report names the call."""
    reports = _ended_by_watchdog(runs["save_on_root"], SHORT)
    assert "inside tfhybrid.save()" in reports[0], reports
    assert "tfhybrid.save() is collective: every rank must call it" in reports[0], reports
    assert "if tfhybrid.is_root():" in reports[0], reports


def test_evaluate_on_rank_0_only_names_the_call_and_the_fix(runs):
    reports = _ended_by_watchdog(runs["evaluate_on_root"], SHORT)
    assert "inside model.evaluate()" in reports[0], reports
    assert "model.evaluate() of a transformed model is collective" in reports[0], reports
    assert "tfhybrid.gather(model)" in reports[0], reports


def test_model_called_on_rank_0_only_names_the_cause_and_the_fix(runs):
    """``if is_root(): model(x)`` on split layers: rank 0's first activation
    collective met the other rank's exit barrier, and Horovod said only
    "Mismatched ALLREDUCE tensor shapes" (or rank 0 waited for the watchdog)."""
    run = runs["call_on_root"]
    assert run.rc not in (0, "timeout"), run
    assert run.fault is not None and run.end - run.fault <= SHORT + MARGIN, run
    assert ("the ranks reached different collectives" in run.out
            or "diverged" in run.out), run
    assert "full = tfhybrid.gather(model)" in run.out or "tfhybrid.gather(model)" in run.out, run


def test_default_bound_ends_hang_within_two_minutes(runs):
    run = runs["default_bound"]
    reports = _ended_by_watchdog(run, DEFAULT_TARGET - MARGIN)
    assert run.end - run.fault <= DEFAULT_TARGET
    assert all("(bound 100 s)" in text for text in reports.values())


def test_slow_rank_does_not_end_healthy_job(runs):
    run = runs["slow_rank"]
    assert run.rc == 0, run
    assert "PAUSE END" in run.out and "tfhybrid watchdog" not in run.out
    assert sorted(r["rank"] for r in results(run)) == [0, 1]
