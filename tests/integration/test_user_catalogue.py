"""Issue 46: the catalogue of user scripts, each compared with one plain process.

Each script in tests/user_scripts/ named below is written as a user writes a
training script: under ``horovodrun`` it calls ``tfhybrid.init``,
``transform``, ``data.shard`` and ``gather``; launched as plain ``python``
(``np=1``) it is the same model in one plain Keras process, without
tfhybrid: the reference. A script prints ``RESULT {json}`` lines (history,
``evaluate``, ...) on every rank and writes the trained weights (rank 0) to
the directory it is given. Every reported number of every rank and every
weight must equal the reference within float32 tolerance, except under mixed
precision (reason at its test).

The references run one after another in a background thread while the
distributed launches run in the foreground (``references`` fixture), so the
module costs about one launch per script per world size in wall time.
"""
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from userscripts import FULL_TIER, full_tier, launch, results

# float32 tolerance: the distributed runs add the same numbers in another order
# (the gradient allreduce, blocks of split layers, the metric states' sums)
RTOL = 1e-5
WEIGHT_RTOL = 1e-5       # of each weight's largest magnitude

# scripts whose np=1 reference the tests need, in the order the tests run,
# with the arguments after the output directory
REFERENCES = {
    "multi_output.py": (),
    "multi_input.py": (),
    "custom_layer_no_weights.py": (),
    "custom_layer_replicated.py": (),
    "mixed_precision_df.py": (),
    "callback_files.py": (),
    "batch_sizes.py": (),
    "validation_split.py": (),
    "class_sample_weights.py": (),
    "plateau_early_stop.py": (),
    "predict_outputs.py": (),
    "plain_optimizer_schedule.py": (),
    "resume_plain.py": ("all",),
}


#: The scripts the core tier (make test) runs; make test-full runs every script.
CORE = {"multi_output.py", "custom_layer_replicated.py", "batch_sizes.py", "validation_split.py",
        "plateau_early_stop.py", "resume_plain.py"}


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    root = tmp_path_factory.mktemp("catalogue_np1")
    pool = ThreadPoolExecutor(max_workers=1)
    jobs = {}
    for script, args in REFERENCES.items():
        if not FULL_TIER and script not in CORE:
            continue
        out = root / Path(script).stem
        out.mkdir()
        jobs[script] = (out, pool.submit(launch, script, 1, [out, *args], 300))
    yield jobs
    pool.shutdown(wait=False, cancel_futures=True)


def reference(references, script):
    """(output directory, RESULT dicts) of the plain single-process run of ``script``."""
    out, job = references[script]
    run = job.result()
    assert run.rc == 0, run
    return out, results(run)


def distributed(tmp_path, script, np=2, args=(), timeout=300):
    """(output directory, RESULT dicts, run) of ``script`` under horovodrun -np ``np``."""
    out = tmp_path / f"np{np}"
    out.mkdir()
    run = launch(script, np=np, args=[out, *args], timeout=timeout)
    assert run.rc == 0, run
    assert "Traceback" not in run.out, run
    found = results(run)
    assert sorted(r["rank"] for r in found) == sorted(list(range(np)) * (len(found) // np)), run
    return out, found, run


def assert_close(got, ref, rtol=RTOL, atol=1e-7, where="RESULT"):
    """Every number in ``got`` equals ``ref`` (same keys, lengths, strings)."""
    if isinstance(ref, dict):
        assert isinstance(got, dict) and sorted(got) == sorted(ref), \
            f"{where}: keys {sorted(got) if isinstance(got, dict) else got} != {sorted(ref)}"
        for key in ref:
            assert_close(got[key], ref[key], rtol, atol, f"{where}.{key}")
    elif isinstance(ref, list):
        assert isinstance(got, list) and len(got) == len(ref), f"{where}: {got} != {ref}"
        for i, (g, r) in enumerate(zip(got, ref)):
            assert_close(g, r, rtol, atol, f"{where}[{i}]")
    elif isinstance(ref, float):
        assert got == pytest.approx(ref, rel=rtol, abs=atol), f"{where}: {got!r} != {ref!r}"
    else:
        assert got == ref, f"{where}: {got!r} != {ref!r}"


def assert_weights(got_file, ref_file, rtol=WEIGHT_RTOL):
    """Same weights (by path), each within ``rtol`` of its largest magnitude."""
    with np.load(got_file) as got, np.load(ref_file) as ref:
        assert sorted(got.files) == sorted(ref.files), (got.files, ref.files)
        worst = {}
        for name in ref.files:
            a, b = got[name].astype(np.float64), ref[name].astype(np.float64)
            assert a.shape == b.shape, (name, a.shape, b.shape)
            worst[name] = float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-12))
        bad = {k: f"{v:.2e}" for k, v in worst.items() if v > rtol}
        assert not bad, f"{got_file.name}: weights off one process (relative): {bad}"


