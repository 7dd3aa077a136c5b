"""Functional models that call ``keras.ops`` on tensors.

Scripts scale their input in the model (``inp / 255.0``), add residuals with
``+`` and apply ``keras.ops.relu``; Keras records each as an operation node
of the functional graph, not a layer (``Embedding(mask_zero=True)`` adds one,
``NotEqual``, for its mask). ``tfhybrid.transform`` must not read such a
node as a layer (it has no ``weights``), under any strategy, ``d`` included.
Per-element operations of one tensor and scalars, or of tensors of one
shape, pass any layout (they
run on spatial blocks and between filter/channel pairs); others gather their
inputs first. Each case: fit History and gathered weights equal one process
on the whole data; ``p`` and ``ls`` cut and gather models with operations.
"""
import keras
import numpy as np
import pytest
import tensorflow as tf

import tfhybrid

from conftest import assert_weights_like, compiled_transform, reference_once, rng, world_size

N, BATCH, CLASSES = 32, 8, 4
CASES = ([("d", 1), ("f", 2), ("c", 2), ("s", 2), ("gmp", 2)] if world_size() == 2 else
         [("df", 2), ("ds", 2), ("s", 4), ("f", 4)])


def _data():
    x = (rng("ops-x").uniform(0, 255, (N, 8, 8, 4))).astype(np.float32)
    y = rng("ops-y").integers(0, CLASSES, N)
    return x, y


def _model(per_channel=False):
    keras.utils.set_random_seed(3)
    inp = keras.Input((8, 8, 4))
    h = inp / 255.0
    h = keras.layers.Conv2D(6, 3, padding="same", name="c0")(h)
    h = keras.ops.relu(h) + h * 0.5
    if per_channel:         # a constant per channel: broadcast over a split, so gathered
        h = h * np.linspace(0.5, 1.5, 6).astype(np.float32)
    h = keras.layers.Conv2D(6, 3, padding="same", name="c1")(h)
    h = keras.ops.tanh(h)
    h = keras.layers.Flatten(name="flat")(h)
    h = keras.layers.Dense(16, name="fc")(h)
    h = keras.ops.relu(h) - 0.1
    out = keras.layers.Dense(CLASSES, name="out")(h)
    opt = keras.optimizers.SGD(0.05)
    return keras.Model(inp, out), dict(
        optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))


def _reference(make, x, y, *args):
    """(fit History's losses, weights) of ``make(*args)`` compiled as is and fit in
    one process on the whole data (by rank 0, once per run: conftest.reference_once)."""
    def compute():
        reference, kwargs = make(*args)
        reference.compile(**kwargs)
        want = reference.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
        return want.history["loss"], reference.get_weights()
    return reference_once(compute, make, args, x, y, BATCH)


def _fit_both(reference, model, x, y, blocks, index):
    want, weights = reference
    got = model.fit(x[index::blocks], y[index::blocks], batch_size=BATCH // blocks, epochs=2,
                    shuffle=False, verbose=0)
    np.testing.assert_allclose(got.history["loss"], want, rtol=1e-5)
    assert_weights_like(tfhybrid.gather(model), weights)


@pytest.mark.parametrize("strategy,mp", CASES, ids=lambda c: str(c))
def test_models_with_keras_ops_train_like_one_process(grid_of, strategy, mp):
    grid = grid_of(mp)
    x, y = _data()
    reference = _reference(_model, x, y)
    model = compiled_transform(_model, strategy)
    blocks, index = (grid.size, grid.rank) if strategy in ("d", "gmp") else \
        (grid.data_size, grid.data_rank)
    _fit_both(reference, model, x, y, blocks, index)
    if strategy in ("s", "ds"):     # the element-wise operations run on the blocks
        rows = [(r.name, r.kind) for r in tfhybrid.describe(model, print_fn=None).rows]
        names = [name for name, _ in rows]
        region = rows[names.index("c0"):names.index("flat")]   # c0, relu, *, +, c1, tanh
        assert len(region) == 6 and all(kind.startswith("spatial") for _, kind in region), rows


