"""Four ways a user script can silently go wrong, as user scripts under real ``horovodrun``.

The scripts (tests/user_scripts/safe_*.py) add no barrier; each rank compares
itself with single-process training of the unmodified model (same data,
same global batches, rank 0's pretrained weights) and prints ``RESULT``
lines:

- sharded broadcast with several data groups (df, gmp at -np 4):
  ``safe_quickstart.py`` (the README quick start);
- a script ending or building a second model right after ``gather``
  or ``evaluate``: ``safe_quickstart.py``, ``safe_gather_exit.py``; a rank
  that raises must still end the job promptly;
- a second ``fit`` with new callbacks (Adam, SGD momentum, RMSprop):
  ``safe_second_fit.py`` compares the weights and every optimizer slot;
- pretrained weights restored on rank 0 only: every script but
  ``safe_gather_exit.py`` builds its model with rank-specific random weights
  and loads the pretrained ones on rank 0 only.
"""
import pytest

from userscripts import launch, results


RTOL = 1e-5            # float32 training, relative to each array's largest entry
CRASHES = ("Process set provided does not exist", "invalid root rank", "Traceback")


def _check_ok(run, expected):
    assert run.rc == 0, run
    for text in CRASHES:
        assert text not in run.out, run
    found = results(run)
    assert len(found) == expected, run
    return found


def test_quickstart_df_and_gmp_at_4_ranks():
    run = launch("safe_quickstart.py", np=4, args=["df", "gmp"])
    found = _check_ok(run, expected=8)
    assert {(r["strategy"], r["rank"]) for r in found} == {
        (s, rank) for s in ("df", "gmp") for rank in range(4)}
    worst = max(r["weights_max_rel"] for r in found)
    assert worst < RTOL, found


def test_hvd_init_before_tfhybrid_init():
    """A script migrating from Horovod keeps its ``hvd.init()`` before
    ``tfhybrid.init``: tfhybrid restarts Horovod with its process sets."""
    run = launch("safe_quickstart.py", np=4, args=["--hvd-init-first", "df"])
    found = _check_ok(run, expected=4)
    assert "HOROVOD_DYNAMIC_PROCESS_SETS" not in run.out, run
    assert max(r["weights_max_rel"] for r in found) < RTOL, found


@pytest.mark.parametrize("np_, strategy", [(2, "f"), (4, "df")])
def test_second_fit_keeps_sharded_optimizer_slots(np_, strategy):
    run = launch("safe_second_fit.py", np=np_, args=[strategy, 2])
    found = _check_ok(run, expected=3 * np_)
    for r in found:
        assert r["slots"] >= 6, r                       # every slot was compared
        assert r["weights_max_rel"] < RTOL, r
        assert r["slots_max_rel"] < RTOL, r


def test_second_model_after_gather_and_end_after_evaluate():
    run = launch("safe_gather_exit.py", np=4, args=["end"])
    found = _check_ok(run, expected=4)
    assert all(r["weights_max_rel"] < RTOL for r in found), found
    assert all(f"rank {rank} done" in run.out for rank in range(4)), run


def test_a_rank_that_raises_ends_the_job_promptly():
    # The exit barrier must not hold a failing rank (its peers would wait for it
    # forever): the job ends with the user's error long before any timeout.
    run = launch("safe_gather_exit.py", np=4, args=["raise"], timeout=240)
    assert run.rc not in (0, "timeout"), run
    assert "user error on rank 1 after gather" in run.out, run
    assert run.seconds < 90, run
