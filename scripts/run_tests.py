#!/usr/bin/env python
"""Run tfhybrid's test suites and print one closing summary line.

Suites: ``unit`` (one process), ``parallel`` under ``horovodrun -np 2`` and
``-np 4 --gloo`` (every rank runs the same pytest session), ``integration``,
``multihost`` (jobs across two test hosts made on this machine, root only;
tests/multihost/conftest.py), and ``tf-oldest``: the unit tests and a short
-np 2 set on the oldest supported TensorFlow, in a second environment
(scripts/oldest_tf_tier.sh; the others run on the default, the newest).
Each rank writes a JUnit XML file under ``test-results/``; the summary counts
rank 0's results per parallel run and fails if any rank failed.

Tiers: by default the core tier (``make test``, what CI runs: every parallel
layer and strategy at -np 2 and -np 4); ``--full`` (``make test-full``) adds
the tests tests/parallel/full_tier.txt lists (README "Testing"), about twice
the time.

Time budget: suites run in priority order (unit, -np 2, oldest TensorFlow,
integration, -np 4 part 1, multihost, -np 4 part 2). The -np 2 suite measures how fast this
machine runs against its nominal duration; a later suite whose projected
end would pass the budget (``TFHYBRID_TEST_BUDGET_MINUTES``, default 75 for
the core tier, none for the full tier) is skipped with a line saying so, so
that a slow or loaded machine still finishes within CI's limit; ``make
test-full`` runs every suite.

Usage: python scripts/run_tests.py [--only unit|parallel|integration|multihost|tf-oldest] [--full] [-k EXPR]
"""
import argparse
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
RESULTS = ROOT / "test-results"
#: Minutes each suite takes on a quiet 2-core machine (the budget's yardstick).
NOMINAL_MINUTES = {"unit": 1.5, "parallel-np2": 8, "tf-oldest": 5, "integration": 16,
                   "parallel-np4-part1": 5.5, "multihost": 7, "parallel-np4-part2": 6.5}
#: Run order: what a budget cut drops last comes first.
PRIORITY = ("unit", "parallel-np2", "tf-oldest", "integration", "parallel-np4-part1",
            "multihost", "parallel-np4-part2")
TIMEOUT = {"unit": 900, "parallel": 3000, "tf": 2400, "integration": 3000, "multihost": 1200}


def pytest_cmd(paths, xml, extra):
    return [sys.executable, "-m", "pytest", *paths, "-q", "-p", "no:cacheprovider",
            f"--junitxml={xml}", *extra]


HEAVY = ("test_strategies_vgg16_float64.py", "test_strategies_resnet.py",
         "test_strategies_apps.py")


