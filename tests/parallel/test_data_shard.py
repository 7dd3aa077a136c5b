"""tfhybrid.data.shard: each rank's rows of every global batch.

Run under ``horovodrun -np 2`` and ``-np 4`` with model_parallel 1, 2, 4:
the local blocks of all ranks, gathered in rank order, must rebuild each
global batch (split "world"), or every model group must see the same rows and
the data groups together the whole batch (split "data", the default).
"""
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfhybrid
from tfhybrid.comm import backend

from conftest import all_model_parallel_values

MPS = all_model_parallel_values()
BATCH = 8


def global_batches(n_batches=3, batch=BATCH):
    x = np.arange(n_batches * batch * 3, dtype=np.float32).reshape(-1, 3)
    y = np.arange(n_batches * batch, dtype=np.int32)
    return x, y


def split_model(split):
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model._tfhybrid_batch_split = split
    return model


def expected_rows(batch, blocks, index):
    local = len(batch) // blocks
    return batch[index * local:(index + 1) * local]


@pytest.mark.parametrize("mp", MPS, ids=lambda m: f"mp{m}")
@pytest.mark.parametrize("split", [None, "data", "world"])
def test_dataset_rows(grid_of, mp, split):
    grid = grid_of(mp)
    x, y = global_batches()
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH)
    model = split_model(split) if split else None
    blocks, index = ((grid.size, grid.rank) if split == "world"
                     else (grid.data_size, grid.data_rank))
    got = list(tfhybrid.data.shard(ds, model))
    assert len(got) == 3
    for b, (xb, yb) in enumerate(got):
        np.testing.assert_array_equal(xb.numpy(), expected_rows(x[b * BATCH:(b + 1) * BATCH],
                                                                blocks, index))
        np.testing.assert_array_equal(yb.numpy(), expected_rows(y[b * BATCH:(b + 1) * BATCH],
                                                                blocks, index))


def test_dict_features_and_sample_weights(grid_of):
    grid = grid_of(1)
    x, y = global_batches(1)
    ds = tf.data.Dataset.from_tensor_slices(({"a": x, "b": y}, y, y * 2.0)).batch(BATCH)
    feats, labels, weights = next(iter(tfhybrid.data.shard(ds)))
    np.testing.assert_array_equal(feats["a"].numpy(), expected_rows(x, grid.size, grid.rank))
    np.testing.assert_array_equal(weights.numpy(), expected_rows(y * 2.0, grid.size, grid.rank))
    assert labels.shape[0] == BATCH // grid.size


def test_indivisible_static_batch_raises(grid_of):
    grid = grid_of(1)
    if grid.size == 1:
        pytest.skip("every batch divides one rank")
    ds = tf.data.Dataset.from_tensor_slices(np.zeros((6 * grid.size + 2, 3))).batch(
        6 * grid.size + 1, drop_remainder=True)
    with pytest.raises(ValueError, match=rf"global batch of {6 * grid.size + 1} rows cannot be "
                                         rf"split evenly over {grid.size} data-parallel ranks"):
        tfhybrid.data.shard(ds)


def test_indivisible_dynamic_batch_raises_at_runtime_with_remainder_error(grid_of):
    grid = grid_of(1)
    if grid.size == 1:
        pytest.skip("every batch divides one rank")
    ds = tf.data.Dataset.from_tensor_slices(np.zeros((grid.size + 1, 3))).batch(grid.size)
    it = iter(tfhybrid.data.shard(ds, remainder="error"))
    next(it)
    with pytest.raises(tf.errors.InvalidArgumentError, match="not divisible"):
        next(it)


def test_uneven_batches_keep_every_row_and_skip_tiny_ones_alike_on_every_rank(grid_of):
    """Default remainder='drop': a batch of r rows gives rank i r // p rows, plus one
    for the first r % p ranks (every row kept); a batch of fewer rows than ranks is
    skipped on every rank, and rank 0 says so."""
    grid = grid_of(1)
    p = grid.size
    if p == 1:
        pytest.skip("every batch divides one rank")
    n = 4 * p + 1 + 3 * p + 1 + (p - 1)      # batches of 4p+1, 3p+1 and p-1 rows
    x = np.arange(n, dtype=np.float32)
    sizes = [4 * p + 1, 3 * p + 1, p - 1]
    starts = np.cumsum([0] + sizes)
    ds = tf.data.Dataset.from_generator(
        lambda: (x[a:b] for a, b in zip(starts[:-1], starts[1:])),
        output_signature=tf.TensorSpec([None], tf.float32))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = [b.numpy() for b in tfhybrid.data.shard(ds)]
    assert len(got) == 2                                     # the batch of p-1 rows is skipped
    said = " ".join(str(w.message) for w in caught)
    if grid.rank == 0:
        assert "dropped" not in said
        assert f"skipped a global batch of {p - 1} rows" in said
    else:
        assert "tfhybrid.data.shard" not in said
    for batch, size, start in zip(got, sizes, starts):
        local, extra = size // p, size % p
        first = start + grid.rank * local + min(grid.rank, extra)
        np.testing.assert_array_equal(batch, x[first:first + local + (grid.rank < extra)])
    backend.barrier()


