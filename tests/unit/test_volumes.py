"""tfhybrid.data.volumes in one process on pretend grids: which block each rank
reads, that only that block is read (every slice taken from the source is
recorded), the row split of data.shard, per-sample files, shuffles and bad input."""

import numpy as np
import pytest

import tfhybrid
from tfhybrid import volumes as V
from tests.pretend_grid import pretend

N, D, H, W, C = 8, 8, 4, 6, 2


class Recorder:
    """An array-like that records every index it is read with and the bytes returned."""

    def __init__(self, array):
        self.array, self.keys, self.bytes = array, [], 0
        self.shape, self.dtype = array.shape, array.dtype

    def __getitem__(self, key):
        out = np.asarray(self.array[key])
        self.keys.append(key)
        self.bytes += out.nbytes
        return out


def volumes_x():
    return np.arange(N * D * H * W * C, dtype=np.float32).reshape(N, D, H, W, C)


def voxel_y():
    return (np.arange(N * D * H * W) % 3).astype(np.int32).reshape(N, D, H, W)


def batches(ds):
    return [tuple(t.numpy() for t in b) if isinstance(b, tuple) else b.numpy() for b in ds]


# (world, model_parallel, spatial) -> rank -> (row block, depth/height/width slices)
CASES = [
    (4, 4, "depth", {r: (0, (slice(2 * r, 2 * r + 2), slice(None), slice(None)))
                     for r in range(4)}),
    (4, 4, (2, 2, 1), {r: (0, (slice(4 * (r // 2), 4 * (r // 2) + 4),
                               slice(2 * (r % 2), 2 * (r % 2) + 2), slice(None)))
                       for r in range(4)}),
    (4, 2, "width", {r: (r // 2, (slice(None), slice(None), slice(3 * (r % 2), 3 * (r % 2) + 3)))
                     for r in range(4)}),
    (2, 1, None, {r: (r, (slice(None),) * 3) for r in range(2)}),
]


@pytest.mark.parametrize("size,mp,spatial,expect", CASES,
                         ids=[f"{c[0]}x{c[1]}-{c[2]}" for c in CASES])
def test_each_rank_reads_its_block_only(size, mp, spatial, expect):
    x, batch = volumes_x(), 4
    for rank in range(size):
        src = Recorder(x)
        with pretend(size, rank, mp):
            got = batches(tfhybrid.data.volumes(src, batch_size=batch, spatial=spatial))
        block, region = expect[rank]
        blocks = size // mp
        local = batch // blocks
        rows = [s + block * local + j for s in range(0, N, batch) for j in range(local)]
        want = x[rows][(slice(None),) + region]
        np.testing.assert_array_equal(np.concatenate(got), want)
        # Every read is one sample's block, each sample read once: nothing else touched.
        assert [k[0] for k in src.keys] == rows
        span = [s.indices(n) for s, n in zip(region, (D, H, W))]
        assert all([s.indices(n) for s, n in zip(k[1:4], (D, H, W))] == span
                   for k in src.keys)
        assert src.bytes == want.nbytes == x.nbytes // size


def test_labels_per_voxel_split_or_whole_and_per_sample_rows():
    x, y, t = volumes_x(), voxel_y(), np.arange(N * 4, dtype=np.float32).reshape(N, 4)
    with pretend(2, 1, 2):      # depth split over 2 ranks, one model group
        split = batches(tfhybrid.data.volumes(x, y, batch_size=4, spatial="depth",
                                              split_labels=True))
        whole = batches(tfhybrid.data.volumes(x, Recorder(y), batch_size=4, spatial="depth"))
        rows = batches(tfhybrid.data.volumes(x, t, batch_size=4, spatial="depth"))
    np.testing.assert_array_equal(np.concatenate([b[1] for b in split]), y[:, 4:])
    np.testing.assert_array_equal(np.concatenate([b[1] for b in whole]), y)
    np.testing.assert_array_equal(np.concatenate([b[1] for b in rows]), t)
    np.testing.assert_array_equal(np.concatenate([b[0] for b in rows]), x[:, 4:])


def test_npy_file_is_memory_mapped_and_directory_of_samples(tmp_path):
    x, t = volumes_x(), np.arange(N, dtype=np.float32)
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "t.npy", t)
    (tmp_path / "samples").mkdir()
    for i in range(N):
        np.save(tmp_path / "samples" / f"{i:03d}.npy", x[i])
    src = V.open_source(str(tmp_path / "x.npy"))
    assert isinstance(src, V.NpySource) and src.array is None    # mapped per read only
    block = src.read(3, (slice(2, 4), slice(None)))
    assert not isinstance(block, np.memmap) and block.base is None
    np.testing.assert_array_equal(block, x[3, 2:4])
    with pretend(4, 3, 4):
        one = batches(tfhybrid.data.volumes(str(tmp_path / "x.npy"), str(tmp_path / "t.npy"),
                                            batch_size=2, spatial="depth"))
        many = batches(tfhybrid.data.volumes(tmp_path / "samples", str(tmp_path / "t.npy"),
                                             batch_size=2, spatial="depth"))
        pattern = batches(tfhybrid.data.volumes(str(tmp_path / "samples" / "*.npy"),
                                                batch_size=2, spatial="depth"))
    for got in (one, many):
        np.testing.assert_array_equal(np.concatenate([b[0] for b in got]), x[:, 6:8])
        np.testing.assert_array_equal(np.concatenate([b[1] for b in got]), t)
    np.testing.assert_array_equal(np.concatenate(pattern), x[:, 6:8])
    # A per-sample read returns a copy of the block only (the mapping is released).
    block = V.open_source(tmp_path / "samples").read(0, (slice(6, 8),))
    assert not isinstance(block, np.memmap) and block.base is None and block.shape == (2, H, W, C)


def test_shuffle_one_order_on_every_rank_and_new_each_epoch():
    x = volumes_x()
    firsts = []
    for rank in range(2):
        with pretend(2, rank, 2):
            ids = np.broadcast_to(np.arange(N, dtype=np.float32)[:, None, None, None, None],
                                  x.shape)
            ds = tfhybrid.data.volumes(ids, batch_size=2, spatial="depth", shuffle=True, seed=7)
            epochs = [[int(b[i, 0, 0, 0, 0]) for b in batches(ds) for i in range(2)]
                      for _ in range(2)]
        firsts.append(epochs)
    assert firsts[0] == firsts[1]                      # ranks of a model group agree
    assert sorted(firsts[0][0]) == list(range(N)) and firsts[0][0] != firsts[0][1]


def test_steps_known_and_remainder_dropped():
    with pretend(2, 0, 1):
        ds = tfhybrid.data.volumes(volumes_x()[:7], batch_size=4)
        assert int(ds.cardinality()) == 1
        assert ds.element_spec.shape == (2, D, H, W, C)


@pytest.mark.parametrize("kwargs, match", [
    ({"batch_size": 3}, "multiple of 2"),
    ({"batch_size": 0}, "batch_size"),
    ({"batch_size": 16}, "must not exceed"),
    ({"batch_size": 4, "shuffle": -1}, "shuffle"),
    ({"batch_size": 4, "spatial": (3, 1, 1)}, "spatial"),
])
def test_bad_arguments(kwargs, match):
    with pretend(2, 0, 1), pytest.raises(ValueError, match=match):
        tfhybrid.data.volumes(volumes_x(), **kwargs)


def test_bad_sources(tmp_path):
    with pretend(4, 0, 4):
        with pytest.raises(ValueError, match="height=4 is not divisible by 3"):
            V.VolumeLayout(1, 0, (1, 3, 1), (0, 0, 0), (1, 1, 1)).input_region((8, 4, 6, 2))
        with pytest.raises(ValueError, match="width=6 is not divisible by 4"):
            tfhybrid.data.volumes(volumes_x(), batch_size=2, spatial="width")
        with pytest.raises(ValueError, match="same samples"):
            tfhybrid.data.volumes(volumes_x(), np.zeros(3), batch_size=2)
        with pytest.raises(ValueError, match="directory without .npy"):
            tfhybrid.data.volumes(str(tmp_path), batch_size=2)
        with pytest.raises(ValueError, match="expected an existing .npy"):
            tfhybrid.data.volumes(str(tmp_path / "missing.npy"), batch_size=2)
        with pytest.raises(TypeError, match="array-like"):
            tfhybrid.data.volumes(42, batch_size=2)
        with pytest.raises(ValueError, match="expected \\(D, H, W, C\\) volumes"):
            tfhybrid.data.volumes(np.zeros((4, 3)), batch_size=2)


def test_npy_reads_touch_only_the_block(tmp_path, monkeypatch):
    """Every read of the memory-mapped .npy (one file, or one per sample) slices the
    block out of the map: recorded through a wrapper around np.load's memmap."""
    x = volumes_x()
    np.save(tmp_path / "x.npy", x)
    (tmp_path / "s").mkdir()
    for i in range(N):
        np.save(tmp_path / "s" / f"{i}.npy", x[i])
    maps, load = [], np.load

    def recording_load(path, *args, **kwargs):
        out = load(path, *args, **kwargs)
        if kwargs.get("mmap_mode") == "r":
            out = Recorder(out)
            maps.append(out)
        return out

    monkeypatch.setattr(V.np, "load", recording_load)
    for source in (str(tmp_path / "x.npy"), str(tmp_path / "s")):
        maps.clear()
        with pretend(4, 1, 4):
            got = np.concatenate(batches(tfhybrid.data.volumes(source, batch_size=4,
                                                               spatial="depth")))
        np.testing.assert_array_equal(got, x[:, 2:4])
        touched = sum(m.bytes for m in maps)
        assert touched == got.nbytes == x.nbytes // 4, (source, touched)


def test_h5py_dataset_is_read_by_slices_only(tmp_path):
    h5py = pytest.importorskip("h5py")
    x, y = volumes_x(), voxel_y()
    with h5py.File(tmp_path / "v.h5", "w") as f:
        f["x"], f["y"] = x, y
    with h5py.File(tmp_path / "v.h5", "r") as f, pretend(2, 0, 2):
        got = batches(tfhybrid.data.volumes(f["x"], f["y"], batch_size=4, spatial=(1, 2, 1),
                                            split_labels=True))
    np.testing.assert_array_equal(np.concatenate([b[0] for b in got]), x[:, :, :2])
    np.testing.assert_array_equal(np.concatenate([b[1] for b in got]), y[:, :, :2])


def test_label_blocks_follow_the_output_grid_not_the_input():
    """Labels split by the output's grid use this rank's coordinate in that grid,
    even when the input is read whole."""
    with pretend(2, 1, 2):
        layout = V.plan(spatial=None, ndim=3, label_shape=(D, H, W), split_labels=False)
        assert layout.label_region((D, H, W)) == (slice(0, D), slice(0, H), slice(0, W))
        split = V.VolumeLayout(1, 0, (1, 1, 1), (0, 0, 0), (2, 1, 1), (1, 0, 0))
        assert split.input_region((D, H, W, C))[0] == slice(0, D)
        assert split.label_region((D, H, W))[0] == slice(D // 2, D)
