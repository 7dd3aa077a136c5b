"""bench/wire.py's pure parts: counters, rates, the formulas and the WIRE line."""
import importlib.util
import math
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def wire():
    spec = importlib.util.spec_from_file_location("wire", os.path.join(ROOT, "bench", "wire.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


PROC_NET_DEV = """\
Inter-|   Receive                                                |  Transmit
 face |bytes    packets errs drop fifo frame compressed multicast|bytes    packets errs drop fifo colls carrier compressed
    lo:    1234      10    0    0    0     0          0         0     1234      10    0    0    0     0       0          0
  eth0: 9876543    7000    0    0    0     0          0         0  5555555    6000    0    0    0     0       0          0
"""


def test_proc_net_dev_is_parsed(wire):
    assert wire.parse_proc_net_dev(PROC_NET_DEV, "eth0") == (9876543, 5555555)
    assert wire.parse_proc_net_dev(PROC_NET_DEV, "lo") == (1234, 1234)
    with pytest.raises(ValueError, match="eth1"):
        wire.parse_proc_net_dev(PROC_NET_DEV, "eth1")


def test_tx_bytes_reads_sysfs_then_proc(wire, tmp_path):
    stats = tmp_path / "sys" / "eth0" / "statistics"
    stats.mkdir(parents=True)
    (stats / "tx_bytes").write_text("424242\n")
    proc = tmp_path / "dev"
    proc.write_text(PROC_NET_DEV)
    assert wire.tx_bytes("eth0", tmp_path / "sys", proc) == 424242
    (stats / "tx_bytes").unlink()
    assert wire.tx_bytes("eth0", tmp_path / "sys", proc) == 5555555


def test_rates_and_tc_commands(wire):
    assert wire.rate_bits("100mbit") == 10**8
    assert wire.rate_bits("1gbit") == 10**9
    assert wire.rate_bits("unlimited") is None
    for bad in ("fast", "100", "-1mbit", "mbit"):
        with pytest.raises(ValueError, match="tc rate"):
            wire.rate_bits(bad)
    fifo, = wire.tc_commands("100mbit", "fifo")
    assert fifo[:7] == ["tc", "qdisc", "replace", "dev", "eth0", "root", "tbf"]
    assert fifo[fifo.index("rate") + 1] == "100mbit"
    assert fifo[fifo.index("burst") + 1] == "144kbit"     # two jumbo frames (> 1 ms)
    burst = {r: wire.tc_commands(r, "fifo")[0] for r in ("1gbit", "1mbit")}
    assert burst["1gbit"][burst["1gbit"].index("burst") + 1] == "1000kbit"
    assert burst["1mbit"][burst["1mbit"].index("burst") + 1] == "144kbit"
    for queue in wire.QUEUES:
        assert wire.tc_commands("unlimited", queue) == [["tc", "qdisc", "del", "dev", "eth0",
                                                        "root"]]
    with pytest.raises(ValueError, match="queue 'fq'"):
        wire.tc_commands("100mbit", "fq")


def test_small_packets_go_first(wire):
    """small-first: an htb class at the rate, packets below 256 bytes (IP length, its
    high byte 0) in the class served first, data in 50 ms of bytes."""
    cmds = wire.tc_commands("100mbit")
    assert cmds[0] == ["tc", "qdisc", "del", "dev", "eth0", "root"]
    root = next(c for c in cmds if "classid" in c and c[c.index("classid") + 1] == "1:1")
    assert root[root.index("rate") + 1] == "100000000bit"
    assert root[root.index("burst") + 1] == "18036b"      # two jumbo frames, in bytes
    classes = {c[c.index("classid") + 1]: c for c in cmds if "classid" in c}
    assert classes["1:10"][classes["1:10"].index("prio") + 1] == "0"
    assert classes["1:20"][classes["1:20"].index("prio") + 1] == "1"
    for name in ("1:10", "1:20"):
        assert classes[name][classes[name].index("ceil") + 1] == "100000000bit"
    rates = [int(classes[n][classes[n].index("rate") + 1][:-3]) for n in ("1:10", "1:20")]
    assert sum(rates) == 10**8
    fifo = next(c for c in cmds if "bfifo" in c)
    assert fifo[fifo.index("limit") + 1] == str(10**8 // 8 // 20)
    filt = next(c for c in cmds if "filter" in c)
    assert filt[filt.index("u32"):] == ["u32", "match", "u16", "0x0000", "0xff00", "at", "2",
                                        "flowid", "1:10"]
    assert "default" in cmds[1] and cmds[1][cmds[1].index("default") + 1] == "20"


def test_steps_grow_with_the_rate(wire):
    """Faster links, shorter steps: more of them per round, at most 6 times."""
    assert [wire.steps_at(r, 5) for r in ("10mbit", "100mbit", "101mbit", "400mbit",
                                         "1gbit", "10gbit", "unlimited")] == [
        5, 5, 10, 10, 20, 30, 30]


def test_the_measuring_jobs_merge(wire):
    """One job per model and one per strategy write one result: each part's own keys,
    every job's models and strategies, whichever ran first."""
    vgg = {"rates": ["100mbit"], "models": {"vgg": {"rates": {}}}}
    head = {"rates": ["100mbit"], "models": {"cnn_head": {"rates": {"x": 1}}}}
    d = {"rates": ["100mbit"], "models": {}, "oracle": {"d": {"seconds": 0.2}}}
    gmp = {"rates": ["100mbit"], "models": {}, "oracle": {"gmp": {"seconds": 0.04}}}
    parts = [vgg, head, d, gmp]
    merged, backwards = {}, {}
    for part in parts:
        merged = wire.merge_parts(merged, part)
    for part in reversed(parts):
        backwards = wire.merge_parts(backwards, part)
    assert merged == backwards
    assert merged["models"] == {**vgg["models"], **head["models"]}
    assert merged["oracle"] == {**d["oracle"], **gmp["oracle"]}
    assert wire.merge_parts({}, {}) == {"models": {}}
    assert "oracle" not in wire.merge_parts(vgg, head)


def test_formulas(wire):
    assert wire.ring_minimum(1000, 2) == 1000
    assert wire.ring_minimum(1000, 4) == 1500
    # compute 0.3, comm 0.1: a step of 0.3 hides all of comm, 0.4 none of it
    assert wire.hidden_fraction(0.3, 0.1, 0.3) == pytest.approx(1.0)
    assert wire.hidden_fraction(0.3, 0.1, 0.4) == pytest.approx(0.0)
    assert wire.hidden_fraction(0.3, 0.1, 0.35) == pytest.approx(0.5)
    assert math.isnan(wire.hidden_fraction(0.0, 0.1, 0.1))
    assert wire.accuracy(0.9, 1.0) == pytest.approx(0.9)
    assert wire.accuracy(1.1, 1.0) == pytest.approx(0.9)
    assert wire.typical([3, 1, 2, 5, 4, 6, 9, 8, 7], 3) == 4


def test_pick_and_plan_order(wire):
    plan = {"predictions": [
        {"strategy": "d", "total_s": 0.1, "feasible": True},
        {"strategy": "f", "total_s": 0.2, "feasible": True},
        {"strategy": "c", "total_s": None, "feasible": True},
        {"strategy": "s", "total_s": 0.05, "feasible": False}]}
    assert wire.plan_order(plan) == [("d", 0.1), ("f", 0.2)]
    pred = dict(wire.plan_order(plan))
    assert wire.pick_ok(pred, {"d": 1.05, "f": 1.0})
    assert not wire.pick_ok(pred, {"d": 1.2, "f": 1.0})
    assert not wire.pick_ok(pred, {"x": 1.0})


def test_summarise_rate(wire):
    lab = wire.bucket_label
    t = {"after": 0.5, lab(256 * 2**10): 0.45, lab(2**20): 0.40, lab(128 * 2**10): 0.48,
         "compute": 0.3, "comm": 0.2, "fp16": 0.4, "comm fp16": 0.1}
    b = {k: 1000.0 for k in t}
    b["after"], b["fp16"] = 2040.0, 1020.0
    r = wire.summarise_rate(t, b, param_bytes=2000, p=2)
    assert r["overlap_case"] == "bucket 1MiB"
    assert r["overlap_hidden"] == pytest.approx((0.3 + 0.2 - 0.4) / 0.2)
    assert r["hidden"]["after"] == pytest.approx(0.0)
    assert r["fusion_best"] == "bucket 1MiB"
    assert r["fusion_default_vs_best"] == pytest.approx(0.5 / 0.4)
    assert r["bytes_vs_ring"] == pytest.approx(1.02)
    assert r["fp16_speedup"] == pytest.approx(1.25)
    assert r["fp16_cut_of_comm"] == pytest.approx(0.5)
    assert r["fp16_bytes_ratio"] == pytest.approx(0.5)
    # with a per-rate "default" (bucket_bytes="auto" on the rate's calibrated link), the
    # fusion ratio is that contender's against the best of the sweep and "after"
    r = wire.summarise_rate(dict(t, default=0.42), b, param_bytes=2000, p=2)
    assert r["fusion_default_vs_best"] == pytest.approx(0.42 / 0.40)
    r = wire.summarise_rate(dict(t, default=0.38), b, param_bytes=2000, p=2)
    assert r["fusion_best"] == "default" and r["fusion_default_vs_best"] == 1.0
    # confirmation rounds: the default against the sweep's fastest fixed size, timed again
    assert wire.fusion_rival(dict(t, default=0.30)) == "bucket 1MiB"
    r = wire.summarise_rate(dict(t, default=0.42), b, param_bytes=2000, p=2,
                            confirm={"default": 0.43, "bucket 1MiB": 0.44})
    assert r["fusion_sweep_default_vs_best"] == pytest.approx(0.42 / 0.40)
    assert r["fusion_default_vs_best"] == pytest.approx(0.43 / 0.44)
    assert r["fusion_confirm"] == {"default": 0.43, "bucket 1MiB": 0.44}
    # the worker times the default in the confirmation rounds only: its step comes from them
    r = wire.summarise_rate(t, b, param_bytes=2000, p=2,
                            confirm={"default": 0.41, "bucket 1MiB": 0.40})
    assert r["step_s"]["default"] == 0.41 and "default" not in t
    assert r["fusion_sweep_default_vs_best"] is None
    assert r["fusion_default_vs_best"] == pytest.approx(0.41 / 0.40)
    # with the confirmation's median steps, the ratio is theirs; the table keeps the best
    r = wire.summarise_rate(t, b, param_bytes=2000, p=2,
                            confirm={"default": 0.41, "bucket 1MiB": 0.36},
                            confirm_median={"default": 0.50, "bucket 1MiB": 0.51})
    assert r["step_s"]["default"] == 0.41
    assert r["fusion_default_vs_best"] == pytest.approx(0.50 / 0.51)
    assert r["fusion_confirm_median"] == {"default": 0.50, "bucket 1MiB": 0.51}


def test_payload_bytes_leaves_out_the_coordination(wire):
    # 250 kB sent in a 50 ms step while the idle coordination sends 400 kB/s: 20 kB of it
    assert wire.payload_bytes(250e3, 400e3, 0.05) == pytest.approx(230e3)
    assert wire.payload_bytes(10e3, 400e3, 0.05) == 0.0
    assert wire.payload_bytes(10e3, 0.0, 0.05) == 10e3


def test_wire_line(wire):
    line = wire.wire_line(0.61234, 1.02, 1.031, 1.5, 0.95, 0.9, True)
    assert line == ("WIRE overlap_hidden=0.612 fusion_default_vs_best=1.020 bytes_vs_ring=1.031 "
                    "fp16_speedup=1.500 oracle_mean=0.950 oracle_worst=0.900 pick=ok")
    assert wire.wire_line(float("nan"), 1, 1, 1, None, 1, False).split()[1] == "overlap_hidden=nan"
    assert wire.wire_line(1, 1, 1, 1, 1, 1, "miss").endswith("pick=miss")


def test_headline_from_results(wire):
    lab = wire.bucket_label
    t = {"after": 0.5, lab(256 * 2**10): 0.45, lab(2**20): 0.40, lab(128 * 2**10): 0.48,
         "compute": 0.3, "comm": 0.2, "fp16": 0.4, "comm fp16": 0.1}
    b = {k: 2040.0 for k in t}
    rate = wire.summarise_rate(t, b, 2000, 2)
    res = {"rates": ["100mbit"], "models": {"m": {"rates": {"100mbit": rate}}},
           "oracle_rows": {"d": {"accuracy": 0.9, "measured_s": 1.0, "plan_s": 0.1},
                           "f": {"accuracy": 1.0, "measured_s": 2.0, "plan_s": 0.2}}}
    line = wire.headline(res)
    assert line.startswith("WIRE overlap_hidden=0.500 fusion_default_vs_best=1.250 "
                           "bytes_vs_ring=1.020 fp16_speedup=1.250 oracle_mean=0.950 "
                           "oracle_worst=0.900 pick=ok")
    # an unshaped link whose comm is as long as its compute does not stand for the overlap
    fast = wire.summarise_rate(dict(t, comm=0.3, after=0.6), b, 2000, 2)
    res["rates"].append("unlimited")
    res["models"]["m"]["rates"]["unlimited"] = fast
    assert wire.headline(res).startswith("WIRE overlap_hidden=0.500 ")
