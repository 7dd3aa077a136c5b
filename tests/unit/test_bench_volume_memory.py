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
