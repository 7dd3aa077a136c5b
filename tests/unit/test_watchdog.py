"""tfhybrid.watchdog in one process: the bound, the report, the bookkeeping, and a real firing."""
import re
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

import tfhybrid
from tfhybrid import watchdog
from tfhybrid.watchdog import Watchdog, WatchdogCallback

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("value, expected", [
    (None, None), ("", None), ("  ", None), ("0", 0.0), ("off", 0.0), ("False", 0.0),
    ("20", 20.0), ("7.5", 7.5)])
def test_parse_env(value, expected):
    assert watchdog.parse_env(value) == expected


@pytest.mark.parametrize("value", ["-1", "abc", "inf", "nan", "10s"])
def test_parse_env_rejects(value):
    with pytest.raises(ValueError, match="TFHYBRID_WATCHDOG_SECONDS"):
        watchdog.parse_env(value)


def test_default_bound_floor_and_step_factor():
    assert watchdog.default_bound(None) == 100.0
    assert watchdog.default_bound(0.05) == 100.0        # fast steps: the floor
    assert watchdog.default_bound(9.0) == 100.0
    assert watchdog.default_bound(20.0) == 200.0        # slow steps: 10 x the median
    # the floor leaves a 75 s pause of one rank 25 s of margin, and ends a hang
    # (bound + 1 s poll + 3 s grace + teardown) within the 2-minute target
    assert 75 + 20 <= watchdog.FLOOR_SECONDS <= 120 - watchdog.POLL_SECONDS - watchdog.GRACE_SECONDS - 10


@pytest.mark.parametrize("kwargs, phrase", [
    ({"watchdog_seconds": 0}, "watchdog=False"), ({"watchdog_seconds": -5}, "positive"),
    ({"watchdog_seconds": True}, "positive"), ({"watchdog_seconds": "10"}, "positive"),
    ({"watchdog_seconds": float("inf")}, "positive"), ({"watchdog": "yes"}, "True or False")])
def test_config_rejects(kwargs, phrase):
    with pytest.raises(ValueError, match=phrase):
        tfhybrid.Config(**kwargs)


def test_config_accepts():
    assert tfhybrid.Config().watchdog is True and tfhybrid.Config().watchdog_seconds is None
    assert tfhybrid.Config(watchdog_seconds=20).watchdog_seconds == 20
    assert tfhybrid.Config(watchdog=False).watchdog is False


def test_configure_env_overrides_config():
    w = Watchdog()
    w.configure(seconds=30, enabled=True, rank=1, size=2, env={})
    assert (w.seconds, w.enabled, w.bound("train")) == (30.0, True, 30.0)
    w.configure(seconds=30, enabled=True, env={"TFHYBRID_WATCHDOG_SECONDS": "45"})
    assert w.bound() == 45.0
    w.configure(seconds=30, enabled=True, env={"TFHYBRID_WATCHDOG_SECONDS": "off"})
    assert not w.enabled
    w.configure(seconds=None, enabled=True, env={"TFHYBRID_WATCHDOG_SECONDS": ""})
    assert w.seconds is None and w.bound() == 100.0


def test_bound_follows_median_step_time():
    w = Watchdog()
    w.configure(env={})
    w._durations["train"].extend([30.0, 0.1, 0.1, 0.1])     # a long first (traced) step
    assert w.median_step("train") == pytest.approx(0.1) and w.bound("train") == 100.0
    w._durations["test"].extend([15.0, 15.0, 16.0])
    assert w.bound("test") == 150.0
    assert w.bound("collective") == 150.0                     # the slowest kind of step


def test_expired_collective_and_message():
    w = Watchdog()
    w.configure(seconds=10, rank=1, size=4, env={})
    token = w.begin("collective", "tfh.metric_average.logs", op="allreduce", ranks=(0, 1, 2, 3))
    start = w._active[token].start
    assert w.expired(now=start + 9) is None
    act, waited, bound = w.expired(now=start + 12)
    assert (act.name, round(waited), bound) == ("tfh.metric_average.logs", 12, 10.0)
    waited = 11.2
    text = w.message(act, waited, bound)
    assert text.startswith("tfhybrid watchdog: rank 1 of 4 has waited 12 s (bound 10 s) in "
                           "collective 'tfh.metric_average.logs' (allreduce over ranks [0, 1, 2, 3])")
    for phrase in ("average_logs", "stop_training", "TerminateOnNaN", "auto-generated names",
                   "watchdog_seconds", "TFHYBRID_WATCHDOG_SECONDS", "exit code 124"):
        assert phrase in text
    assert "\n" not in text
    w.end(token)
    w._last_done = "train step 5 (epoch 1, batch 4)"
    assert "[0, 1, 2, 3]), after train step 5 (epoch 1, batch 4). " in w.message(act, waited, bound)
    assert w.expired(now=start + 100) is None


def test_step_names_traced_collectives_and_tracing_is_progress():
    w = Watchdog()
    w.configure(seconds=10, env={})
    token = w.begin("train", "train step", step=6, detail="epoch 1, batch 5")
    start = w._active[token].start
    w.traced("allreduce", "tfh.dense.reduce.model", (0, 1))
    w._last_trace = start + 8                                  # a long trace ended at +8 s
    assert w.expired(now=start + 15) is None                   # 7 s since the last trace
    act, waited, _ = w.expired(now=start + 19)
    text = w.message(act, waited, 10)
    assert "train step 6 (epoch 1, batch 5)" in text
    assert "'tfh.dense.reduce.model' (allreduce over ranks [0, 1])" in text
    w.end(token)