@pytest.mark.parametrize("mp", MPS, ids=lambda m: f"mp{m}")
def test_numpy_arrays(grid_of, mp):
    grid = grid_of(mp)
    x, y = global_batches(3)
    x, y = x[:-4], y[:-4]                       # last global batch of 4 rows
    if 4 % grid.data_size:
        with pytest.raises(ValueError, match=f"global batch of 4 rows.*over {grid.data_size}"):
            tfhybrid.data.shard((x, y), batch_size=BATCH)
        return
    xl, yl = tfhybrid.data.shard((x, y), batch_size=BATCH)
    want = np.concatenate([expected_rows(y[s:s + BATCH], grid.data_size, grid.data_rank)
                           for s in range(0, len(y), BATCH)])
    np.testing.assert_array_equal(yl, want)
    np.testing.assert_array_equal(xl[:, 0], want * 3)


def test_bad_arguments(grid_of):
    grid = grid_of(1)
    with pytest.raises(TypeError, match="invalid `dataset` of type int"):
        tfhybrid.data.shard(5)
    with pytest.raises(ValueError, match=r"`batch_size`: None; expected the global batch size"):
        tfhybrid.data.shard(np.zeros((8, 2)))
    with pytest.raises(ValueError, match=r"_tfhybrid_batch_split='rows'"):
        tfhybrid.data.shard(tf.data.Dataset.range(4).batch(2), split_model("rows"))
    assert tfhybrid.data.local_batch_size(8 * grid.data_size) == 8
    if grid.size > 1:
        with pytest.raises(ValueError, match=f"global batch of 3 rows.*{grid.data_size}"):
            tfhybrid.data.local_batch_size(3)


# -- the scaling form: single rows + batch_size (+ map_fn, shuffle) -----------------

def _blocks(grid, split):
    return (grid.size, grid.rank) if split == "world" else (grid.data_size, grid.data_rank)


@pytest.mark.parametrize("mp", MPS, ids=lambda m: f"mp{m}")
@pytest.mark.parametrize("split", [None, "world"])
def test_scaling_form_maps_only_own_rows(grid_of, mp, split):
    """Same local batches as the batched form, and map_fn sees only this rank's rows."""
    grid = grid_of(mp)
    batch = 4 * grid.size
    x, y = global_batches(3, batch)
    x, y = x[:-1], y[:-1]                     # a short last global batch: dropped
    model = split_model(split) if split else None
    seen = []

    def record(v):
        seen.append(int(v))
        return v

    def decode(xr, yr):
        return xr * 2.0, tf.py_function(record, [yr], tf.int32)

    rows = tf.data.Dataset.from_tensor_slices((x, y))
    got = list(tfhybrid.data.shard(rows, model, batch_size=batch, map_fn=decode))
    blocks, index = _blocks(grid, split)
    assert len(got) == 2
    for b, (xb, yb) in enumerate(got):
        want = expected_rows(y[b * batch:(b + 1) * batch], blocks, index)
        np.testing.assert_array_equal(yb.numpy(), want)
        np.testing.assert_array_equal(xb.numpy(), expected_rows(
            x[b * batch:(b + 1) * batch], blocks, index) * 2.0)
    assert sorted(seen) == sorted(int(v) for _, yb in got for v in yb.numpy())
    assert len(seen) == 2 * batch // blocks   # rows decoded = global batch / blocks per step
    without = list(tfhybrid.data.shard(rows, model, batch_size=batch))
    for (xa, ya), (xb, yb) in zip(without, got):
        np.testing.assert_array_equal(ya.numpy(), yb.numpy())


