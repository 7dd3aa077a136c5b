"""tfhybrid.guards in one process: checksums, the compile hook, Config fields."""
import keras
import numpy as np
import pytest
import tensorflow as tf

import tfhybrid
from tfhybrid import guards


def _model(name="fc"):
    inputs = keras.Input((3,), name="x")
    return keras.Model(inputs, keras.layers.Dense(2, name=name)(inputs), name="m")


def test_batch_checksum_sees_row_order_and_values():
    x = tf.constant(np.arange(12, dtype=np.float32).reshape(4, 3))
    y = tf.constant([0, 1, 2, 3])
    base = float(guards.batch_checksum((x, y)))
    assert float(guards.batch_checksum((tf.reverse(x, [0]), y))) != base
    assert float(guards.batch_checksum((x + 1e-3, y))) != base
    assert float(guards.batch_checksum((x, y))) == base


def _numpy_checksum(arrays, position=0):
    total = 0.0
    for a in arrays:
        rows = np.asarray(a, np.float64).reshape(len(a), -1)
        cols = 1.0 + (np.arange(rows.shape[1]) % 7) / 7.0
        row_w = 1.0 + np.arange(len(rows)) + position * len(rows)
        total += float(((rows @ cols) * row_w).sum())
    return total


@pytest.mark.parametrize("shape", [(4, 3), (3, 5, 6, 2), (2, 16, 16, 16, 1), (5, 1),
                                   (2, 20, 20, 20, 1), (3, 4097)])
def test_batch_checksum_is_the_weighted_float64_sum(shape):
    """Column j weighs 1 + (j % 7) / 7, row i 1 + i (+ position x rows): the
    matrix-vector product of short rows and the seven strided float64 slice
    sums of long ones equal numpy's weighted sum, eager and traced, for
    float, integer and bool inputs."""
    rng = np.random.default_rng(1)
    x = rng.standard_normal(shape).astype(np.float32)
    y = rng.integers(0, 5, shape[:1] + (3,)).astype(np.int32)
    mask = rng.random(shape[:2]) > 0.5
    want = _numpy_checksum([x, y, mask])
    for fn in (guards.batch_checksum, tf.function(guards.batch_checksum)):
        got = float(fn((tf.constant(x), tf.constant(y), tf.constant(mask))))
        assert got == pytest.approx(want, rel=1e-12)
    got = float(tf.function(guards.batch_checksum)((tf.constant(x),), tf.constant(2)))
    assert got == pytest.approx(_numpy_checksum([x], position=2), rel=1e-12)


def test_batch_checksum_sees_columns_and_blocks_sum_to_the_batch():
    """Two columns of other weights swapped change it; a batch's blocks, each
    checksummed at its position, sum to the whole batch's (p/ls compare so)."""
    x = np.arange(2 * 9, dtype=np.float32).reshape(2, 9)
    swapped = x[:, [1, 0] + list(range(2, 9))]
    assert float(guards.batch_checksum((tf.constant(swapped),))) != float(
        guards.batch_checksum((tf.constant(x),)))
    big = np.random.default_rng(2).standard_normal((6, 4, 5)).astype(np.float32)
    blocks = sum(float(guards.batch_checksum((tf.constant(big[2 * i:2 * i + 2]),),
                                             tf.constant(i))) for i in range(3))
    assert blocks == pytest.approx(float(guards.batch_checksum((tf.constant(big),))),
                                   rel=1e-12)


def test_batch_checksum_keeps_no_batch_sized_constant():
    """The column weights are not a row-long vector: in a traced step Grappler
    folded that into a constant held for the step's lifetime (0.84 MB for a
    48^3 volume, up to its 10 MB limit; past it, a float64 copy each step)."""
    x = tf.zeros((2, 24, 24, 24, 1))
    graph = tf.function(guards.batch_checksum).get_concrete_function((x,)).graph
    big = [op.name for op in graph.get_operations() if op.type in ("Range", "Const")
           and any(o.shape.num_elements() and o.shape.num_elements() > 64 for o in op.outputs)]
    assert not big, big


def test_structure_digest_changes_with_layer_names():
    assert guards.structure_digest(_model("a")) != guards.structure_digest(_model("b"))
    assert guards.structure_digest(_model("a")) == guards.structure_digest(_model("a"))