def test_step_left_by_an_exception_is_dropped():
    w = Watchdog()
    w.configure(seconds=1, env={})

    def fit_like():                  # begins a step, then "raises" out of the loop
        return w.begin("train", "train step", step=1, owner=sys._getframe())

    token = fit_like()
    assert w.expired(now=time.monotonic() + 5) is None       # owner frame gone
    assert token not in w._active
    token = w.begin("train", "train step", step=1, owner=sys._getframe())
    assert w.expired(now=time.monotonic() + 5) is not None   # owner still running
    w.end(token)


def test_callback_records_steps_once_even_if_listed_twice():
    w = watchdog.get()
    cb = WatchdogCallback()
    before = len(w._durations["train"])
    cb.on_train_begin()
    for batch in range(3):
        cb.on_train_batch_begin(batch)
        cb.on_train_batch_begin(batch)                     # the same callback listed twice
        assert sum(a.kind == "train" for a in w._active.values()) == 1
        cb.on_train_batch_end(batch)
        cb.on_train_batch_end(batch)
    assert len(w._durations["train"]) == before + 3
    cb.on_test_begin()
    cb.on_test_batch_begin(0)                              # an exception: never ended
    cb.on_test_begin()                                     # the next evaluate starts clean
    assert not any(a.kind == "test" for a in w._active.values())
    assert watchdog.callback() is watchdog.callback()


def test_unwatched_collectives():
    w = watchdog.get()
    with watchdog.unwatched():
        with watchdog.collective("allreduce", "tfh.barrier", (0, 1)):
            assert not w._active
    seen = []

    def exit_barrier():
        with watchdog.collective("allreduce", "tfh.barrier", (0, 1)):
            seen.append(len(w._active))

    t = threading.Thread(target=exit_barrier, name="tfhybrid-exit-barrier")
    t.start()
    t.join()
    assert seen == [0]


def test_fires_prints_and_exits_non_zero():
    code = textwrap.dedent("""
        import time
        from tfhybrid import watchdog
        w = watchdog.get()
        w.configure(seconds=1, enabled=True, rank=0, size=2, env={})
        w.grace = 0
        w.start()
        with watchdog.collective("allreduce", "tfh.dense.reduce.model", (0, 1)):
            time.sleep(30)
        print("NOT REACHED")
    """)
    start = time.time()
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == watchdog.EXIT_CODE, proc.stderr[-2000:]
    assert "NOT REACHED" not in proc.stdout
    assert re.search(r"tfhybrid watchdog: rank 0 of 2 has waited \d+ s \(bound 1 s\) in "
                     r"collective 'tfh.dense.reduce.model' \(allreduce over ranks \[0, 1\]\)",
                     proc.stderr), proc.stderr
    # then where the main thread waits: in the collective's with-block, at the sleep
    stacks = proc.stderr.split("tfhybrid watchdog: Python stacks of rank 0:")[-1]
    assert re.search(r"Current thread|Thread 0x", stacks) and 'File "<string>", line 9' in stacks, \
        proc.stderr[-2000:]
    assert time.time() - start < 30


def test_callback_step_is_owned_by_the_loop_calling_the_callback_list():
    """The step's owner frame is the first frame outside the watchdog and Keras'
    callback machinery (the fit loop), also on the cached repeat lookups."""
    import keras

    cb = WatchdogCallback()
    callbacks = keras.callbacks.CallbackList([cb])
    cb.on_train_begin()
    for _ in range(3):
        loop = sys._getframe()
        callbacks.on_train_batch_begin(0)
        act = watchdog.get()._active[WatchdogCallback._open["train"]]
        assert act.owner == (threading.get_ident(), loop)
        callbacks.on_train_batch_end(0)
    cb.on_train_end()


def test_silent_peers_are_probed_and_named():
    """The ranks whose liveness listener does not accept a connection are
    named with their host; a listening rank is not."""
    import socket
    port = watchdog.listen()
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    dead_port = closed.getsockname()[1]
    closed.close()                      # nothing listens there: the rank is gone
    w = Watchdog()
    w.configure(seconds=10, rank=0, size=4, env={})
    w.peers = ((0, "a", "127.0.0.1", port), (1, "a", "127.0.0.1", port),
               (2, "b", "127.0.0.1", dead_port), (3, "b", "127.0.0.1", dead_port))
    silent = w.silent_peers(timeout=2)
    assert silent == [(2, "b", "127.0.0.1"), (3, "b", "127.0.0.1")]
    token = w.begin("collective", "x", op="allreduce", ranks=(0, 1, 2, 3))
    act = w._active[token]
    text = w.message(act, 12, 10.0, silent)
    assert ". Silent: ranks 2, 3 on host b (127.0.0.1) answer no connection within 2 s" in text
    assert "\n" not in text
    w.peers = ((0, "a", "127.0.0.1", port), (1, "a", "127.0.0.1", port))
    assert w.silent_peers(timeout=2) == []
    assert "Silent" not in w.message(act, 12, 10.0, w.silent_peers(timeout=2))
    w.end(token)


def test_route_address():
    assert watchdog.route_address({}) is None
    assert watchdog.route_address({"HOROVOD_GLOO_RENDEZVOUS_ADDR": "127.0.0.1",
                                   "HOROVOD_GLOO_RENDEZVOUS_PORT": "1234"}) == "127.0.0.1"
