"""Under a per-process memory limit that single-process training of the
bench's volume exceeds, ``s`` at 4 ranks (each reading only its depth block
with ``tfhybrid.data.volumes``) trains within it.

The volume and model are ``bench/volume_memory.py``'s: a 3-D U-Net (depth
2, 8 filters, BatchNormalization) on 96^3 x 1 volumes, global batch 3. The
limit is ``RLIMIT_DATA`` (private writable memory: what malloc and
TensorFlow's CPU allocator map); ``RLIMIT_AS`` is not usable, TensorFlow and
Horovod reserve address space they never touch. The limit of 2300 MB lies
about 500 MB from both VmData peaks (one process about 2.8 GB, each of 4
ranks under s about 1.8 GB; ``bench/volume_memory.py`` prints them): the
single process builds its model and pipeline within it and dies in its
training step (an allocation fails: an abort), while the 4 ranks finish
their step. Runs the bench's own workers.
"""
import os
import shutil
import sys
import tempfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "bench"))

import volume_memory  # noqa: E402

LIMIT_MB = 2300
ARGS = ["--model", "unet", "--size", "96", "--channels", "1", "--filters", "8", "--batch", "3",
        "--samples", "3", "--steps", "1", "--limit_mb", str(LIMIT_MB)]


@pytest.mark.skipif(not os.path.exists(volume_memory.HOROVODRUN), reason="needs horovodrun")
def test_s_at_4_ranks_trains_within_a_limit_single_process_exceeds():
    data = tempfile.mkdtemp(prefix="volume_limit_")
    try:
        args = volume_memory._args(ARGS + ["--data_dir", data])
        volume_memory.write_data(args, data)
        single_proc, single = volume_memory.run(args, 1, tempfile.mkdtemp(dir=data), timeout=600)
        spatial_proc, spatial = volume_memory.run(args, 4, tempfile.mkdtemp(dir=data),
                                                  timeout=900)
    finally:
        shutil.rmtree(data, ignore_errors=True)
    # one process: set up within the limit, then training exceeds it (an error or an
    # abort: the allocation that fails may be a kernel's buffer or a thread's stack)
    assert single_proc.returncode != 0, single_proc.stdout[-1500:]
    assert len(single) == 1 and not single[0]["ok"], single
    assert single[0]["vm_data_before_fit_mb"] < LIMIT_MB, single
    # s at 4 ranks: every rank finished its step under the same limit
    assert spatial_proc.returncode == 0, spatial_proc.stderr[-3000:]
    assert sorted(r["rank"] for r in spatial) == [0, 1, 2, 3]
    assert all(r["ok"] and r["limit_mb"] == LIMIT_MB for r in spatial), spatial
    assert all(tuple(r["block"]) == (3, 24, 96, 96, 1) for r in spatial), spatial
    worst = max(r["vm_data_peak_mb"] for r in spatial)
    why = single[0].get("error") or f"exit {single_proc.returncode} during fit, VmData " \
        f"{single[0]['vm_data_before_fit_mb']:.0f} MB before it"
    print(f"\nlimit {LIMIT_MB} MB: one process failed ({why[:100]}); s x4 trained, VmData "
          f"peaks up to {worst:.0f} MB, resident peaks "
          f"{max(r['peak_mb'] for r in spatial):.0f} MB")
