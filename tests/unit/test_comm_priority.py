"""tfhybrid.comm.priority: the compute threads' nice value (communication first)."""
import json
import os
import subprocess
import sys
import textwrap

import pytest

import tfhybrid
from tfhybrid.comm import priority

linux_only = pytest.mark.skipif(not os.path.isdir("/proc/self/task"),
                                reason="per-thread nice values need Linux's /proc/self/task")


def test_levels_from_env():
    assert priority.levels_from_env({}) == priority.DEFAULT_LEVELS == 10
    assert priority.levels_from_env({priority.ENV: " 3 "}) == 3
    assert priority.levels_from_env({priority.ENV: "0"}) == 0
    for bad in ("-1", "20", "high", "2.5"):
        with pytest.raises(ValueError, match=f"TFHYBRID_COMM_PRIORITY='{bad}'.*0 \\(off\\) to 19"):
            priority.levels_from_env({priority.ENV: bad})


def test_config_comm_priority():
    assert tfhybrid.Config().horovod_env()["TFHYBRID_COMM_PRIORITY"] == "10"
    assert tfhybrid.Config(comm_priority=0).horovod_env()["TFHYBRID_COMM_PRIORITY"] == "0"
    for bad in (-1, 20, True, 2.0, "5"):
        with pytest.raises(ValueError, match="comm_priority="):
            tfhybrid.Config(comm_priority=bad)


def test_compute_threads_are_all_but_the_kept(tmp_path):
    for tid in (100, 101, 102, 103):
        (tmp_path / str(tid)).mkdir()
    assert priority.compute_threads(keep={101, 103}, tasks=str(tmp_path)) == [100, 102]
    assert priority.compute_threads(tasks=str(tmp_path / "missing")) == []


@linux_only
def test_lower_compute_priority_leaves_the_kept_threads():
    # in a child process: a nice value raised cannot be lowered again without privilege
    script = textwrap.dedent("""
        import json, os, threading
        import tensorflow as tf
        from tfhybrid.comm import priority
        tf.reduce_sum(tf.ones([64, 64]) @ tf.ones([64, 64])).numpy()   # TensorFlow's threads
        before = priority.thread_ids()
        ready, stop, other = threading.Event(), threading.Event(), {}
        def comm_thread():          # stands for Horovod's background thread
            other["tid"] = threading.get_native_id()
            ready.set()
            stop.wait()
        threading.Thread(target=comm_thread, daemon=True).start()
        ready.wait()
        started = priority.thread_ids() - before
        nice = lambda t: os.getpriority(os.PRIO_PROCESS, t)
        base = nice(os.getpid())
        changed = priority.lower_compute_priority(4, keep=started)
        again = priority.lower_compute_priority(4, keep=started)
        late = {}
        def later():                 # started by the lowered main thread: inherits
            late["nice"] = nice(threading.get_native_id())
        t = threading.Thread(target=later)
        t.start()
        t.join()
        others = sorted(before - {os.getpid()})
        print(json.dumps({"base": base, "main": nice(os.getpid()), "late": late["nice"],
                          "others": sorted({nice(t) for t in others}), "n": len(others),
                          "kept": nice(other["tid"]), "started": sorted(started),
                          "tid": other["tid"], "changed": len(changed), "again": again}))
        stop.set()
    """)
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", TF_NUM_INTRAOP_THREADS="1")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    want = min(19, got["base"] + 4)
    assert got["started"] == [got["tid"]]
    assert got["main"] == want and got["late"] == want
    assert got["n"] > 0 and got["others"] == [want]      # TensorFlow's threads
    assert got["kept"] == got["base"]         # the communication thread keeps its priority
    assert got["changed"] == 1 + got["n"] and got["again"] == []
