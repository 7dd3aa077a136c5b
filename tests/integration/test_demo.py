"""`make demo`'s job end to end: 2 Horovod processes, hybrid strategy, accuracy > 90%."""
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HOROVODRUN = Path(sys.executable).parent / "horovodrun"


def test_demo_trains_digits_above_90_percent():
    env = dict(os.environ, TF_NUM_INTRAOP_THREADS="1", TF_CPP_MIN_LOG_LEVEL="2")
    proc = subprocess.run(
        [str(HOROVODRUN), "-np", "2", "--gloo", sys.executable, "examples/train_digits.py",
         "--epochs", "10"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    match = re.search(r"final test accuracy: ([0-9.]+)", out)
    assert match, out[-4000:]
    assert float(match.group(1)) > 0.9, out[-4000:]
    # Progress output comes from rank 0 only.
    assert "[1]<stdout>:Epoch" not in out
