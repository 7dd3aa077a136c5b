"""Elastic mode's group collectives: every group collective as one world alltoall.

In an elastic run (``horovodrun --min-np``) tfhybrid registers no Horovod
process sets and issues each group's allreduce/allgather/alltoall/broadcast as
a world alltoall in which a rank sends only to its own group
(``tfhybrid/comm/backend.py``). The recovery itself is exercised by the opt-in
``tests/integration/test_elastic.py``; this file keeps the mode's arithmetic
under test in every run: strategies whose groups are smaller than the world
(df, ds, gmp) train exactly like the unmodified model in one process, with the
mode switched on as ``HOROVOD_ELASTIC=1`` would.

Run under ``horovodrun -np 2`` and ``-np 4`` (at 2 ranks model groups of 2
are the world, so only the 4-rank run has groups the mode reroutes).
"""
import pytest

from tfhybrid.comm import backend
from conftest import world_size
from test_transform import check_fit_equals_single_process

CASES = [("cnn", "df", {"fallback": "replicate"}), ("cnn", "ds", {}),
         ("resnet", "gmp", {"ccr_threshold": 0, "fallback": "replicate"})]


@pytest.fixture
def groups_over_world(monkeypatch):
    backend.init()          # Horovod first: its first init sets the mode from the environment
    monkeypatch.setitem(backend._STATE, "over_world", True)
    # groups registered in this mode hold no process set: forget them afterwards,
    # so later tests of the session register real ones
    monkeypatch.setitem(backend._STATE, "sets", dict(backend._STATE["sets"]))
    rerouted = []
    original = backend._over_world

    def counting(ranks):
        result = original(ranks)
        rerouted.append(result)
        return result
    monkeypatch.setattr(backend, "_over_world", counting)
    yield rerouted


@pytest.mark.skipif(world_size() < 4, reason="groups smaller than the world need 4 ranks")
@pytest.mark.parametrize("name,strategy,options", CASES,
                         ids=[f"{n}-{s}" for n, s, _ in CASES])
def test_fit_over_world_collectives_equals_single_process(groups_over_world, grid_of, name,
                                                          strategy, options):
    grid_of(2)
    assert backend.groups_over_world()
    check_fit_equals_single_process(name, strategy, options)
    assert any(groups_over_world), "no group collective took the world-alltoall path"
