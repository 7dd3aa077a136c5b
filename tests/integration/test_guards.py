"""Consistency guards on transformed models, as users write scripts.

``tests/user_scripts/guard_cases.py`` runs each case under horovodrun with no
barrier and no helper beyond tfhybrid itself.
"""
import pytest

from userscripts import launch, results


def test_plain_optimizer_unseeded_shuffle_and_sample_datasets_at_4_ranks():
    run = launch("guard_cases.py", np=4, args=["good"])
    assert run.rc == 0, run
    rows = results(run)
    assert len(rows) == 4, run
    for row in rows:
        assert row["wrapped"] == "DistributedOptimizer", row
        # the plain SGD(momentum) trains exactly like single-process after wrapping
        assert row["plain_optimizer_rel"] < 1e-5, row
        # guards checked every step (guard_every_steps=1) and found every model group agreeing
        assert row["unseeded_shuffle_epochs"] == 2 and row["array_shuffle_epochs"] == 2, row
        assert "single samples" in row["unbatched_error"], row
        assert row["unbatched_local_rows"] == 8, row          # 16 global rows / 2 data groups
    assert [r["warned"] for r in sorted(rows, key=lambda r: r["rank"])] == [True, False, False, False]


@pytest.mark.parametrize("case, phrase", [
    ("per_rank_shuffle", "fed different rows at step 1"),
    ("perturbed", "differs between ranks 0 and 1 at the start of fit"),
    ("late_rows", "fed different rows at step 4"),     # checksum skipped at step 3 only
    ("pydataset_shuffle", "keras.utils.set_random_seed(seed) with one seed on every rank"),
    ("drift", "weight 'fc2/bias' of model 'functional' differs between ranks 0 and 1 after step 2"),
    ("late_drift", "differs between ranks 0 and 1 after step 8, but they must hold the same"),
])
def test_disagreeing_ranks_raise_on_every_rank(case, phrase):
    run = launch("guard_cases.py", np=2, args=[case], timeout=240)
    assert run.rc not in (0, "timeout"), run
    for rank in (0, 1):
        assert f"[{rank}]<stderr>:tfhybrid.guards.ConsistencyError: tfhybrid guard" in run.out, run
    assert phrase in run.out, run
    assert run.seconds < 120, run
