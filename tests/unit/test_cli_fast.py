"""The ``tfhybrid`` command answers --help and --version without importing
TensorFlow, Keras or Horovod (seconds of start-up; checked with ``-X importtime``)."""
import re
import subprocess
import sys
from pathlib import Path

import pytest

import tfhybrid

ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("tensorflow", "keras", "horovod", "numpy")


def _run(*args):
    proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "tfhybrid.cli", *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    imported = set(re.findall(r"^import time:\s+\d+ \|\s+\d+ \| ( *)(\S+)$",
                              proc.stderr, re.M))
    top = {name.split(".")[0] for _, name in imported}
    return proc, top


@pytest.mark.parametrize("args", [["--help"], ["plan", "--help"], ["calibrate", "--help"],
                                  ["--version"]])
def test_help_and_version_import_no_tensorflow(args):
    proc, top = _run(*args)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "tfhybrid" in top                     # the importtime trace was read
    assert not top & set(HEAVY), sorted(top & set(HEAVY))
    if args == ["--version"]:
        assert proc.stdout.startswith(f"tfhybrid {tfhybrid.__version__} (tensorflow ")
        assert "keras " in proc.stdout and "horovod " in proc.stdout
    else:
        assert "usage: tfhybrid" in proc.stdout


def test_python_dash_m_tfhybrid_is_the_command():
    """`python -m tfhybrid` runs the same command as the console script (for
    environments where the script is not on PATH), as fast."""
    proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "tfhybrid", "--help"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith("usage: tfhybrid"), proc.stdout[:500]
    for name in ("plan", "calibrate"):
        assert name in proc.stdout
    top = {name.split(".")[0] for name in
           re.findall(r"^import time:\s+\d+ \|\s+\d+ \| *(\S+)$", proc.stderr, re.M)}
    assert "tfhybrid" in top and not top & set(HEAVY), sorted(top & set(HEAVY))
    bad = subprocess.run([sys.executable, "-m", "tfhybrid", "no-such-command"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "invalid choice" in bad.stderr, bad.stderr[-2000:]
