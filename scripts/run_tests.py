#!/usr/bin/env python
"""Run tfhybrid's test suites and print one closing summary line.

Suites: ``unit`` (one process), ``parallel`` under ``horovodrun -np 2`` and
``-np 4 --gloo`` (every rank runs the same pytest session), ``integration``,
``multihost`` (jobs across two test hosts made on this machine, root only;
tests/multihost/conftest.py).
Each rank writes a JUnit XML file under ``test-results/``; the summary counts
rank 0's results per parallel run and fails if any rank failed.

Tiers: by default the core tier (``make test``, what CI runs: every parallel
layer and strategy at -np 2 and -np 4); ``--full`` (``make test-full``) adds
the tests tests/parallel/full_tier.txt lists (README "Testing"), about twice
the time.

Usage: python scripts/run_tests.py [--only unit|parallel|integration|multihost] [--full] [-k EXPR]
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
TIMEOUT = {"unit": 900, "parallel": 3000, "integration": 2400, "multihost": 1200}


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
    if only in (None, "multihost") and list((ROOT / "tests/multihost").glob("test_*.py")):
        out.append(("multihost", None, pytest_cmd(["tests/multihost"], RESULTS / "multihost.xml", extra)))
    return out


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
    ap.add_argument("--only", choices=["unit", "parallel", "integration", "multihost"])
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
    for name, np_, cmd in suites(args.only, extra):
        print(f"\n=== {name}: {' '.join(cmd[:4])} ... ===", flush=True)
        start = time.time()
        timeout = TIMEOUT[name.split("-")[0]] * (2 if tier == "full" else 1)
        try:
            rc = subprocess.run(cmd, cwd=ROOT, env=env, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
        files = sorted(RESULTS.glob(f"{name}*.xml")) if np_ is None else \
            [RESULTS / f"{name}-rank{r}.xml" for r in range(np_)]
        p, f, s = counts(files[:1] if np_ else files)
        rank_failures = sum(counts([x])[1] for x in files)
        print(f"=== {name}: {p} passed, {f} failed, {s} skipped on rank 0 "
              f"(failures on any rank: {rank_failures}; exit {rc}; {time.time() - start:.0f}s) ===",
              flush=True)
        # the multihost suite skips as a whole where test hosts cannot be made (not root)
        if rc not in (0,) or rank_failures or (p == 0 and not (name == "multihost" and s)):
            bad.append(name)
        total = [a + b for a, b in zip(total, (p, max(f, rank_failures), s))]
    references.cleanup()
    print(f"\nsuites failing: {', '.join(bad) if bad else 'none'}")
    print(f"{total[0]} passed, {total[1]} failed, {total[2]} skipped")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