def only(found, **match):
    """The RESULT dicts whose fields equal ``match``, ordered by rank."""
    return sorted((r for r in found if all(r.get(k) == v for k, v in match.items())),
                  key=lambda r: r["rank"])


def compare_per_rank(found, ref_found, keys, match_key=None, rtol=RTOL):
    """Each rank's ``keys`` equal the reference's, per case (``match_key``)."""
    cases = [None] if match_key is None else [r[match_key] for r in ref_found]
    for case in cases:
        match = {} if case is None else {match_key: case}
        ref = only(ref_found, **match)
        assert len(ref) == 1, ref_found
        got = only(found, **match)
        assert got, (case, found)
        for r in got:
            for key in keys:
                assert_close(r[key], ref[0][key], rtol, where=f"{case} rank {r['rank']} {key}")


# --------------------------------------------------------------------------------------


def test_multi_output_model_every_output_metric_under_d_and_df(references, tmp_path):
    ref_out, ref = reference(references, "multi_output.py")
    out, found, _ = distributed(tmp_path, "multi_output.py")
    assert "val_size_mae" in ref[0]["history"] and "kind_accuracy" in ref[0]["evaluate"], ref
    compare_per_rank(found, ref, ("history", "evaluate"), match_key="strategy")
    for strategy in ("d", "df"):
        assert_weights(out / f"weights_{strategy}.npz", ref_out / f"weights_{strategy}.npz")


@full_tier
def test_multi_input_model_under_gmp(references, tmp_path):
    ref_out, ref = reference(references, "multi_input.py")
    out, found, _ = distributed(tmp_path, "multi_input.py")
    compare_per_rank(found, ref, ("history", "evaluate"))
    assert_weights(out / "weights.npz", ref_out / "weights.npz")


@full_tier
def test_custom_layer_without_weights_under_df(references, tmp_path):
    ref_out, ref = reference(references, "custom_layer_no_weights.py")
    out, found, _ = distributed(tmp_path, "custom_layer_no_weights.py")
    compare_per_rank(found, ref, ("history", "evaluate", "gathered_layer"))
    assert_weights(out / "weights.npz", ref_out / "weights.npz")


@pytest.mark.parametrize("np_", [2, pytest.param(4, marks=full_tier)])
def test_custom_layer_with_weights_replicated_under_df(references, tmp_path, np_):
    ref_out, ref = reference(references, "custom_layer_replicated.py")
    out, found, _ = distributed(tmp_path, "custom_layer_replicated.py", np=np_)
    compare_per_rank(found, ref, ("history", "evaluate"))
    for r in found:     # refused without the fallback, naming the layer and the fix
        assert "scale_shift" in r["refusal"] and "fallback='replicate'" in r["refusal"], r
    assert_weights(out / "weights.npz", ref_out / "weights.npz")


@full_tier
def test_mixed_float16_under_df(references, tmp_path):
    """Loose comparison, with the reason: under ``mixed_float16`` the layers
    compute in float16 (10-bit mantissa: one rounding is up to 2**-11 = 4.9e-4
    relative). ``df``'s split layers compute the same products but round them
    in other places than one process's whole matmul (each block's output, the
    sum of partial outputs), so a forward value may move by a float16
    rounding, and that carries into later steps' gradients: measured here
    1.0e-4 relative on the losses and 2.3e-4 on the weights after 3 epochs.
    The tolerance, 2e-3, is four float16 roundings; an error of the kind
    float32 tests catch (a gradient counted twice or missed on a block, a loss
    scale step skipped on one rank) moves them by far more. The loss scale
    itself must be the same number, and the accuracies the same fractions
    of rows at this tolerance."""
    ref_out, ref = reference(references, "mixed_precision_df.py")
    out, found, _ = distributed(tmp_path, "mixed_precision_df.py")
    for r in found:
        assert r["policy"] == "mixed_float16" and r["compute_dtype"] == "float16", r
    compare_per_rank(found, ref, ("history", "evaluate"), rtol=2e-3)
    compare_per_rank(found, ref, ("loss_scale",))
    assert_weights(out / "weights.npz", ref_out / "weights.npz", rtol=2e-3)


