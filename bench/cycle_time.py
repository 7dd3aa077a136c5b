"""Horovod's background cycle time vs tfhybrid's step time, per strategy.

Model-parallel strategies put small, dependent collectives on the critical
path of every step (f/c: one per partitioned layer, s: halo exchanges);
Horovod starts a collective only at its next background cycle
(``HOROVOD_CYCLE_TIME``, ``tfhybrid.Config(cycle_time_ms=...)``), so the
cycle may matter more to them than to data parallelism, whose gradients go
in one fused bucket.

The cycle time is read once, at ``hvd.init``, so it cannot change inside a
job: the driver alternates jobs (default cycle, then each ``--cycles``
value, ``--jobs`` times over), each job timing the bench CNN of
``bench/oracle_accuracy.py`` under d, f, s and gmp in interleaved rounds
(minimum step per strategy). It reports the median over jobs of those
minima per cycle time and the ratio to the default, to
``bench/results/cycle_time.json`` and a markdown table.

Usage:
    .venv/bin/python bench/cycle_time.py [--nps 2 4] [--cycles 0.2] [--jobs 3]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, ROOT)
STRATEGIES = ("d", "f", "s", "gmp")
DEFAULT = "default"


def worker(args):
    """One job: every strategy built, traced and timed in interleaved rounds."""
    import oracle_accuracy as oa  # noqa: WPS433
    from tfhybrid.comm import backend  # noqa: WPS433
    n, rank = backend.init()[:2]
    steps = oa._build_steps(list(STRATEGIES), n, args.batch)
    steps.pop("serial")
    times = oa._interleaved(steps, args.rounds, args.steps, lambda s: None)
    if rank == 0:
        with open(args.out, "w", encoding="utf-8") as fh:
            json.dump({k: min(v) for k, v in times.items()}, fh)


def _job(np_, cycle, args, out):
    env = dict(os.environ, TF_NUM_INTRAOP_THREADS="1", TF_NUM_INTEROP_THREADS="1",
               TF_CPP_MIN_LOG_LEVEL="2")
    env.pop("HOROVOD_CYCLE_TIME", None)
    if cycle != DEFAULT:
        env["HOROVOD_CYCLE_TIME"] = str(cycle)
    bin_ = os.path.join(ROOT, ".venv", "bin")
    cmd = [os.path.join(bin_, "horovodrun"), "-np", str(np_), "--gloo",
           os.path.join(bin_, "python"), __file__, "--worker", "--out", out,
           "--batch", str(args.batch), "--steps", str(args.steps), "--rounds", str(args.rounds)]
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=args.timeout)
    if proc.returncode:
        tail = [ln for ln in proc.stdout.splitlines() + proc.stderr.splitlines() if "Error" in ln]
        raise SystemExit(f"job np={np_} cycle={cycle} failed (exit {proc.returncode}): "
                         f"{tail[-1] if tail else 'see horovodrun output'}")
    with open(out, encoding="utf-8") as fh:
        return json.load(fh)


def driver(args):
    os.makedirs(os.path.join(HERE, "results"), exist_ok=True)
    cycles = [DEFAULT] + [str(c) for c in args.cycles]
    rows = []
    for np_ in args.nps:
        seen = {c: {s: [] for s in STRATEGIES} for c in cycles}
        for j in range(args.jobs):
            for c in cycles:     # alternate, so outside load hits every cycle time alike
                out = os.path.join(HERE, "results", f"cycle_np{np_}_{c}_{j}.json")
                best = _job(np_, c, args, out)
                for s in STRATEGIES:
                    seen[c][s].append(best[s])
                print(f"np={np_} job {j + 1}/{args.jobs} cycle={c}: " + ", ".join(
                    f"{s} {best[s] * 1e3:.2f}" for s in STRATEGIES) + " ms", flush=True)
        for s in STRATEGIES:
            base = statistics.median(seen[DEFAULT][s])
            for c in cycles:
                med = statistics.median(seen[c][s])
                rows.append({"np": np_, "strategy": s, "cycle_ms": c, "median_best_s": med,
                             "jobs": seen[c][s], "ratio_to_default": med / base})
    with open(os.path.join(HERE, "results", "cycle_time.json"), "w", encoding="utf-8") as fh:
        json.dump({"batch": args.batch, "rows": rows}, fh, indent=1)
    print("\n| np | strategy | cycle ms | median of job minima ms | / default |\n|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['np']} | {r['strategy']} | {r['cycle_ms']} | {r['median_best_s'] * 1e3:.2f} | "
              f"{r['ratio_to_default']:.3f} |")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--nps", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--cycles", type=float, nargs="+", default=[0.2],
                    help="HOROVOD_CYCLE_TIME values (ms) compared with Horovod's default")
    ap.add_argument("--jobs", type=int, default=3, help="jobs per cycle time (alternating)")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--timeout", type=int, default=600, help="seconds per job")
    args = ap.parse_args(argv)
    if args.cycles and any(c <= 0 for c in args.cycles):
        ap.error(f"--cycles must be positive milliseconds; received {args.cycles}")
    (worker if args.worker else driver)(args)


if __name__ == "__main__":
    main()
