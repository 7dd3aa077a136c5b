"""Static process sets at start, one switch to dynamic ones (tfhybrid/comm/backend.py).

Horovod with dynamic process sets runs a world-wide allgather in every
background cycle; tfhybrid therefore starts it with the grid's groups as
static sets and switches to dynamic sets only when a later group needs one.
The switch re-registers the known sets in order, so graphs traced before it
keep reaching their groups: checked here with real sums at -np 4.
"""
import pytest

from userscripts import launch, results


@pytest.mark.parametrize("dynamic_first", [False, True])
def test_static_sets_then_one_switch_keeps_traced_collectives(dynamic_first):
    run = launch("process_sets.py", np=4, args=["--dynamic-first"] if dynamic_first else [])
    assert run.rc == 0, run
    assert "Traceback" not in run.out, run
    rows = results(run)
    assert sorted(r["rank"] for r in rows) == [0, 1, 2, 3], run
    for r in rows:
        assert r["start"] == ("dynamic" if dynamic_first else "static"), r
        assert r["after"] == "dynamic", r
        assert r["before"] == r["want"] and r["after_sums"] == r["want"], r
        assert r["new"] == r["want_new"], r