def test_an_operation_with_a_per_channel_constant_gathers_its_input(grid_of):
    grid = grid_of(world_size())
    x, y = _data()
    reference = _reference(_model, x, y, True)
    model = compiled_transform(_model, "f", True)
    _fit_both(reference, model, x, y, grid.data_size, grid.data_rank)
    model = compiled_transform(_model, "s", True)
    _fit_both(reference, model, x, y, grid.data_size, grid.data_rank)
    rows = {r.name: r.kind for r in tfhybrid.describe(model, print_fn=None).rows}
    assert rows["c0"].startswith("spatial") and not rows["c1"].startswith("spatial"), rows


@pytest.mark.parametrize("strategy", ["p", "ls"])
def test_pipeline_and_layer_separation_cut_models_with_operations(grid_of, strategy):
    grid_of(2 if strategy == "p" else 1)
    x, y = _data()
    want, weights = _reference(_model, x, y)
    model = compiled_transform(_model, strategy)
    local = tfhybrid.data.local_batch_size(BATCH, model)
    xl, yl = tfhybrid.data.shard((x, y), model=model, batch_size=BATCH)
    got = model.fit(xl, yl, batch_size=local, epochs=2, shuffle=False, verbose=0)
    np.testing.assert_allclose(got.history["loss"], want, rtol=1e-5)
    assert_weights_like(tfhybrid.gather(model), weights)


def test_an_embedding_mask_and_a_recurrent_layer_train_like_one_process(grid_of):
    """Embedding(mask_zero=True) adds a NotEqual operation for its mask."""
    grid = grid_of(1)
    tokens = rng("ops-tokens").integers(1, 40, (N, 10))
    tokens[:, 7:] = 0
    y = rng("ops-labels").integers(0, 2, N)

    def make():
        keras.utils.set_random_seed(5)
        inp = keras.Input((10,), dtype="int32")
        h = keras.layers.Embedding(40, 8, mask_zero=True, name="emb")(inp)
        h = keras.layers.GRU(6, name="gru")(h)
        return keras.Model(inp, keras.layers.Dense(2, name="out")(h)), dict(
            optimizer=keras.optimizers.Adam(0.01),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))

    reference = _reference(make, tokens, y)
    model = compiled_transform(make, "d")
    _fit_both(reference, model, tokens, y, grid.size, grid.rank)


def _squeeze_excitation(as_operation):
    keras.utils.set_random_seed(4)
    inp = keras.Input((8, 8, 4))
    h = keras.layers.Conv2D(8, 3, padding="same", activation="relu", name="c0")(inp)
    gate = keras.layers.GlobalAveragePooling2D(keepdims=True, name="gap")(h)
    gate = keras.layers.Conv2D(8, 1, activation="sigmoid", name="gate")(gate)
    h = h * gate if as_operation else keras.layers.Multiply(name="scale")([h, gate])
    h = keras.layers.Conv2D(8, 3, padding="same", activation="relu", name="c1")(h)
    h = keras.layers.GlobalAveragePooling2D(name="gap2")(h)
    out = keras.layers.Dense(CLASSES, name="out")(h)
    return keras.Model(inp, out), dict(
        optimizer=keras.optimizers.SGD(0.05),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))


@pytest.mark.parametrize("as_operation", [False, True], ids=["Multiply", "operation"])
def test_a_squeeze_excitation_gate_trains_like_one_process_under_s(grid_of, as_operation):
    """A (B, 1, 1, C) gate times a spatially split (B, H, W, C) map: the gate must
    not be scattered as if it had the map's shape (its height 1 does not divide
    into blocks); a broadcast joins whole tensors."""
    grid = grid_of(world_size())
    x, y = _data()
    reference = _reference(_squeeze_excitation, x, y, as_operation)
    model = compiled_transform(_squeeze_excitation, "s", as_operation)
    _fit_both(reference, model, x, y, grid.data_size, grid.data_rank)