def test_scaling_form_file_list(grid_of, tmp_path):
    grid = grid_of(1)
    batch = 2 * grid.size
    files = []
    for i in range(2 * batch):
        path = tmp_path / f"row{i:03d}.txt"
        path.write_text(str(i))
        files.append(str(path))
    read = lambda f: tf.strings.to_number(tf.io.read_file(f), tf.int32)  # noqa: E731
    got = [b.numpy() for b in tfhybrid.data.shard(files, batch_size=batch, map_fn=read)]
    rows = np.arange(2 * batch)
    assert [list(g) for g in got] == [
        list(expected_rows(rows[s:s + batch], grid.size, grid.rank)) for s in (0, batch)]
    with pytest.raises(ValueError, match="file names without `batch_size`"):
        tfhybrid.data.shard(files)


@pytest.mark.parametrize("mp", MPS, ids=lambda m: f"mp{m}")
def test_scaling_form_shuffle_agrees_within_model_groups(grid_of, mp):
    """One broadcast seed: the data groups together see each global batch once,
    the ranks of a model group the same rows, and every epoch is reshuffled."""
    from tfhybrid.comm import backend

    grid = grid_of(mp)
    batch = 2 * grid.data_size
    n = 4 * batch
    rows = tf.data.Dataset.range(n)
    ds = tfhybrid.data.shard(rows, batch_size=batch, shuffle=n)
    epochs = [np.concatenate([b.numpy() for b in ds]) for _ in range(2)]
    assert not np.array_equal(epochs[0], epochs[1])
    mine = np.stack(epochs)[None]
    world = tuple(range(grid.size))
    every = backend.allgather(tf.constant(mine), world, "test.shuffle").numpy()
    local = batch // grid.data_size
    for r in range(grid.size):
        same = [q for q in range(grid.size) if q // grid.model_size == r // grid.model_size]
        for q in same:
            np.testing.assert_array_equal(every[q], every[r])
    for e in range(2):
        whole = []
        for step in range(4):
            for d in range(grid.data_size):
                q = d * grid.model_size
                whole.extend(every[q, e, step * local:(step + 1) * local])
        assert sorted(whole) == list(range(n))


def test_scaling_form_bad_arguments(grid_of):
    grid = grid_of(1)
    rows = tf.data.Dataset.range(8)
    with pytest.raises(ValueError, match=r"`shuffle`: 0"):
        tfhybrid.data.shard(rows, batch_size=grid.size, shuffle=0)
    with pytest.raises(ValueError, match=r"`map_fn`: 3"):
        tfhybrid.data.shard(rows, batch_size=grid.size, map_fn=3)
    with pytest.raises(ValueError, match="map_fn/shuffle without batch_size"):
        tfhybrid.data.shard(rows.batch(grid.size), map_fn=lambda v: v)
    if grid.size > 1:
        with pytest.warns(UserWarning, match="Pass the per-row function as map_fn"):
            tfhybrid.data.shard(rows.map(lambda v: v * 2), batch_size=grid.size)


def _png_rows(n, seed=0):
    images = np.random.default_rng(seed).integers(0, 256, (n, 8, 8, 3), dtype=np.uint8)
    labels = np.random.default_rng(seed + 1).integers(0, 4, n).astype(np.int32)
    encoded = [tf.io.encode_png(im).numpy() for im in images]
    return images.astype(np.float32) / 255.0, labels, encoded


def _decode(png, label):
    return tf.cast(tf.io.decode_png(png, channels=3), tf.float32) / 255.0, label


def _small_cnn():
    keras.utils.set_random_seed(0)
    i = keras.Input((8, 8, 3))
    x = keras.layers.Conv2D(4, 3, padding="same", activation="relu", name="conv")(i)
    x = keras.layers.Flatten(name="flat")(x)
    x = keras.layers.Dense(8, activation="tanh", name="fc")(x)
    return keras.Model(i, keras.layers.Dense(4, activation="softmax", name="out")(x))


def _fit(model, data, transformed=True):
    opt = keras.optimizers.SGD(0.2)
    model.compile(optimizer=tfhybrid.DistributedOptimizer(opt) if transformed else opt,
                  loss="sparse_categorical_crossentropy", jit_compile=False)
    model.fit(data, epochs=1, shuffle=False, verbose=0)
    return (tfhybrid.gather(model) if transformed else model).get_weights()


@pytest.mark.parametrize("strategy,mp", [("d", 1), ("f", "N"), ("df", 2)],
                         ids=["d-mp1", "f-mpN", "df-mp2"])
def test_fit_scaling_form_equals_batched_form_and_single_process(grid_of, strategy, mp):
    from tfhybrid.comm import backend

    mp = backend.launched_size() if mp == "N" else mp
    grid_of(mp)
    batch, steps = 8, 2
    x, y, png = _png_rows(batch * steps + 3)            # 3 rows beyond the last full batch
    initial = _small_cnn().get_weights()
    expected = _fit(_small_cnn(), tf.data.Dataset.from_tensor_slices((x, y)).batch(
        batch, drop_remainder=True), transformed=False)
    options = {"fallback": "replicate"} if strategy != "d" else {}
    scaled = tfhybrid.transform(_small_cnn(), strategy, **options)
    rows = tf.data.Dataset.from_tensor_slices((png, y))
    got = _fit(scaled, tfhybrid.data.shard(rows, model=scaled, batch_size=batch,
                                           map_fn=_decode))
    batched = tfhybrid.transform(_small_cnn(), strategy, **options)
    global_ds = rows.map(_decode).batch(batch, drop_remainder=True)
    old = _fit(batched, tfhybrid.data.shard(global_ds, model=batched))
    assert max(float(np.max(np.abs(e - i))) for e, i in zip(expected, initial)) > 1e-3
    for a, b, e in zip(got, old, expected):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(a, e, rtol=1e-4, atol=1e-6)


def test_per_rank_data_of_different_lengths_is_refused_not_hung(grid_of):
    """Each rank feeding its own data of another length would hang at the epoch's end:
    fit and evaluate refuse it on every rank before the first step."""
    from tfhybrid.guards import ConsistencyError
    grid = grid_of(1)
    if grid.size == 1:
        pytest.skip("one rank")
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2, name="fc")])
    pmodel = tfhybrid.transform(model, strategy="d")
    pmodel.compile(optimizer=tfhybrid.DistributedOptimizer(keras.optimizers.SGD(0.1)),
                   loss="mse")
    n = 16 + 8 * (grid.rank % 2)                        # rank 1: one step more
    x, y = np.zeros((n, 3), np.float32), np.zeros((n, 2), np.float32)
    with pytest.raises(ConsistencyError, match=r"different numbers of steps.*rank 0: 2, rank 1: 3"):
        pmodel.fit(x, y, batch_size=8, verbose=0)
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(8)
    with pytest.raises(ConsistencyError, match=r"'sequential'.evaluate"):
        pmodel.evaluate(ds, verbose=0)
    pmodel.fit(x, y, batch_size=8, steps_per_epoch=2, verbose=0)     # the same steps: runs
    backend.barrier()