def test_weight_checksums_follow_values():
    m = _model()
    before = guards.weight_checksums(m.trainable_variables)
    m.trainable_variables[1].assign(m.trainable_variables[1] + 1.0)
    after = guards.weight_checksums(m.trainable_variables)
    assert before[0] == after[0] and before[1] != after[1]


@pytest.mark.parametrize("shape", [(3, 2), (97,), (200, 3), (5, 5, 4, 8), (1,)])
def test_traced_weight_checksums_equal_the_numpy_ones(shape):
    """The in-step checksums (rows of 97 times the position weights, plus the
    tail) are the numpy ones: same weights per position, float64 sums."""
    rng = np.random.default_rng(0)
    variables = [tf.Variable(rng.standard_normal(shape).astype(np.float32)),
                 tf.Variable(rng.standard_normal(7).astype(np.float32))]
    traced = tf.function(guards.weight_checksums_in_step)(variables).numpy()
    np.testing.assert_allclose(traced, guards.weight_checksums(variables), rtol=1e-12)
    variables[0].assign(tf.reverse(variables[0], [0]) if shape[0] > 1 else variables[0] + 1)
    assert tf.function(guards.weight_checksums_in_step)(variables).numpy()[0] != traced[0]


def test_guard_callback_asks_for_weight_gathers_on_checked_steps_only():
    """The traced step gathers the weight checksums at step 2 and every
    ``every`` steps; the step-sums variable is marked unwritten (NaN) before
    each, so a step that did not gather is told apart (then the eager check)."""
    model = tfhybrid.transform(_model(), "d")
    weights_due = tf.Variable(False)
    sums = guards.step_sums_variable(model)
    assert tuple(sums.shape) == (1, 1 + len(model.trainable_variables))
    cb = guards.GuardCallback(model._tfhybrid_batch_checksum, 4,
                              model._tfhybrid_batch_checksum_due, weights_due)
    cb.set_model(model)
    cb.on_train_begin()
    seen = [bool(weights_due.numpy())]      # before step 1
    for step in range(1, 9):
        sums.assign(np.zeros(sums.shape))   # as a gathering step writes it
        if step in (2, 4, 8):
            assert cb._gathered() is not None
        cb.on_train_batch_end(step - 1)
        seen.append(bool(weights_due.numpy()))
        if seen[-1]:
            assert np.isnan(sums.numpy()).all() and cb._gathered() is None
    assert seen == [False, True, False, True, False, False, False, True, False]
    cb.on_train_end()
    assert not bool(weights_due.numpy())     # no gather in a step outside fit
    assert guards.step_sums_variable(model) is sums     # same variables: kept


def test_transformed_model_is_guarded_and_trains_alone():
    model = tfhybrid.transform(_model(), "d")
    assert model._tfhybrid_guarded
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")   # one process: not wrapped
    x = np.ones((4, 3), np.float32)
    model.fit(x, np.zeros((4, 2), np.float32), batch_size=4, verbose=0)
    # one process: no model group to compare, so the step skips the checksum's work
    assert float(model._tfhybrid_batch_checksum.numpy()) == 0.0


def test_a_fit_that_raises_in_validation_keeps_no_iterator():
    """Keras caches fit's validation iterator on the model and deletes it after
    the last epoch; a fit that raised kept it (and its tf.data threads) until
    a garbage collection took the model."""
    class Stop(keras.callbacks.Callback):
        def on_test_batch_end(self, batch, logs=None):
            raise RuntimeError("stop in validation")

    model = tfhybrid.transform(_model(), "d")
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    x, y = np.ones((8, 3), np.float32), np.zeros((8, 2), np.float32)
    with pytest.raises(RuntimeError, match="stop in validation"):
        model.fit(x, y, batch_size=4, verbose=0, validation_data=(x, y), callbacks=[Stop()])
    assert getattr(model, "_eval_epoch_iterator", None) is None
    plain = _model()            # Keras alone keeps it: the check above can fail
    plain.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    with pytest.raises(RuntimeError, match="stop in validation"):
        plain.fit(x, y, batch_size=4, verbose=0, validation_data=(x, y), callbacks=[Stop()])
    assert getattr(plain, "_eval_epoch_iterator", None) is not None
    assert model.fit(x, y, batch_size=4, verbose=0, validation_data=(x, y)).history["val_loss"]


