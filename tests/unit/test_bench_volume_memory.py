"""bench/volume_memory.py's table (pure Python): the tensor-memory lines of --tensors."""
import importlib.util
import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _bench():
    spec = importlib.util.spec_from_file_location(
        "volume_memory", os.path.join(ROOT, "bench", "volume_memory.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _row(p, rank, peak, tensors=None):
    row = {"p": p, "rank": rank, "block": [1, 8 // p, 8, 8, 1], "peak_mb": 600.0,
           "growth_mb": 100.0 / p, "param_mb": 0.5, "describe_param_mb": 0.5,
           "oracle_mb": 10.0, "ok": True}
    if tensors is not None:
        row["tensor_peak_mb"] = tensors
    return row


def test_tensor_ratio_divides_the_worst_rank_by_single_over_p_plus_params():
    rows = {1: [_row(1, 0, 600, 100.0)], 4: [_row(4, r, 600, t) for r, t in
                                              enumerate((30.0, 41.0, 40.0, 31.0))]}
    text = _bench().summary(rows, fusion=1)
    assert "p=1: 100.0 MB, ideal 100.5 MB, ratio 1.00" in text
    # worst rank 41 MB against 100 / 4 + 0.5
    assert "p=4: 41.0 MB, ideal 25.5 MB, ratio 1.61" in text


def test_no_tensor_lines_without_the_option():
    rows = {1: [_row(1, 0, 600)], 2: [_row(2, 0, 600), _row(2, 1, 600)]}
    assert "tensor memory" not in _bench().summary(rows)


def _xplane(path, events):
    """A profiler trace of allocator events: (time_ns, kind, addr, requested)."""
    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    space = xplane_pb2.XSpace()
    plane = space.planes.add(name="/host:CPU")
    plane.event_metadata[1].name = "MemoryAllocation"
    plane.event_metadata[2].name = "MemoryDeallocation"
    plane.event_metadata[3].name = "SomethingElse"
    plane.stat_metadata[1].name = "addr"
    plane.stat_metadata[2].name = "requested_bytes"
    lines = [plane.lines.add(name="thread a", timestamp_ns=0),
             plane.lines.add(name="thread b", timestamp_ns=5)]     # interleaved in time
    for i, (t, kind, addr, size) in enumerate(events):
        line = lines[i % 2]
        ev = line.events.add(metadata_id={"alloc": 1, "free": 2, "other": 3}[kind],
                             offset_ps=(t - line.timestamp_ns) * 1000)
        ev.stats.add(metadata_id=1, uint64_value=addr)
        ev.stats.add(metadata_id=2, int64_value=size)
    with open(path, "wb") as f:
        f.write(space.SerializeToString())


def test_requested_peak_sums_live_allocations_in_time_order(tmp_path):
    """Allocations count from their allocation to their deallocation, in time
    order across threads; a freed address allocated before the trace and
    events of other kinds do not count; a reused address counts once."""
    path = str(tmp_path / "t.xplane.pb")
    _xplane(path, [(10, "alloc", 1, 100), (20, "alloc", 2, 50), (30, "free", 9, 1000),
                   (40, "free", 1, 0), (50, "alloc", 3, 120), (60, "other", 4, 10 ** 6),
                   (70, "alloc", 2, 70), (80, "free", 3, 0)])
    # live: 100 -> 150 -> 150 -> 50 -> 170 (peak) -> 170 -> 190 (addr 2 again: 70) -> 70
    assert _bench().requested_peak(path) == 190


def test_traced_lines_divide_the_worst_rank_by_single_over_p():
    rows = {1: [_row(1, 0, 600, 100.0)], 2: [_row(2, r, 600, 55.0) for r in range(2)]}
    rows[1][0]["step_requested_peak_mb"] = 90.0
    for r, v in zip(rows[2], (44.0, 49.5)):
        r["step_requested_peak_mb"] = v
    text = _bench().summary(rows, fusion=1)
    assert "p=1: 90.0 MB, ideal 90.0 MB, ratio 1.00" in text
    assert "p=2: 49.5 MB, ideal 45.0 MB, ratio 1.10" in text