def _warned_duplicates(record):
    return [w for w in record if "fed identical rows" in str(w.message)]


@pytest.mark.parametrize("strategy,mp", [("d", 1), ("df", 2), ("gmp", 2)])
def test_whole_arrays_on_every_data_rank_warn_once_and_stay_exact(grid_of, strategy, mp):
    """fit(x, y) on whole arrays under d: every rank computes the whole batch.
    The weights equal single-process training, but the data axis does no work;
    rank 0 warns once (step 2 of the first fit), naming the per-rank way.
    Horovod-style per-rank slices (and f, whose single model group must feed
    the same rows) do not warn."""
    grid = grid_of(mp)
    if grid.data_size == 1 and strategy != "gmp":      # gmp splits rows over every rank
        pytest.skip("one data-parallel rank")
    rng = np.random.RandomState(3)
    x = rng.randn(32, 4).astype(np.float32)
    y = rng.randint(0, 4, 32)

    def make():
        keras.utils.set_random_seed(1)
        return keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="relu",
                                                                        name="fc0"),
                                 keras.layers.Dense(4, name="fc1")])

    def compiled(model):
        model.compile(optimizer=tfhybrid.DistributedOptimizer(keras.optimizers.SGD(0.1)),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return model

    ref = make()
    ref.compile(optimizer=keras.optimizers.SGD(0.1),
                loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    ref.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)

    pmodel = compiled(tfhybrid.transform(make(), strategy=strategy))
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        pmodel.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
        pmodel.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    assert len(_warned_duplicates(record)) == (1 if grid.rank == 0 else 0)
    if grid.rank == 0:
        assert "tfhybrid.data.shard" in str(_warned_duplicates(record)[0].message)
    for a, b in zip(tfhybrid.gather(pmodel).get_weights(), ref.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)

    # each data-parallel rank its own rows (a d model splits the batch over every rank)
    blocks, index = ((grid.size, grid.rank) if strategy in ("d", "gmp")
                     else (grid.data_size, grid.data_rank))
    pmodel = compiled(tfhybrid.transform(make(), strategy=strategy))
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        pmodel.fit(x[index::blocks], y[index::blocks], batch_size=8 // blocks, epochs=1,
                   shuffle=False, verbose=0)
    assert not _warned_duplicates(record)
    backend.barrier()
