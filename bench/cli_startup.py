"""Start-up time of the ``tfhybrid`` command: ``--help``/``--version`` vs TensorFlow.

Run: ``.venv/bin/python bench/cli_startup.py [--rounds 5]``

Each round runs, interleaved (the machine is shared and noisy), a bare
``python -c pass``, ``tfhybrid --help``, ``tfhybrid --version``, ``tfhybrid
plan --help`` and ``python -c "import tensorflow, keras"`` (what ``--help``
would cost if the CLI imported TensorFlow), and prints the median wall time
of each and its ratio to the TensorFlow import as a markdown table.
"""
import argparse
import statistics
import subprocess
import sys
import time

CASES = {
    "python -c pass": [sys.executable, "-c", "pass"],
    "tfhybrid --help": [sys.executable, "-m", "tfhybrid.cli", "--help"],
    "tfhybrid --version": [sys.executable, "-m", "tfhybrid.cli", "--version"],
    "tfhybrid plan --help": [sys.executable, "-m", "tfhybrid.cli", "plan", "--help"],
    "import tensorflow, keras": [sys.executable, "-c", "import tensorflow, keras"],
}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    times = {name: [] for name in CASES}
    env = {"TF_CPP_MIN_LOG_LEVEL": "3", "PATH": "/usr/bin:/bin"}
    for _ in range(args.rounds):
        for name, cmd in CASES.items():
            start = time.perf_counter()
            subprocess.run(cmd, check=True, capture_output=True, env=env)
            times[name].append(time.perf_counter() - start)
    tf_time = statistics.median(times["import tensorflow, keras"])
    print(f"| command | median s ({args.rounds} rounds) | / import tensorflow |")
    print("|---|---|---|")
    for name, values in times.items():
        med = statistics.median(values)
        print(f"| `{name}` | {med:.3f} | {med / tf_time:.3f} |")


if __name__ == "__main__":
    main()
