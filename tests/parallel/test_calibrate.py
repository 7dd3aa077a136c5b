"""`tfhybrid calibrate` under horovodrun: every rank runs it, rank 0 writes a valid machine.

Run: TF_NUM_INTRAOP_THREADS=1 horovodrun -np 2 --gloo .venv/bin/python -m pytest \
     tests/parallel/test_calibrate.py -q -x -p no:cacheprovider
"""
import json
import math
import os

import keras
import pytest

from tfhybrid.cli import main
from tfhybrid.comm import backend
from tfhybrid.oracle import Machine, predict

from conftest import job_dir


@pytest.fixture(scope="module")
def spec(tmp_path_factory):
    size, rank, _ = backend.init()
    if size < 2:
        pytest.skip("needs horovodrun -np >= 2")
    model = keras.Sequential([keras.Input((8, 8, 2)), keras.layers.Conv2D(4, 3, name="cv"),
                              keras.layers.Flatten(), keras.layers.Dense(3, name="fc")])
    path = os.path.join(job_dir(), f"calib_model_{rank}.keras")
    model.save(path)
    from tfhybrid.oracle.calibration.fit import sync
    out = os.path.join(job_dir(), "calib.json")
    assert main(["calibrate", "-o", out, "--quick", "--model", path, "--batch", "4"]) == 0
    sync(backend)
    with open(out, encoding="utf-8") as fh:
        return json.load(fh), size


def test_machine_file_is_valid(spec):
    doc, size = spec
    m = Machine.from_dict(doc)
    assert m.alpha >= 0 and m.beta >= 0 and m.flop_rate > 0
    assert [t.max_ranks for t in m.tiers][-1] == size
    assert {"cv", "fc"} <= set(m.layer_times)
    assert all(f >= 0 and b >= 0 for f, b in m.layer_times.values())
    assert m.step_overhead_s > 0 and m.gamma >= 0
    # fitted to steps of the model on 2, 4, ... and every rank at once (all on this node)
    local = backend.local_size()
    counts = [k for k in (2, 4, 8) if k < local] + [local]
    assert sorted(m.compute_contention) == counts
    assert all(f >= 1.0 for f in m.compute_contention.values())
    assert all(t.latency >= 0 for t in m.tiers)
    assert "overlap" in doc and 0.0 <= m.overlap <= 1.0    # measured with --model at size > 1
    # the model's split layers timed at 1/k width (entries only for layers timed
    # above an empty call: these tiny ones may have none)
    assert "split_scales" in doc
    keys = {"f2", "c2", "f4", "c4", "s2", "s1x2", "s4", "s2x2", "s1x4"}   # <= 4 ranks
    for name, row in (m.split_scales or {}).items():
        assert name in ("cv", "fc") and set(row) <= keys, (name, row)
        for key, share in row.items():
            parts = math.prod(int(g) for g in key[1:].split("x"))
            assert 1.0 / parts <= share <= 1.0, (name, key, share)


def test_fits_cover_every_collective_and_group(spec):
    doc, size = spec
    kinds = {(k, g) for k, g, _, _ in doc["fits"]}
    assert {("allreduce", size), ("allgather", size), ("alltoall", size)} <= kinds
    # the one-way transfer is timed on pairs only
    assert ("p2p", 2) in kinds and not any(k == "p2p" and g != 2 for k, g in kinds)
    assert "p2p" in Machine.from_dict(doc).tiers[0].collectives
    assert all(sec > 0 for *_, sec in doc["fits"])


def test_the_one_way_transfer_delivers_the_first_ranks_items_to_the_second(spec):
    import tensorflow as tf
    from tfhybrid.oracle.calibration import fit
    rank = backend.rank()
    if rank > 1:      # the pair (0, 1) is calibration's own process set: ranks 2, 3 stay out
        return
    x = tf.constant([10.0 * rank + i for i in range(4)])
    out = fit._collective("p2p", x, (0, 1), backend, 4).numpy().tolist()
    assert out == ([0.0, 1.0, 2.0, 3.0] if rank == 1 else [0.0] * 4)


def test_calibrated_machine_predicts(spec):
    doc, size = spec
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4)])
    r = predict(model, "d", size, 8, doc)
    assert r.feasible and r.total_s > 0 and r.comm_s["GE-allreduce"] > 0


def test_a_failure_in_rank_0s_compute_part_stops_every_rank(monkeypatch):
    """Rank 0 times compute alone while the others wait; an exception there
    (a layer it cannot time) raises on every rank: rank 0 its own error, the
    others a RuntimeError naming it, rather than leaving them waiting in rank
    0's next collective until the watchdog ends the job."""
    from tfhybrid.oracle.calibration import run as calibrate_run

    size, rank, _ = backend.init()
    if size < 2:
        pytest.skip("needs horovodrun -np >= 2")

    def broken(*_, **__):
        raise ValueError("injected: this layer cannot be timed")

    if rank == 0:
        monkeypatch.setattr(calibrate_run, "measure_flop_rate", broken)
    out = os.path.join(job_dir(), "calib_failed.json")
    with pytest.raises((ValueError, RuntimeError)) as err:
        calibrate_run.run(out, max_bytes=8192, n_sizes=2, reps=1, log=lambda *_: None)
    if rank == 0:
        assert err.type is ValueError and "injected" in str(err.value)
    else:
        assert err.type is RuntimeError and "failed on another rank" in str(err.value)
    backend.barrier()         # still in step: every rank reaches the same collective
    assert not os.path.exists(out)
