"""A data set whose length is not a multiple of the global batch,
as a user writes it (``.batch(8)`` without ``drop_remainder``), under real horovodrun.

tests/user_scripts/uneven_batches.py: every rank must run the same number of
steps (no hang), rank 0 alone warns about the rows dropped (gmp) or the batch
skipped, and the weights after ``fit`` and the metrics of ``evaluate`` equal
single-process Keras on the rows kept (under d every row of each batch of at
least as many rows as ranks: the blocks may differ by a row).

The three cases run one after another in one launch (module fixture; each on
its own grid): one horovodrun start-up instead of three.
"""
import pytest

from userscripts import launch, results

CASES = [
    (21, "d", None),                      # batches 8, 8, 5 over 2 ranks: 3 + 2 rows, all kept
    (17, "d", "skipped a global batch of 1 rows"),         # batches 8, 8, 1
    (21, "gmp", "dropped 1 of the 5 rows"),                # world split with model groups
]


@pytest.fixture(scope="module")
def run():
    return launch("uneven_batches.py", np=2, args=[f"{n}:{s}" for n, s, _ in CASES],
                  timeout=240)


@pytest.mark.parametrize("n, strategy, said", CASES)
def test_uneven_last_batch_at_2_ranks(run, n, strategy, said):
    assert run.rc == 0, run
    assert "Traceback" not in run.out, run
    found = sorted((r for r in results(run) if (r["n"], r["strategy"]) == (n, strategy)),
                   key=lambda r: r["rank"])
    assert [r["rank"] for r in found] == [0, 1], run
    for r in found:
        assert r["steps"] == r["expected_steps"], r
        assert r["weights_max_abs_diff"] < 1e-5, r
        assert r["loss"] == pytest.approx(r["ref_loss"], rel=1e-5), r
        assert r["mae"] == pytest.approx(r["ref_mae"], rel=1e-5), r
    if said is None:
        assert found[0]["n_warnings"] == 0, found[0]
    else:
        assert any(said in w for w in found[0]["warnings"]), found[0]
    assert found[1]["n_warnings"] == 0, found[1]
    assert run.seconds < 120, run
