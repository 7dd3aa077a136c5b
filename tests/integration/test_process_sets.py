"""Static process sets at start, later groups added by restarting Horovod
(tfhybrid/comm/backend.py).

Horovod with dynamic process sets runs a world-wide allgather in every
background cycle; tfhybrid therefore starts it with the grid's groups as
static sets, and a later group starts it again with the known sets in their
order, then the new ones (dynamic after ``TFHYBRID_STATIC_RESTARTS``
restarts). Graphs traced before a restart must keep reaching their groups:
checked here with real sums at -np 4.
"""
import pytest

from userscripts import launch, results


@pytest.mark.parametrize("args, modes", [
    ([], ["static", "static", "static"]),
    (["--max-restarts", "1"], ["static", "static", "dynamic"]),
    (["--dynamic-first"], ["dynamic", "dynamic", "dynamic"]),
], ids=["static", "one-restart-then-dynamic", "dynamic-first"])
def test_later_groups_keep_traced_collectives(args, modes):
    run = launch("process_sets.py", np=4, args=args)
    assert run.rc == 0, run
    assert "Traceback" not in run.out, run
    rows = results(run)
    assert sorted(r["rank"] for r in rows) == [0, 1, 2, 3], run
    for r in rows:
        assert r["modes"] == modes, r
        assert r["traced"] == [r["want"]] * 3, r
        # each rank is in one pair and in one or two triples
        assert len(r["new"]) == (2 if r["rank"] in (0, 3) else 3), r
        for got, expected in r["new"]:
            assert got == expected, r
    # rank 0 ended first; the exit barrier kept its process sets for the others
    late = sorted(line.split()[1:] for line in run.out.splitlines() if "LATE " in line)
    assert [[line[-2], line[-1]] for line in late] == [["1", "14.0"], ["2", "14.0"],
                                                       ["3", "14.0"]], run


@pytest.mark.parametrize("method", ["pairs", "neighbour"])
def test_block_grid_fit_in_a_fresh_job(method):
    """A fresh job's 2x2 spatial grid: with the ``pairs`` halo method it
    registers its neighbour pairs while ``fit`` traces the step, so Horovod
    restarts inside the trace (its barrier runs eagerly); either way training
    equals the single-process run."""
    run = launch("spatial_grid_fit.py", np=4, args=[method])
    assert run.rc == 0, run
    assert "Traceback" not in run.out, run
    rows = results(run)
    assert sorted(r["rank"] for r in rows) == [0, 1, 2, 3], run
    for r in rows:
        assert r["start"] == r["end"] == "static", r
        assert r["loss_max_rel"] < 1e-5 and r["weights_max_rel"] < 1e-4, r