def _lambda_first():
    keras.utils.set_random_seed(6)
    inp = keras.Input((8, 8, 4))
    h = keras.layers.Lambda(lambda t: t / 127.5 - 1.0, name="norm")(inp)
    h = keras.layers.Conv2D(8, 3, padding="same", activation="relu", name="c0")(h)
    h = keras.layers.Conv2D(8, 3, padding="same", activation="relu", name="c1")(h)
    h = keras.layers.GlobalAveragePooling2D(name="gap")(h)
    return keras.Model(inp, keras.layers.Dense(CLASSES, name="out")(h)), dict(
        optimizer=keras.optimizers.SGD(0.05),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))


def test_a_lambda_before_the_first_convolution_runs_on_the_whole_input(grid_of):
    """s refused the model ('would split no layer spatially: a Lambda has no
    spatial rule'): a layer before the first convolution sees the whole input on
    every rank, so it runs there and the blocks are cut after it."""
    grid = grid_of(world_size())
    x, y = _data()
    reference = _reference(_lambda_first, x, y)
    model = compiled_transform(_lambda_first, "s")
    kinds = {r.name: r.kind for r in tfhybrid.describe(model, print_fn=None).rows}
    assert kinds["norm"] == "replicate" and kinds["c0"] == kinds["c1"] == "spatial", kinds
    _fit_both(reference, model, x, y, grid.data_size, grid.data_rank)


def _ops_unet():
    """A U-Net written with operations: skip joined by keras.ops.concatenate,
    a residual ``+``, a scaled decoder branch; per-voxel softmax output."""
    keras.utils.set_random_seed(8)
    inp = keras.Input((8, 8, 4))
    a = keras.layers.Conv2D(4, 3, padding="same", activation="relu", name="enc")(inp)
    b = keras.layers.MaxPooling2D(name="pool")(a)
    b = keras.layers.Conv2D(4, 3, padding="same", activation="relu", name="mid")(b)
    b = keras.layers.UpSampling2D(name="up")(b)
    h = keras.ops.concatenate([a, b * 0.5], axis=-1)
    h = keras.layers.Conv2D(4, 3, padding="same", activation="relu", name="dec")(h)
    h = h + a
    out = keras.layers.Conv2D(CLASSES, 1, activation="softmax", name="head")(h)
    return keras.Model(inp, out), dict(optimizer=keras.optimizers.SGD(0.05),
                                       loss="sparse_categorical_crossentropy")


@pytest.mark.parametrize("spatial", [None, "width"] if world_size() == 2 else [None, (2, 2)])
def test_a_unet_joined_by_keras_ops_concatenate_stays_on_blocks(grid_of, spatial):
    """keras.ops.concatenate along channels joins the skip of a U-Net block by
    block (like a Concatenate layer), not by gathering both inputs, which
    would run the decoder at full resolution on every rank: no gather, the
    same training as one process."""
    mp = world_size() if spatial == (2, 2) or world_size() == 2 else 2
    grid = grid_of(mp)
    x = (rng("ops-unet-x").standard_normal((N, 8, 8, 4))).astype(np.float32)
    y = rng("ops-unet-y").integers(0, CLASSES, (N, 8, 8, 1))

    def compute():
        reference, kwargs = _ops_unet()
        reference.compile(**kwargs)
        reference.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
        return reference.get_weights()
    want = reference_once(compute, "ops-unet", x, y, BATCH)
    source, kwargs = _ops_unet()
    model = tfhybrid.transform(source, "s" if mp == world_size() else "ds",
                               **({} if spatial is None else {"spatial": spatial}))
    model.compile(optimizer=tfhybrid.DistributedOptimizer(kwargs.pop("optimizer")), **kwargs)
    kinds = {r.name: r.kind for r in tfhybrid.describe(model, print_fn=None).rows}
    assert all(kinds[n].startswith("spatial") for n in ("enc", "dec", "head")), kinds
    assert not [lay.name for lay in model.layers if "Gather" in type(lay).__name__]
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH)
    model.fit(tfhybrid.data.shard(data, model=model), epochs=1, shuffle=False, verbose=0)
    assert_weights_like(tfhybrid.gather(model), want)
    assert grid.model_size == mp
