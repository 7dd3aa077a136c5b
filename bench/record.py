#!/usr/bin/env python
"""Run one benchmark command and add its output to docs/benchmarks.md.

Every section of docs/benchmarks.md is written by this script, never by
hand: the date, the machine (cores, memory, CPU model, Python, TensorFlow,
Keras and Horovod versions), the exact command, and the lines the
benchmark printed (its table of medians and ratios). A newer run of the
same command replaces the older section, so the page holds one current
result per benchmark.

Usage:
    python bench/record.py [--dry-run] -- COMMAND...

Example:
    python bench/record.py -- .venv/bin/horovodrun -np 2 --gloo .venv/bin/python bench/dp.py --pair
"""
from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import os
import platform
import re
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "benchmarks.md"
HEADER = """# Benchmarks

Each section below is the output of one benchmark run, added by
`python bench/record.py -- COMMAND` (date, machine, command, printed lines).
Ratios are measured side by side in one run; absolute times depend on the
machine and its load.
"""
# Lines a run prints that are not results: Horovod's launcher and TensorFlow's logs.
NOISE = re.compile(r"^(\[\d+\]<stderr>|\S+\.cc:\d+\]|WARNING:|I0000|W0000|E0000|.*oneDNN custom operations)")


def version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "-"


def machine() -> str:
    """One line describing this machine and the software stack."""
    cpu = platform.processor() or "?"
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    try:
        mem_gb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError):
        mem_gb = float("nan")
    tf = version("tensorflow-cpu") if version("tensorflow-cpu") != "-" else version("tensorflow")
    return (f"{os.cpu_count()} cores ({cpu}), {mem_gb:.0f} GB, Python {platform.python_version()}, "
            f"TensorFlow {tf}, Keras {version('keras')}, Horovod {version('horovod')}")


def result_lines(output: str) -> list[str]:
    """The printed lines worth keeping: without launcher prefixes and library logs."""
    keep = []
    for line in output.splitlines():
        line = re.sub(r"^\[\d+\]<stdout>:", "", line).rstrip()
        if line and not NOISE.match(line):
            keep.append(line)
    return keep


def section(command: list[str], lines: list[str], when: datetime.datetime) -> str:
    cmd = shlex.join(command)
    body = "\n".join(lines)
    return (f"## `{cmd}`\n\n- date: {when:%Y-%m-%d %H:%M} UTC\n- machine: {machine()}\n\n"
            f"```text\n{body}\n```\n")


def merge(page: str, new: str) -> str:
    """``page`` with ``new``'s section replacing the one of the same command (or appended)."""
    title = new.splitlines()[0]
    parts = re.split(r"(?m)^(?=## `)", page)
    head, sections = parts[0], [p for p in parts[1:] if not p.startswith(title + "\n")]
    return head.rstrip() + "\n\n" + "".join(s.rstrip() + "\n\n" for s in sections) + new


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry-run", action="store_true", help="print the section, do not write the page")
    ap.add_argument("command", nargs=argparse.REMAINDER, help="the benchmark command, after --")
    args = ap.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        ap.error("no command given: python bench/record.py -- COMMAND...")
    print(f"[record] running: {shlex.join(command)}", flush=True)
    proc = subprocess.run(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    sys.stdout.write(proc.stdout)
    if proc.returncode != 0:
        print(f"[record] the command exited {proc.returncode}; docs/benchmarks.md left unchanged",
              file=sys.stderr)
        return proc.returncode
    new = section(command, result_lines(proc.stdout), datetime.datetime.now(datetime.timezone.utc))
    if args.dry_run:
        print(new)
        return 0
    page = PAGE.read_text(encoding="utf-8") if PAGE.exists() else HEADER
    PAGE.write_text(merge(page, new), encoding="utf-8")
    print(f"[record] wrote {PAGE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