def _csv_rows(path):
    import csv
    with open(path, newline="") as f:
        return [{k: float(v) for k, v in row.items()} for row in csv.DictReader(f)]


def _jsonl(path):
    import json
    return [json.loads(line) for line in path.read_text().splitlines()]


@full_tier
def test_callbacks_that_write_files_write_one_process_numbers_once(references, tmp_path):
    ref_out, ref = reference(references, "callback_files.py")
    out, found, _ = distributed(tmp_path, "callback_files.py")
    compare_per_rank(found, ref, ("history",))
    # CSVLogger: one header and one line per epoch (a second rank would add its own)
    assert_close(_csv_rows(out / "log.csv"), _csv_rows(ref_out / "log.csv"), where="log.csv")
    assert len((out / "log.csv").read_text().splitlines()) == 1 + 3
    # the script's own callback (added on rank 0 only, the Horovod way)
    assert_close(_jsonl(out / "epochs.jsonl"), _jsonl(ref_out / "epochs.jsonl"),
                 where="epochs.jsonl")
    # TensorBoard: one event file per run directory, the same scalars
    for run_dir in ("train", "validation"):
        events = list((out / "tb" / run_dir).glob("events.out.tfevents.*"))
        assert len(events) == 1, events
    assert sorted(p.name for p in out.iterdir()) == ["epochs.jsonl", "log.csv", "tb"]
    root = only(found, rank=0)[0]
    assert_close(root["tensorboard"], ref[0]["tensorboard"], where="tensorboard")
    assert set(root["tensorboard"]) == {"train", "validation"}
    assert all(r["tensorboard"] is None for r in found if r["rank"] != 0)


@pytest.mark.parametrize("np_, strategy", [(2, "d"), pytest.param(4, "df", marks=full_tier)])
def test_unusual_batch_sizes(references, tmp_path, np_, strategy):
    """Global batches of 6 rows (blocks of 3: ``d`` at 2 ranks, ``df`` 2x2 at
    4) with a last batch of 4, from a dataset and from whole arrays; a global
    batch of 7 over 2 data-parallel blocks is refused by name or trains every
    row as one process does."""
    ref_out, ref = reference(references, "batch_sizes.py")
    out, found, _ = distributed(tmp_path, "batch_sizes.py", np=np_, args=[strategy])
    for case in ("batch6", "arrays6"):
        compare_per_rank([r for r in found if r["case"] == case],
                         [r for r in ref if r["case"] == case], ("history", "evaluate"),
                         match_key="case")
        assert_weights(out / f"weights_{case}.npz", ref_out / f"weights_{case}.npz")
    for r in only(found, case="batch6"):           # every row kept: nothing to warn about
        assert not any("dropped" in w or "skipped" in w for w in r["warnings"]), r
    seven = only(found, case="batch7")
    assert len(seven) == np_, found
    if all(r.get("error") for r in seven):
        for r in seven:
            assert "7" in r["error"] and "2" in r["error"], r["error"]
    else:
        assert not any(r.get("error") for r in seven), seven
        compare_per_rank(seven, only(ref, case="batch7"), ("history", "evaluate"),
                         match_key="case")
        assert_weights(out / "weights_batch7.npz", ref_out / "weights_batch7.npz")


def test_validation_split_on_numpy_arrays(references, tmp_path):
    ref_out, ref = reference(references, "validation_split.py")
    out, found, _ = distributed(tmp_path, "validation_split.py")
    assert "val_accuracy" in ref[0]["history"], ref
    compare_per_rank(found, ref, ("history",), match_key="form")
    for form in ("whole", "sharded"):
        assert_weights(out / f"weights_{form}.npz", ref_out / f"weights_{form}.npz")
    for r in only(found, form="sharded"):    # the cut falls on global batches: no warning
        assert not any("validation_split" in w for w in r["warnings"]), r


