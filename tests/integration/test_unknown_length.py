"""Numbers of input pipelines as users write them, under real horovodrun,
against one plain Keras process.

Unknown length (tests/user_scripts/unknown_length.py): TFRecord files read
back with ``TFRecordDataset`` and a validation set cut with ``filter``
(TensorFlow does not know either length), ``fit`` with ``validation_data``
and ``evaluate`` under d and df at 2 and 4 ranks. At the end of such a
dataset the step function is called once more and meets the end of the
data; were its constant row count added to every metric's ``count``, every
loss and metric would come out n/(n+1) of one process's. Every History
value, validation metric, evaluation and weight must equal the plain run's.

Odd batches (tests/user_scripts/odd_batch.py): ``.batch(15)`` at 2
data-parallel ranks trains every row (blocks of 8 and 7 rows) under d and
df, exactly as one process; under gmp ``data.shard`` refuses with an error
naming the batch, the ranks and the fix (rather than drop a row of every
batch).

Each script runs its strategies one after another in one launch (each on its
own grid): five launches in all.
"""
import pytest

from userscripts import full_tier, launch, results

REL = 2e-5      # float32 sums over different block orders


def _by_strategy(run):
    assert run.rc == 0, run
    assert "Traceback" not in run.out, run
    out = {}
    for r in results(run):
        out.setdefault(r["strategy"], []).append(r)
    return out


def _same_numbers(got, ref, where):
    """Every History value per epoch, every evaluation and the weight sums of
    ``got`` equal ``ref``'s (the plain run)."""
    for key in ("history", "evaluate", "evaluate_train", "evaluate_valid"):
        if key not in ref:
            continue
        assert set(got[key]) == set(ref[key]), (where, key, got[key], ref[key])
        for name, value in ref[key].items():
            assert got[key][name] == pytest.approx(value, rel=REL, abs=1e-6), \
                (where, key, name, got[key][name], value)
    for key in ("weight_sums", "weight_abs_sums"):
        assert got[key] == pytest.approx(ref[key], rel=REL, abs=1e-5), (where, key)


@pytest.fixture(scope="module")
def unknown_plain():
    found = _by_strategy(launch("unknown_length.py", np=1, args=["plain"], timeout=240))
    return found["plain"][0]


@pytest.mark.parametrize("np_", [2, pytest.param(4, marks=full_tier)])
def test_unknown_length_fit_validation_evaluate(unknown_plain, np_):
    found = _by_strategy(launch("unknown_length.py", np=np_, args=["d", "df"], timeout=300))
    for strategy in ("d", "df"):
        ranks = found.get(strategy, [])
        assert sorted(r["rank"] for r in ranks) == list(range(np_)), (strategy, found.keys())
        for r in ranks:
            _same_numbers(r, unknown_plain, f"{strategy} np={np_} rank {r['rank']}")


@pytest.fixture(scope="module")
def odd_plain():
    return _by_strategy(launch("odd_batch.py", np=1, args=["plain"], timeout=240))["plain"][0]


@pytest.mark.parametrize("np_, strategies", [(2, ["d", "gmp"]), pytest.param(4, ["df"], marks=full_tier)])
def test_odd_global_batch(odd_plain, np_, strategies):
    found = _by_strategy(launch("odd_batch.py", np=np_, args=strategies, timeout=300))
    for strategy in strategies:
        assert len(found.get(strategy, [])) == 1, (strategy, found)
        r = found[strategy][0]
        if strategy == "gmp":      # model groups gather equal blocks: a clear refusal
            assert r["error"] and "batches of 15 rows" in r["error"], r
            assert "2 equal blocks" in r["error"] and ".batch(14)" in r["error"], r
            continue
        assert r["error"] is None, r
        _same_numbers(r, odd_plain, f"{strategy} np={np_}")