def test_guard_callback_asks_for_batch_checksums_only_on_guarded_steps():
    model = tfhybrid.transform(_model(), "d")
    due = model._tfhybrid_batch_checksum_due
    cb = guards.GuardCallback(model._tfhybrid_batch_checksum, 4, due)
    cb.set_model(model)
    due.assign(False)
    cb.on_train_begin()
    seen = [bool(due.numpy())]              # before step 1
    for batch in range(9):
        cb.on_train_batch_end(batch)
        seen.append(bool(due.numpy()))      # before step batch + 2
    # steps 1, 2 (the first steps), 4 and 8 (every 4): the others skip the checksum
    assert seen == [True, True, False, True, False, False, False, True, False, False]
    cb.on_train_end()
    assert bool(due.numpy())                # train_step outside fit: checksum again


@pytest.mark.parametrize("kwargs, phrase", [
    ({"guards": 1}, "guards"),
    ({"guard_every_steps": -1}, "guard_every_steps"),
    ({"guard_every_steps": 2.5}, "guard_every_steps"),
    ({"average_metrics": "yes"}, "average_metrics"),
])
def test_config_refuses_bad_guard_values(kwargs, phrase):
    with pytest.raises(ValueError, match=phrase):
        tfhybrid.Config(**kwargs)


def test_summary_says_counts_are_per_rank():
    model = tfhybrid.transform(_model(), "d")
    lines = []
    model.summary(print_fn=lines.append)
    assert "Total params" in "".join(lines[:-1])
    assert lines[-1].startswith("tfhybrid: the parameter counts above are global rank 0's")
    assert "strategy 'd'" in lines[-1] and "8 parameters" in lines[-1]


def test_evaluate_alone_is_plain_keras():
    model = tfhybrid.transform(_model(), "d")
    model.compile(loss="mse", metrics=["mae"])
    x = np.ones((6, 3), np.float32)
    got = model.evaluate(x, np.zeros((6, 2), np.float32), batch_size=4, verbose=0,
                         return_dict=True)
    ref = _model()
    ref.set_weights(model.get_weights())
    ref.compile(loss="mse", metrics=["mae"])
    want = ref.evaluate(x, np.zeros((6, 2), np.float32), batch_size=4, verbose=0,
                        return_dict=True)
    assert got == pytest.approx(want)


def test_transformed_fit_runs_the_lean_train_function_bit_identically():
    """One tf.function per batch (no Optional round trip): the same weights and
    losses as plain Keras' fit, also on data of unknown length; Keras' own
    function with steps_per_execution > 1."""
    tfhybrid.init()
    x = np.random.default_rng(0).standard_normal((40, 3)).astype(np.float32)
    y = np.random.default_rng(1).standard_normal((40, 2)).astype(np.float32)
    unknown = tf.data.Dataset.from_tensor_slices((x, y)).filter(lambda a, b: True).batch(8)

    def trained(transform, data, **fit):
        keras.utils.set_random_seed(0)
        model = tfhybrid.transform(_model(), "d") if transform else _model()
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
        history = model.fit(data, epochs=2, verbose=0, shuffle=False, **fit)
        return model, history.history["loss"]

    for data, fit in (((x, y), {"batch_size": 8}), (unknown, {})):
        data, extra = ((data, fit) if isinstance(data, tf.data.Dataset)
                       else (data[0], {"y": data[1], **fit}))
        ours, loss = trained(True, data, **extra)
        plain, plain_loss = trained(False, data, **extra)
        assert ours.train_function.__qualname__.startswith("lean_train_function")
        assert loss == plain_loss
        for a, b in zip(ours.get_weights(), plain.get_weights()):
            np.testing.assert_array_equal(a, b)
    model = tfhybrid.transform(_model(), "d")
    model.compile(optimizer="sgd", loss="mse", steps_per_execution=2)
    model.fit(x, y, batch_size=8, verbose=0)
    assert not model.train_function.__qualname__.startswith("lean_train_function")