def parallel_halves():
    """tests/parallel's test files in two lists of about equal size: the
    memory-heavy modules (VGG16, ResNet-50) and the first files, the rest."""
    files = sorted(p.name for p in (ROOT / "tests/parallel").glob("test_*.py"))
    rest = [f for f in files if f not in HEAVY]
    half = max(0, len(files) // 2 - len(HEAVY))
    first = [f for f in HEAVY if f in files] + rest[:half]
    return [[f"tests/parallel/{f}" for f in first],
            [f"tests/parallel/{f}" for f in rest[half:]]]


def suites(only, extra):
    out = []
    if only in (None, "unit"):
        out.append(("unit", None, pytest_cmd(["tests/unit"], RESULTS / "unit.xml", extra)))
    if only in (None, "parallel"):
        for np_ in (2, 4):
            # -np 4: two sessions (fresh processes): each rank's resident set grows by a
            # few GB over one session, more than 4 ranks of a 24 GB node can hold
            parts = [["tests/parallel"]] if np_ == 2 else parallel_halves()
            for i, paths in enumerate(parts):
                name = f"parallel-np{np_}" + (f"-part{i + 1}" if len(parts) > 1 else "")
                xml = RESULTS / f"{name}-rank{{rank}}.xml"
                # Each rank expands its own file name from HOROVOD_RANK (see conftest).
                cmd = [str(BIN / "horovodrun"), "-np", str(np_), "--gloo",
                       *pytest_cmd(paths, xml, extra)]
                out.append((name, np_, cmd))
    if only in (None, "integration") and list((ROOT / "tests/integration").glob("test_*.py")):
        out.append(("integration", None, pytest_cmd(["tests/integration"], RESULTS / "integration.xml", extra)))
    if only in (None, "tf-oldest"):
        out.append(("tf-oldest", None, ["bash", str(ROOT / "scripts/oldest_tf_tier.sh"),
                                         str(RESULTS), *extra]))
    if only in (None, "multihost") and list((ROOT / "tests/multihost").glob("test_*.py")):
        out.append(("multihost", None, pytest_cmd(["tests/multihost"], RESULTS / "multihost.xml", extra)))
    return sorted(out, key=lambda suite: PRIORITY.index(suite[0]) if suite[0] in PRIORITY else 99)


def over_budget(name, elapsed_s, factor, budget_min):
    """Why ``name`` is skipped (projected past the budget), or None to run it."""
    if budget_min is None or factor is None or name not in NOMINAL_MINUTES:
        return None
    projected = elapsed_s / 60 + factor * NOMINAL_MINUTES[name]
    if projected <= budget_min:
        return None
    return (f"skipped: projected to end at {projected:.0f} min, past the {budget_min:.0f}-minute "
            f"budget (this machine runs {factor:.1f}x the nominal time; "
            "TFHYBRID_TEST_BUDGET_MINUTES sets the budget, make test-full runs every suite)")


def counts(xml_files):
    passed = failed = skipped = 0
    for f in xml_files:
        if not f.exists():
            continue
        for suite in ET.parse(f).getroot().iter("testsuite"):
            t, fl, er, sk = (int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped"))
            passed += t - fl - er - sk
            failed += fl + er
            skipped += sk
    return passed, failed, skipped


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", choices=["unit", "parallel", "integration", "multihost", "tf-oldest"])
    ap.add_argument("--full", action="store_true",
                    help="the full tier: also the tests full_tier.txt lists (TFHYBRID_TEST_FULL=1)")
    ap.add_argument("-k", help="pytest -k expression")
    args = ap.parse_args()
    extra = ["-k", args.k] if args.k else []
    RESULTS.mkdir(exist_ok=True)
    for f in RESULTS.glob("*.xml"):
        f.unlink()
    env = dict(os.environ, TF_NUM_INTRAOP_THREADS=os.environ.get("TF_NUM_INTRAOP_THREADS", "1"),
               TF_CPP_MIN_LOG_LEVEL="2", PYTHONUNBUFFERED="1",
               HOROVOD_STALL_CHECK_TIME_SECONDS="60", HOROVOD_STALL_SHUTDOWN_TIME_SECONDS="240")
    if args.full:
        env["TFHYBRID_TEST_FULL"] = "1"
    tier = "full" if env.get("TFHYBRID_TEST_FULL") == "1" else "core"
    print(f"tfhybrid tests, {tier} tier" + ("" if tier == "full" else
          " (make test-full or --full adds the tests full_tier.txt lists)"), flush=True)
    # single-process references, computed once per run by rank 0 (tests/parallel/conftest.py)
    references = tempfile.TemporaryDirectory(prefix="tfhybrid-test-references-")
    env.setdefault("TFHYBRID_TEST_REFERENCES", references.name)
    total = [0, 0, 0]
    bad = []
    budget = os.environ.get("TFHYBRID_TEST_BUDGET_MINUTES", "" if tier == "full" else "75")
    budget = float(budget) if budget else None
    began, factor, cut = time.time(), None, []
    for name, np_, cmd in suites(args.only, extra):
        why = over_budget(name, time.time() - began, factor, budget)
        if why:
            print(f"\n=== {name}: {why} ===", flush=True)
            cut.append(name)
            continue
        print(f"\n=== {name}: {' '.join(cmd[:4])} ... ===", flush=True)
        start = time.time()
        timeout = TIMEOUT[name.split("-")[0]] * (2 if tier == "full" else 1)
        try:
            rc = subprocess.run(cmd, cwd=ROOT, env=env, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
        files = sorted(RESULTS.glob(f"{name}*.xml")) if np_ is None else \
            [RESULTS / f"{name}-rank{r}.xml" for r in range(np_)]
        # a suite of several sessions (tf-oldest): rank 0's file of each parallel one
        p, f, s = counts(files[:1] if np_ else
                         [x for x in files if "-rank" not in x.name or x.name.endswith("-rank0.xml")])
        rank_failures = sum(counts([x])[1] for x in files)
        print(f"=== {name}: {p} passed, {f} failed, {s} skipped on rank 0 "
              f"(failures on any rank: {rank_failures}; exit {rc}; {time.time() - start:.0f}s) ===",
              flush=True)
        # the multihost suite skips as a whole where test hosts cannot be made (not root)
        if rc not in (0,) or rank_failures or (p == 0 and not (name == "multihost" and s)):
            bad.append(name)
        total = [a + b for a, b in zip(total, (p, max(f, rank_failures), s))]
        if name == "parallel-np2" and rc == 0:
            factor = max(1.0, (time.time() - start) / 60 / NOMINAL_MINUTES[name])
    references.cleanup()
    print(f"\nsuites failing: {', '.join(bad) if bad else 'none'}")
    if cut:
        print(f"suites skipped for the time budget: {', '.join(cut)}")
    print(f"{total[0]} passed, {total[1]} failed, {total[2]} skipped")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
