"""The core tier of the parallel tests (``make test``) against the full tier
(``make test-full``): every line of tests/parallel/full_tier.txt names a test
at the world sizes it applies to, and the core tier keeps every parallel
test module and every strategy's exactness test at -np 2 and -np 4, and a
case of every test function at one of them."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "parallel"))
import tiers  # noqa: E402

# Where each strategy's exactness against one process is tested.
STRATEGY_TESTS = {**{s: f"test_transform.py::test_fit_equals_single_process[cnn-{s}-"
                     for s in ("d", "f", "c", "s", "df", "ds", "gmp")},
                  "p": "test_pipeline.py::test_p_fit_evaluate_predict_equal_single_process[",
                  "ls": "test_layer_separation.py::test_ls_fit_evaluate_predict_equal_single_process["}


@pytest.fixture(scope="module")
def every_test():
    """Every test id of tests/parallel at -np 2 and -np 4, with its eager flag
    (the ids' ``eager`` mode token), collected in two processes at once."""
    runs = {}
    for size in (2, 4):
        env = dict(os.environ, HOROVOD_SIZE=str(size), HOROVOD_RANK="0",
                   TF_CPP_MIN_LOG_LEVEL="3", TFHYBRID_TEST_FULL="1")
        runs[size] = subprocess.Popen(
            [sys.executable, "-m", "pytest", "tests/parallel", "--collect-only", "-q",
             "-p", "no:cacheprovider"], cwd=ROOT, env=env, text=True,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    out = {}
    for size, run in runs.items():
        text, _ = run.communicate(timeout=600)
        assert run.returncode == 0, text[-3000:]
        ids = [line.split("tests/parallel/", 1)[-1] for line in text.splitlines() if "::" in line]
        out[size] = [(i, "eager" in i.partition("[")[2].rstrip("]").split("-")) for i in ids]
    return out


@pytest.mark.parametrize("size", [2, 4])
def test_every_line_names_a_test_where_it_applies(every_test, size):
    _, left, unused = tiers.select(every_test[size], size)
    # a line for every world size is checked at -np 2 (its id may name a -np 2 case)
    restricted = {where for _, worlds, where in tiers.entries() if worlds}
    unused = [w for w in unused if size == 2 or w in restricted]
    assert not unused, f"{unused}: name no test at -np {size}"
    assert left


@pytest.mark.parametrize("size", [2, 4])
def test_core_tier_keeps_every_module_and_strategy(every_test, size):
    kept, left, _ = tiers.select(every_test[size], size)
    assert len(kept) > len(left), "the core tier should keep most tests"
    modules = lambda ids: {i.split("::")[0] for i in ids}     # noqa: E731
    assert modules(kept) == modules(i for i, _ in every_test[size]), \
        "a whole module left the core tier"
    for strategy, prefix in STRATEGY_TESTS.items():
        assert any(i.startswith(prefix) for i in kept), \
            f"{strategy}: no exactness test at -np {size} in the core tier ({prefix}...)"


def test_every_test_function_runs_in_the_core_tier(every_test):
    """No test function leaves CI whole: each keeps a case at -np 2 or -np 4."""
    function = lambda i: i.partition("[")[0]     # noqa: E731
    kept = {function(i) for size in (2, 4) for i in tiers.select(every_test[size], size)[0]}
    every = {function(i) for size in (2, 4) for i, _ in every_test[size]}
    assert not every - kept, f"no case of these in the core tier: {sorted(every - kept)}"


def test_list_syntax(tmp_path):
    listed = tmp_path / "full_tier.txt"
    listed.write_text("# comment\n\na.py::t[x-*]  # trailing\n@np4 a.py::u\n@np2,4 b.py::v[(2, 'h')]\n")
    tests = [("a.py::t[x-1]", False), ("a.py::t[y-1]", False), ("a.py::u", False),
             ("b.py::v[(2, 'h')]", False), ("c.py::w[function]", False), ("c.py::w[eager]", True)]
    assert tiers.select(tests, 2, listed) == (
        ["a.py::t[y-1]", "a.py::u", "c.py::w[function]", "c.py::w[eager]"],
        ["a.py::t[x-1]", "b.py::v[(2, 'h')]"], [])
    kept, left, unused = tiers.select(tests[:2], 4, listed)
    assert kept == ["a.py::t[y-1]"] and unused == ["full_tier.txt:4", "full_tier.txt:5"]
    assert tiers.select([("c.py::w[eager]", True)], 4, listed)[1] == ["c.py::w[eager]"]
