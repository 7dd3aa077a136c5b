"""Input pipelines whose ``map`` updates a ``tf.Variable``, with a metric whose
state is created at its first update, under real horovodrun against one
plain Keras process (tests/user_scripts/dataset_variable.py).

The metric's initial value is made inside the traced train step, after the
batch is read, so TensorFlow cannot lift its initialisation out of the step:
``fit``'s train function must initialise it the way ``tf.function``'s own
call does (inside the step), not stop with ``UnliftableError``. Every
History value, the evaluation and the trained weights must equal the plain
run's; each rank's counter must equal the rows its pipeline mapped (every
row per pass when each rank reads the global batches, its block's rows with
``data.shard``'s ``map_fn``).

Two launches: the plain Keras reference and the three forms at 2 ranks
(world size 1: tests/unit/test_guards.py).
"""
import pytest

from userscripts import launch, results

REL = 2e-5      # float32 sums over different block orders


def _by_form(run):
    assert run.rc == 0, run
    assert "Traceback" not in run.out, run
    out = {}
    for r in results(run):
        out.setdefault(r["form"], []).append(r)
    return out


def _same_numbers(got, ref, where):
    for key in ("history", "evaluate"):
        assert set(got[key]) == set(ref[key]), (where, key, got[key], ref[key])
        for name, value in ref[key].items():
            assert got[key][name] == pytest.approx(value, rel=REL, abs=1e-6), \
                (where, key, name, got[key][name], value)
    for key in ("weight_sums", "weight_abs_sums"):
        assert got[key] == pytest.approx(ref[key], rel=REL, abs=1e-5), (where, key)
    assert got["count"] == got["expected_count"], (where, got["count"], got["expected_count"])


@pytest.fixture(scope="module")
def reference():
    plain = _by_form(launch("dataset_variable.py", np=1, args=["plain"], timeout=240))["plain"][0]
    assert plain["count"] == plain["expected_count"] == 3 * 64, plain
    return plain


def test_two_ranks_equal_plain(reference):
    forms = ("shard", "rows", "batch")
    found = _by_form(launch("dataset_variable.py", np=2, args=list(forms), timeout=300))
    for form in forms:
        ranks = found.get(form, [])
        assert sorted(r["rank"] for r in ranks) == [0, 1], (form, found.keys())
        for r in ranks:
            _same_numbers(r, reference, f"{form} np=2 rank {r['rank']}")
    assert {r["count"] for r in found["rows"]} == {3 * 64 // 2}, found["rows"]
