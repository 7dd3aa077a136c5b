"""ProcessGrid: layout, groups, validation (pure Python, no Horovod)."""
import pytest

from tfhybrid.process_grid import ProcessGrid


@pytest.mark.parametrize("size,mp", [(1, 1), (2, 1), (2, 2), (4, 2), (8, 4), (6, 3), (12, 4)])
def test_every_rank_is_in_exactly_one_model_and_one_data_group(size, mp):
    model_groups, data_groups = set(), set()
    for r in range(size):
        g = ProcessGrid(size, r, mp)
        assert g.rank == g.data_rank * g.model_size + g.model_rank
        assert g.group("model").ranks[g.group("model").index] == r
        assert g.group("data").ranks[g.group("data").index] == r
        model_groups.add(g.group("model").ranks)
        data_groups.add(g.group("data").ranks)
    assert sorted(r for grp in model_groups for r in grp) == list(range(size))
    assert sorted(r for grp in data_groups for r in grp) == list(range(size))
    assert len(model_groups) == size // mp and len(data_groups) == mp


def test_model_fastest_layout():
    g = ProcessGrid(size=8, rank=5, model_parallel=2)
    assert (g.data_size, g.data_rank, g.model_size, g.model_rank) == (4, 2, 2, 1)
    assert g.group("model").ranks == (4, 5)
    assert g.group("data").ranks == (1, 3, 5, 7)
    assert g.group("world").ranks == tuple(range(8))


def test_all_groups_is_identical_on_every_rank():
    lists = {ProcessGrid(8, r, 4).all_groups() for r in range(8)}
    assert len(lists) == 1
    assert lists.pop() == ((0, 1, 2, 3), (4, 5, 6, 7), (0, 4), (1, 5), (2, 6), (3, 7))


def test_model_parallel_must_divide_world_size():
    with pytest.raises(ValueError, match=r"model_parallel=3, world size 4.*\[1, 2, 4\]"):
        ProcessGrid(size=4, rank=0, model_parallel=3)


@pytest.mark.parametrize("bad", [0, -2, 1.5, "2", True])
def test_model_parallel_must_be_positive_int(bad):
    with pytest.raises(ValueError, match="model_parallel"):
        ProcessGrid(size=4, rank=0, model_parallel=bad)


def test_rank_out_of_range():
    with pytest.raises(ValueError, match="rank=4"):
        ProcessGrid(size=4, rank=4)


def test_unknown_group_name():
    with pytest.raises(ValueError, match="'pipeline'"):
        ProcessGrid(2, 0).group("pipeline")


def test_subgroups_row_major():
    g = ProcessGrid(size=8, rank=7, model_parallel=4)   # model group 4..7, coords (1, 1)
    h, w = g.subgroups((2, 2), ("h", "w"))
    assert (h.ranks, h.index) == ((5, 7), 1)
    assert (w.ranks, w.index) == ((6, 7), 1)
    with pytest.raises(ValueError, match=r"grid shape \(3, 2\)"):
        g.subgroups((3, 2))


def test_all_subgroups_identical_everywhere():
    sets = {ProcessGrid(8, r, 4).all_subgroups((2, 2)) for r in range(8)}
    assert len(sets) == 1
    assert len(sets.pop()) == 8   # 2 model groups x (2 rows + 2 columns)


def test_neighbour():
    g = ProcessGrid(4, 0, 4).group("model")
    assert g.neighbour(-1) is None and g.neighbour(1) == 1
