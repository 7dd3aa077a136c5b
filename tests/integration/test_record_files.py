"""``data.shard(files, reader=tf.data.TFRecordDataset, ...)`` under
real horovodrun, as a user writes it (tests/user_scripts/record_files.py).

Each data-parallel block (``d``: every rank; ``df`` with ``model_parallel=2``:
each model group) reads only its share of the TFRecord files: raw records read
per rank per pass = 128 / blocks when the files divide over the blocks, one
file's worth when there are fewer files than blocks. Fit's History (loss,
accuracy, validation), ``evaluate`` and every trained weight equal one plain
Keras process reading the files side by side (the order ``data.shard``
documents), at 2 and 4 processes. Three launches: the plain process, np=2, np=4.
"""
import pytest

from userscripts import full_tier, launch, results

CASES = {2: ["d:4"], 4: ["d:4", "df:4", "d:2"]}


@pytest.fixture(scope="module")
def plain():
    run = launch("record_files.py", np=1, args=["d:4", "d:2"], timeout=240)
    assert run.rc == 0, run
    return {r["files"]: r for r in results(run)}


@pytest.fixture(scope="module", params=[n if n == 2 else pytest.param(n, marks=full_tier) for n in sorted(CASES)])
def launched(request):
    np_ = request.param
    run = launch("record_files.py", np=np_, args=CASES[np_], timeout=300)
    assert run.rc == 0, run
    assert "Traceback" not in run.out, run
    return np_, results(run)


def _close(a, b, rel=1e-5, abs_=1e-6):
    return a == pytest.approx(b, rel=rel, abs=abs_)


def test_numbers_equal_one_process(plain, launched):
    np_, found = launched
    for case in CASES[np_]:
        strategy, files = case.split(":")
        root = [r for r in found if r["strategy"] == strategy and r["files"] == int(files)
                and r["rank"] == 0]
        assert len(root) == 1, (case, found)
        got, ref = root[0], plain[int(files)]
        assert set(got["history"]) == set(ref["history"]), got["history"]
        for key, values in ref["history"].items():
            assert _close(got["history"][key], values), (case, key, got["history"][key], values)
        for key, value in ref["evaluate"].items():
            assert _close(got["evaluate"][key], value), (case, key, got["evaluate"], ref["evaluate"])
        for w, r in zip(got["weights"], ref["weights"]):
            assert _close(w, r, rel=1e-5, abs_=1e-6), case
        assert _close(got["weight_checksum"], ref["weight_checksum"], rel=1e-6), case


def test_each_rank_reads_its_share(launched):
    np_, found = launched
    for case in CASES[np_]:
        strategy, files = case.split(":")
        files = int(files)
        ranks = sorted((r for r in found if r["strategy"] == strategy and r["files"] == files),
                       key=lambda r: r["rank"])
        assert [r["rank"] for r in ranks] == list(range(np_)), (case, found)
        for r in ranks:
            total, blocks = r["records_total"], r["blocks"]
            assert blocks == (np_ // 2 if strategy == "df" else np_), r
            per_file = total / files
            share = total / blocks if files % blocks == 0 else per_file   # fewer files
            assert r["records_read_per_pass"] == share, r
            assert r["records_read_per_pass"] <= total / blocks + per_file, r
            assert r["rows_decoded_per_pass"] == total / blocks, r
