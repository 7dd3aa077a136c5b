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
