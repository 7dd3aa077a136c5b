"""tfhybrid.describe's ``sent_bytes``: the bytes one rank sends per training step,
for every strategy, in one process on a pretend 2-rank grid (transform's
collectives replaced by what one rank of the grid sees; no Horovod).

``comm_bytes`` counts each collective's payload once per rank; ``sent_bytes``
is what a rank's interface carries (less protocol headers), which
bench/wire.py compares with the interfaces' counters: a ring allreduce sends
2(k-1)/k of the tensor, an allgather (k-1) blocks, a halo only the rows a
real neighbour reads.
"""
import importlib.util
from pathlib import Path

import keras
import pytest

import tfhybrid
from tfhybrid.comm import backend
from tfhybrid.compose import transform
from tfhybrid.transformer.describe import _halo_sent, _Where
from tfhybrid.transformer.graph import as_functional, describe_graph
from tfhybrid.transformer import rules
from tests.pretend_grid import pretend

BATCH = 32


def _bench_wire():
    path = Path(__file__).resolve().parents[2] / "bench" / "wire.py"
    spec = importlib.util.spec_from_file_location("bench_wire", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


cnn_head = _bench_wire().make_cnn_head   # the model bench/wire.py measures


@pytest.fixture
def world(monkeypatch):
    """``world(size, rank, mp)``: this process as ``rank`` of a pretend grid, with
    transform's weight broadcast and group registrations as no-ops."""
    monkeypatch.setattr(backend, "broadcast", lambda x, root, ranks, name: x)
    monkeypatch.setattr(backend, "register_groups", lambda groups: None)
    monkeypatch.setattr(tfhybrid.comm, "register_groups", lambda groups: None)
    return pretend


def described(world, strategy, model_parallel, model=cnn_head, size=2, rank=0, **options):
    with world(size, rank, model_parallel):
        pmodel = transform(model(), strategy, **options)
        return tfhybrid.describe(pmodel, batch_size=BATCH, print_fn=None)


def transfers(d):
    """[(layer, phase, op, counted, sent)] of the activation collectives, in order."""
    return [(c[0], c[1], c[2], c[4], c[5]) for c in d.wire if c[1] != "grad"]


# conv1 1792 + conv2 18560 + fc2 10280 bytes of replicated weights: one ring allreduce
# over 2 ranks sends the tensor's bytes
GMP_GRADIENTS = 1792 + 18560 + 10280


@pytest.mark.parametrize("rank", [0, 1])
def test_gmp_sends_one_block_per_allgather(world, rank):
    d = described(world, "gmp", 2, rank=rank, mp=2)
    assert d.comm_bytes == 456_616                 # unchanged: the payload figure
    b, k, features = BATCH // 2, 2, 8 * 8 * 32     # 16 own rows of 2048 features
    assert transfers(d) == [
        # ModuloLayer: the own 16 rows to the other rank (describe counts the 32 gathered)
        ("fc1", "fwd", "allgather", k * b * features * 4, b * features * 4),
        # its backward: reduce-scatter as an alltoall, half of the 32 rows' gradient
        ("fc1", "bwd", "reducescatter", b * features * 4, b * features * 4),
        # fc1's output columns (128 of 256 on 32 rows) to the other rank
        ("fc1", "fwd", "allgather", k * b * 256 * 4, k * b * 128 * 4),
        # ModuloInverseLayer (not in comm_bytes): backward all-gathers the logits' gradient
        ("output0_unmodulo", "bwd", "allgather", 0, b * 10 * 4)]
    assert d.sent_bytes == GMP_GRADIENTS + 131_072 + 131_072 + 16_384 + 640 == 309_800


@pytest.mark.parametrize("rank", [0, 1])
def test_s_sends_halo_rows_to_its_one_neighbour(world, rank):
    d = described(world, "s", 2, rank=rank)
    assert d.comm_bytes == 700_288                 # unchanged: the payload figure
    assert transfers(d) == [
        # one row (of 32 x 3) to the neighbour; none backward (the input gets no gradient)
        ("conv1", "fwd", "halo", 2 * 32 * 3 * BATCH * 4, 1 * 32 * 3 * BATCH * 4),
        ("conv2", "fwd", "halo", 2 * 16 * 16 * BATCH * 4, 1 * 16 * 16 * BATCH * 4),
        ("conv2", "bwd", "halo", 2 * 16 * 16 * BATCH * 4, 1 * 16 * 16 * BATCH * 4),
        # SpatialGather: this rank's half of the 32 x 8x8x32 tensor to the other rank
        ("flatten", "fwd", "allgather", 2 * BATCH * 2048 * 4, BATCH * 1024 * 4)]
    assert d.sent_bytes == 12_288 + 32_768 + 32_768 + 131_072 + 1792 + 18560 == 229_248


@pytest.mark.parametrize("strategy,mp,expected", [("d", 1, 2_128_808), ("f", 2, 1_312_000),
                                                  ("df", 2, 1_312_000)])
def test_d_f_df_send_what_they_count(world, strategy, mp, expected):
    options = {"fallback": "replicate"} if strategy == "f" else {}
    d = described(world, strategy, mp, **options)
    assert d.comm_bytes == d.sent_bytes == expected


def test_s_halo_middle_and_corner_ranks(world):
    """4 ranks in a column: the ends send one row, the middle ranks two; on a 2x2
    grid the neighbour method sends the corners' pieces too."""
    graph = describe_graph(as_functional(cnn_head()))
    conv1 = graph.node("conv1")
    unit = 3 * 4                                          # channels x float32, per row
    col = rules.Context("s", 4, 1, (4, 1))
    assert [_halo_sent(conv1, 1, col, _Where(i, "neighbour")) for i in range(4)] == \
        [(32 * unit, 32 * unit), (64 * unit, 64 * unit), (64 * unit, 64 * unit),
         (32 * unit, 32 * unit)]
    grid = rules.Context("s", 4, 1, (2, 2))
    # 16x16 blocks: 16 rows below, 16 to the side, 1 corner
    assert _halo_sent(conv1, 1, grid, _Where(0, "neighbour")) == (33 * unit, 33 * unit)
    # per axis: the second axis's columns span the first's halo-extended 18 rows
    assert _halo_sent(conv1, 1, grid, _Where(0, "axis")) == (34 * unit, 34 * unit)


def test_sent_bytes_count_what_comm_bytes_leaves_out(world):
    """A SyncBatchNormalization under d (no model group) and a 'same' 3x3 pooling
    under s exchange data that ``collectives`` do not list."""
    def bn_model():
        i = keras.Input((8, 8, 3))
        x = keras.layers.Conv2D(4, 3, padding="same", name="conv")(i)
        x = keras.layers.BatchNormalization(name="bn")(x)
        return keras.Model(i, keras.layers.Dense(2, name="out")(keras.layers.Flatten()(x)))

    d = described(world, "d", 1, model=bn_model)
    # the sums and count (4 + 1 floats) and the squared deviations (4), forward and backward
    assert [c[1:] for c in d.wire if c[0] == "bn"][:2] == [
        ("fwd", "allreduce", "data+model", 0, 9 * 4), ("bwd", "allreduce", "data+model", 0, 9 * 4)]
    assert d.sent_bytes == d.comm_bytes + 2 * 9 * 4

    def pool_model():
        i = keras.Input((16, 16, 3))
        x = keras.layers.Conv2D(4, 3, padding="same", name="conv")(i)
        x = keras.layers.MaxPooling2D(3, strides=1, padding="same", name="pool")(x)
        return keras.Model(i, keras.layers.Dense(2, name="out")(keras.layers.Flatten()(x)))

    d = described(world, "s", 2, model=pool_model)
    row = 16 * 4 * BATCH * 4                               # one row of 16 x 4 channels
    assert [c[1:] for c in d.wire if c[0] == "pool"] == [
        ("fwd", "halo", "model", 0, row), ("bwd", "halo", "model", 0, row)]
    assert "+fwd halo[model] (sends" in d.text and "bytes this rank sends per step" in d.text
