"""Under a per-process memory limit that single-process training of the
bench's volume exceeds, ``s`` at 4 ranks (each reading only its depth block
with ``tfhybrid.data.volumes``) trains within it.

The volume and model are ``bench/volume_memory.py``'s: a 3-D U-Net (depth
2, 8 filters, BatchNormalization) on 96^3 x 1 volumes, global batch 3. The
limit is ``RLIMIT_DATA`` (private writable memory: what malloc and
TensorFlow's CPU allocator map); ``RLIMIT_AS`` is not usable, TensorFlow and
Horovod reserve address space they never touch.

Where the limit lies is measured, not fixed: the peaks depend on the CPU
(oneDNN picks its convolution kernels and their scratch buffers by the
instruction set) and on the allocator. Both runs go first without a limit
(on a 2-core AVX2 machine: one process about 2.8 GB of VmData, each of 4
ranks under s about 1.8 GB); the limit is then set half-way between the
single process's peak and the worst rank's, and both run again under it.
The single process builds its model and pipeline within the limit and dies
in its training step (an allocation fails: an error or an abort), while the
4 ranks finish their step. The test fails if ``s`` does not lower the
per-rank peak by at least ``MIN_GAP_MB``. Runs the bench's own workers.
"""
import os
import shutil
import sys
import tempfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "bench"))

import volume_memory  # noqa: E402

MIN_GAP_MB = 400
ARGS = ["--model", "unet", "--size", "96", "--channels", "1", "--filters", "8", "--batch", "3",
        "--samples", "3", "--steps", "1"]


def _args(data, limit_mb):
    return volume_memory._args(ARGS + ["--data_dir", data, "--limit_mb", str(limit_mb)])


def _runs(data, limit_mb):
    """One process, then s at 4 ranks, each rank under ``limit_mb`` (0: no limit)."""
    args = _args(data, limit_mb)
    single = volume_memory.run(args, 1, tempfile.mkdtemp(dir=data), timeout=600)
    spatial = volume_memory.run(args, 4, tempfile.mkdtemp(dir=data), timeout=900)
    return single, spatial


@pytest.mark.skipif(not os.path.exists(volume_memory.HOROVODRUN), reason="needs horovodrun")
def test_s_at_4_ranks_trains_within_a_limit_single_process_exceeds():
    data = tempfile.mkdtemp(prefix="volume_limit_")
    try:
        volume_memory.write_data(_args(data, 0), data)
        (free_proc, free), (free4_proc, free4) = _runs(data, 0)
        assert free_proc.returncode == 0 and free[0]["ok"], free_proc.stderr[-3000:]
        assert free4_proc.returncode == 0 and len(free4) == 4, free4_proc.stderr[-3000:]
        one = free[0]["vm_data_peak_mb"]
        worst_free = max(r["vm_data_peak_mb"] for r in free4)
        assert one - worst_free >= MIN_GAP_MB, (
            f"s at 4 ranks peaks at {worst_free:.0f} MB of VmData per rank, one process at "
            f"{one:.0f} MB: less than {MIN_GAP_MB} MB apart")
        limit = int((one + worst_free) / 2)
        (single_proc, single), (spatial_proc, spatial) = _runs(data, limit)
    finally:
        shutil.rmtree(data, ignore_errors=True)
    # one process: set up within the limit, then training exceeds it
    assert single_proc.returncode != 0, (limit, one, worst_free, single_proc.stdout[-1500:])
    assert len(single) == 1 and not single[0]["ok"], single
    assert single[0]["vm_data_before_fit_mb"] < limit, single
    # s at 4 ranks: every rank finished its step under the same limit
    assert spatial_proc.returncode == 0, spatial_proc.stderr[-3000:]
    assert sorted(r["rank"] for r in spatial) == [0, 1, 2, 3]
    assert all(r["ok"] and r["limit_mb"] == limit for r in spatial), spatial
    assert all(tuple(r["block"]) == (3, 24, 96, 96, 1) for r in spatial), spatial
    worst = max(r["vm_data_peak_mb"] for r in spatial)
    why = single[0].get("error") or f"exit {single_proc.returncode} during fit, VmData " \
        f"{single[0]['vm_data_before_fit_mb']:.0f} MB before it"
    print(f"\nunlimited VmData peaks: one process {one:.0f} MB, s x4 up to {worst_free:.0f} MB; "
          f"limit {limit} MB: one process failed ({why[:100]}); s x4 trained, VmData peaks up "
          f"to {worst:.0f} MB, resident peaks {max(r['peak_mb'] for r in spatial):.0f} MB")