@full_tier
def test_class_weight_and_sample_weight(references, tmp_path):
    ref_out, ref = reference(references, "class_sample_weights.py")
    out, found, _ = distributed(tmp_path, "class_sample_weights.py")
    compare_per_rank(found, ref, ("history", "evaluate"), match_key="case")
    for case in ("class_weight", "sample_weight", "arrays"):
        assert_weights(out / f"weights_{case}.npz", ref_out / f"weights_{case}.npz")


def test_reduce_lr_on_plateau_and_early_stopping_stop_at_the_same_epoch(references, tmp_path):
    ref_out, ref = reference(references, "plateau_early_stop.py")
    # the case must exercise both callbacks: the rate halves and training stops early
    assert ref[0]["epochs_run"] < 12 and ref[0]["final_learning_rate"] < 0.3, ref
    out, found, _ = distributed(tmp_path, "plateau_early_stop.py")
    compare_per_rank(found, ref, ("history", "stopped_epoch", "best_epoch", "epochs_run",
                                  "final_learning_rate", "evaluate"))
    assert_weights(out / "weights.npz", ref_out / "weights.npz")


@full_tier
def test_predict_on_arrays_and_datasets(references, tmp_path):
    """Whole inputs: every rank returns one process's predictions of every
    row. A sharded dataset: each rank returns its block of every batch."""
    ref_out, ref = reference(references, "predict_outputs.py")
    out, found, _ = distributed(tmp_path, "predict_outputs.py")
    for r in found:
        with np.load(out / f"pred_{r['strategy']}_rank{r['rank']}.npz") as got, \
                np.load(ref_out / f"pred_{r['strategy']}_rank0.npz") as want:
            for form in ("arrays", "dataset"):
                np.testing.assert_allclose(got[form], want[form], rtol=RTOL, atol=1e-6,
                                           err_msg=f"{r['strategy']} rank {r['rank']} {form}")
            # rows of every batch of 8 (the last of 4) that this rank's block holds
            rows = np.concatenate([
                np.arange(start, min(start + 8, 36)).reshape(r["blocks"], -1)[r["block"]]
                for start in range(0, 36, 8)])
            np.testing.assert_allclose(got["sharded"], want["sharded"][rows], rtol=RTOL,
                                       atol=1e-6, err_msg=f"{r['strategy']} rank {r['rank']}")


@full_tier
def test_plain_optimizer_with_a_schedule_compiled_after_transform(references, tmp_path):
    ref_out, ref = reference(references, "plain_optimizer_schedule.py")
    out, found, _ = distributed(tmp_path, "plain_optimizer_schedule.py")
    compare_per_rank(found, ref, ("history", "evaluate", "iterations", "learning_rate"))
    assert_weights(out / "weights.npz", ref_out / "weights.npz")
    for r in found:      # wrapped, and said once (rank 0)
        assert r["optimizer"] == "DistributedOptimizer", r
        assert bool(r["warnings"]) == (r["rank"] == 0), r


def test_resume_in_a_plain_process_from_the_gathered_model(references, tmp_path):
    """2 epochs under ``df`` at 2 ranks, ``gather(model).save``, then a plain
    Keras process (no tfhybrid import) loads it and trains a third epoch:
    the same history and weights as one process training 3 epochs."""
    ref_out, ref = reference(references, "resume_plain.py")
    out, first, _ = distributed(tmp_path, "resume_plain.py", args=["first"])
    then = launch("resume_plain.py", np=1, args=[out, "then"])
    assert then.rc == 0, then
    (then_result,) = results(then)
    assert not then_result["tfhybrid_imported"], then_result
    want = ref[0]["history"]
    for r in first:
        assert_close(r["history"], {k: v[:2] for k, v in want.items()},
                     where=f"first rank {r['rank']}")
    assert_close(then_result["history"], {k: v[2:] for k, v in want.items()}, where="then")
    assert_close(then_result["evaluate"], ref[0]["evaluate"], where="then evaluate")
    assert_weights(out / "weights.npz", ref_out / "weights.npz")