def test_lean_train_function_follows_each_new_iterator():
    """The lean function calls the concrete function of the epoch's iterator: a
    later fit on batches of another size (a partial last batch, labels of another
    dtype) looks the step up again; every epoch's new iterator too. Weights stay
    bit-identical to plain Keras' fits in the same order."""
    tfhybrid.init()
    rng = np.random.default_rng(2)
    x = rng.standard_normal((23, 3)).astype(np.float32)
    y = rng.standard_normal((23, 2)).astype(np.float32)
    runs = [tf.data.Dataset.from_tensor_slices((x, y)).batch(8),
            tf.data.Dataset.from_tensor_slices((x[:13], y[:13].astype(np.float64))).batch(5),
            tf.data.Dataset.from_tensor_slices((x, y)).batch(8)]

    def trained(transform):
        keras.utils.set_random_seed(0)
        model = tfhybrid.transform(_model(), "d") if transform else _model()
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
        losses = [model.fit(d, epochs=2, verbose=0).history["loss"] for d in runs]
        return model, losses

    ours, losses = trained(True)
    plain, plain_losses = trained(False)
    assert ours.train_function.__qualname__.startswith("lean_train_function")
    assert losses == plain_losses
    for a, b in zip(ours.get_weights(), plain.get_weights()):
        np.testing.assert_array_equal(a, b)


def test_lean_train_function_initialises_state_made_from_the_batch():
    """A metric whose state is created at its first update from a value (made
    inside the step, after the batch is read: not liftable out of the step),
    on a pipeline whose map counts records in a tf.Variable: fit trains as
    plain Keras does (no UnliftableError), the same numbers, every row read
    once per epoch."""
    tfhybrid.init()
    rng = np.random.default_rng(3)
    x = rng.standard_normal((24, 3)).astype(np.float32)
    y = rng.standard_normal((24, 2)).astype(np.float32)

    class Lazy(keras.metrics.Metric):
        def __init__(self):
            super().__init__(name="lazy")
            self.state = None

        def update_state(self, y_true, y_pred, sample_weight=None):
            if self.state is None:
                self.state = keras.Variable(np.zeros(2, np.float32), trainable=False)
            self.state.assign_add(tf.stack([tf.reduce_sum(y_pred),
                                            tf.cast(tf.shape(y_pred)[0], tf.float32)]))

        def result(self):
            return self.state[0] / self.state[1] if self.state is not None else 0.0

        def reset_state(self):
            if self.state is not None:
                self.state.assign(tf.zeros(2))

    def trained(transform):
        keras.utils.set_random_seed(0)
        counter = tf.Variable(0, dtype=tf.int64)

        def count(a, b):
            counter.assign_add(1)
            return a, b

        data = tf.data.Dataset.from_tensor_slices((x, y)).map(count).batch(8)
        model = tfhybrid.transform(_model(), "d") if transform else _model()
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", metrics=[Lazy()])
        history = model.fit(data, epochs=2, verbose=0).history
        return model, history, int(counter.numpy())

    ours, history, count = trained(True)
    plain, plain_history, plain_count = trained(False)
    assert ours.train_function.__qualname__.startswith("lean_train_function")
    assert history == plain_history and count == plain_count == 48
    for a, b in zip(ours.get_weights(), plain.get_weights()):
        np.testing.assert_array_equal(a, b)


def test_lean_train_function_calls_the_concrete_function_flat():
    """The epoch's step runs through the concrete function's flat entry point
    (the iterator's resource handle, no per-call signature binding): the same
    batches, in order, as the structured call, and the flat path is the one
    taken (counted)."""
    from tfhybrid.guards import _flat_caller

    data = tf.data.Dataset.range(6).map(lambda i: tf.fill([2], tf.cast(i, tf.float32)))

    @tf.function
    def step(iterator):
        return {"sum": tf.reduce_sum(iterator.get_next())}

    flat_it, plain_it = iter(data), iter(data)
    concrete = step.get_concrete_function(flat_it)
    calls = []
    original = concrete._call_flat
    concrete._call_flat = lambda *a: calls.append(1) or original(*a)
    run = _flat_caller(concrete, flat_it)
    got = [float(run()["sum"]) for _ in range(6)]
    concrete._call_flat = original
    want = [float(concrete(plain_it)["sum"]) for _ in range(6)]
    assert got == want == [0.0, 2.0, 4.0, 6.0, 8.0, 10.0]
    assert len(calls) == 6
    with pytest.raises(tf.errors.OutOfRangeError):
        run()


def test_fit_on_a_dataset_does_not_warn_about_shuffle():
    """Keras warns that shuffle=True (fit's default) is ignored for a tf.data.Dataset;
    a transformed model's fit passes shuffle=False unless the script set it."""
    import warnings

    model = tfhybrid.transform(_model(), "d")
    model.compile(optimizer=tfhybrid.DistributedOptimizer(keras.optimizers.SGD(0.1)), loss="mse")
    data = tf.data.Dataset.from_tensor_slices((np.ones((4, 3), "float32"),
                                               np.ones((4, 2), "float32"))).batch(2)

    def shuffle_warnings(**kwargs):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model.fit(data, epochs=1, verbose=0, **kwargs)
        return [w for w in caught if "shuffle" in str(w.message)]

    assert shuffle_warnings() == []
    assert shuffle_warnings(shuffle=True)        # the script's own choice: Keras' warning stays


def test_input_fingerprint_sees_every_row_of_arrays_up_to_32_mib():
    """It sampled 64 rows: per-rank arrays differing only elsewhere were taken as
    copies of one another (and evaluate had no later check)."""
    from tfhybrid.guards import FINGERPRINT_WHOLE_BYTES, input_fingerprint

    a = np.arange(4000 * 8, dtype=np.float32).reshape(4000, 8)
    b = a.copy()
    b[7, 3] += 1                      # row 7: not among 64 evenly spaced rows of 4000
    assert input_fingerprint(a) != input_fingerprint(b)
    assert input_fingerprint(a) == input_fingerprint(a.copy())
    assert input_fingerprint(a, None) == input_fingerprint(a)
    big = np.zeros((FINGERPRINT_WHOLE_BYTES // 64 + 1, 16), np.float32)   # sampled rows
    assert np.isfinite(input_fingerprint(big))


def test_local_blocks_tell_which_inputs_can_give_unequal_blocks():
    x, y = np.zeros((61, 3), np.float32), np.zeros(61, np.int32)
    train, batch, maybe, rows, val, split = guards.local_blocks(dict(x=x, y=y, batch_size=8))
    assert (train, batch, maybe, rows, val, split) == (61, 8, 0, 61, -1, 0)
    # Keras' cut of validation_split: floor(rows x (1 - split)) training rows
    train, _, _, rows, val, split = guards.local_blocks(dict(x=x, batch_size=8,
                                                             validation_split=0.2))
    assert (train, rows, val, split) == (48, 61, 13, 0.2)
    ds = tf.data.Dataset.from_tensor_slices((x, y))
    assert guards.local_blocks(dict(x=ds.batch(8)))[2] == 1        # last batch unknown
    static = guards.local_blocks(dict(x=ds.batch(8, drop_remainder=True)))
    assert static[1:3] == (8, 0)
    # a generator, and validation data that may differ, may give unequal blocks
    assert guards.local_blocks(dict(x=iter([])))[2] == 1
    assert guards.local_blocks(dict(x=x, batch_size=8, validation_data=ds.batch(8)))[2] == 1


def test_data_shard_batched_form_is_known_to_give_equal_blocks():
    from tfhybrid import data

    tfhybrid.init()
    ds = tf.data.Dataset.from_tensor_slices(np.zeros((10, 2), np.float32)).batch(4)
    assert not data.equal_blocks(ds)
    sharded = data.shard(ds)
    assert data.equal_blocks(sharded)            # one rank: the dataset itself (static or not)
    assert data.equal_blocks(ds.batch(2, drop_remainder=True))
    assert not data.equal_blocks(ds.unbatch().batch(3))
    # cache, prefetch, repeat, map, shuffle after shard keep the blocks equal
    marked = data._equal(ds)
    assert data.equal_blocks(marked.cache().prefetch(2).repeat(2).map(lambda t: t).shuffle(3))
    assert not data.equal_blocks(marked.unbatch().batch(4))
