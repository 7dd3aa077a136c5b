"""Models used as layers (transfer learning: a ``keras.applications`` base or a
Sequential block called inside the outer model), as users write them:

    base = keras.applications.ResNet50(include_top=False, ...)
    base.trainable = False
    outputs = Dense(...)(GlobalAveragePooling2D()(base(inputs, training=False)))
    model = tfhybrid.transform(keras.Model(inputs, outputs), "f")
    ... fit the head ...
    base.trainable = True                  # on the handle the script kept
    model.compile(...); model.fit(...)     # fine-tune

``transform`` inlines nested models under f/c/s/df/ds; ``gather`` returns the
nested architecture. The script's ``base.trainable = True`` after
``transform`` changes only the original layers, so the transformed model
follows the source layers' flags at its next compile (otherwise the
fine-tuning would silently train the head alone).
Everything is compared with one process running the same script on the
unmodified model.
"""
import os

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfhybrid

from conftest import assert_weights_like, job_dir, reference_once, rng, world_size

BATCH = 8
L = keras.layers


def _base():
    """A small functional base with a residual Add, BatchNormalization and a
    Sequential block inside it (two levels of nesting)."""
    inputs = keras.Input((8, 8, 3))
    h = L.Conv2D(8, 3, padding="same", use_bias=False, name="b_c0")(inputs)   # BN follows
    h = L.BatchNormalization(name="b_bn0")(h)
    h = L.ReLU(name="b_relu0")(h)
    block = keras.Sequential([keras.Input((8, 8, 8)),
                              L.Conv2D(8, 3, padding="same", activation="relu", name="blk_c0"),
                              L.Conv2D(8, 3, padding="same", name="blk_c1")], name="block")
    h = L.Add(name="b_add")([h, block(h)])
    return keras.Model(inputs, L.MaxPooling2D(2, name="b_pool")(h), name="base")


def _model(frozen=True):
    keras.utils.set_random_seed(11)
    base = _base()
    base.trainable = not frozen
    inputs = keras.Input((8, 8, 3))
    h = base(inputs, training=False)
    h = L.GlobalAveragePooling2D(name="gap")(h)
    h = L.Dense(8, activation="relu", name="fc0")(h)
    return keras.Model(inputs, L.Dense(4, name="fc1")(h)), base


def _data():
    x = rng("nested-x").standard_normal((32, 8, 8, 3)).astype(np.float32)
    y = rng("nested-y").integers(0, 4, 32)
    return x, y


def _compile(model, optimizer):
    model.compile(optimizer, keras.losses.SparseCategoricalCrossentropy(from_logits=True))


def _assert_close(got_model, reference):
    # conv biases before a BatchNormalization have rounding-error gradients
    assert_weights_like(got_model, reference)


def _cases():
    n = world_size()
    # -np 4: the hybrid grids (the rest runs at -np 2)
    return [("f", n), ("s", n), ("d", 1), ("p", 2)] if n == 2 else [("df", 2), ("ds", 2)]


def _options(strategy):
    return {"stages": 2} if strategy == "p" else {"fallback": "replicate"}


@pytest.mark.parametrize("strategy,mp", _cases(), ids=lambda c: str(c))
def test_transfer_learning_with_a_nested_base_trains_like_one_process(grid_of, strategy, mp):
    grid_of(mp)
    x, y = _data()

    def compute():
        reference, ref_base = _model()
        _compile(reference, keras.optimizers.Adam(0.01))
        reference.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
        ref_base.trainable = True
        _compile(reference, keras.optimizers.SGD(0.01, momentum=0.9))
        reference.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
        return reference.get_weights()
    reference = reference_once(compute, x, y, BATCH)

    source, base = _model()
    model = tfhybrid.transform(source, strategy, **_options(strategy))
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH)
    _compile(model, tfhybrid.DistributedOptimizer(keras.optimizers.Adam(0.01)))
    model.fit(tfhybrid.data.shard(ds, model=model), epochs=1, verbose=0)
    base.trainable = True            # the script's handle: the model before transform
    _compile(model, tfhybrid.DistributedOptimizer(keras.optimizers.SGD(0.01, momentum=0.9)))
    if "blk_c1" in getattr(model, "local_layer_names", ("blk_c1",)):     # p: its stage
        assert model.get_layer("blk_c1").trainable
    model.fit(tfhybrid.data.shard(ds, model=model), epochs=1, verbose=0)

    full = tfhybrid.gather(model)
    assert [layer.name for layer in full.layers][1] == "base"       # nested, as given
    assert full.get_layer("base").get_layer("block").get_layer("blk_c0").trainable
    _assert_close(full, reference)
    moved = np.max(np.abs(full.get_layer("base").get_layer("b_c0").get_weights()[0]
                          - _model()[1].get_layer("b_c0").get_weights()[0]))
    assert moved > 1e-3              # the unfrozen base did train


@pytest.mark.parametrize("strategy,mp", _cases()[:2] + [("p", 2)] if world_size() == 2
                         else [("df", 2)], ids=lambda c: str(c))
def test_nested_model_checkpoint_resumes_like_one_process(grid_of, strategy, mp):
    """tfhybrid.save lines the optimizer slots up with the gathered (nested)
    model's trainable weights; load transforms the nested model again."""
    grid_of(mp)
    x, y = _data()

    def compute():
        reference, _ = _model(frozen=False)
        _compile(reference, keras.optimizers.Adam(0.01))
        reference.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
        return reference.get_weights()
    reference = reference_once(compute, x, y, BATCH)

    model = tfhybrid.transform(_model(frozen=False)[0], strategy, **_options(strategy))
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH)
    _compile(model, tfhybrid.DistributedOptimizer(keras.optimizers.Adam(0.01)))
    model.fit(tfhybrid.data.shard(ds, model=model), epochs=1, verbose=0)
    path = os.path.join(job_dir(), f"nested_{strategy}.keras")
    tfhybrid.save(model, path, epoch=1)
    resumed = tfhybrid.load(path, **_options(strategy))
    resumed.fit(tfhybrid.data.shard(ds, model=resumed), epochs=2, verbose=0)
    _assert_close(tfhybrid.gather(resumed), reference)


def test_layer_names_colliding_across_levels_are_refused(grid_of):
    grid_of(world_size())
    inputs = keras.Input((8, 8, 3))
    inner = keras.Sequential([keras.Input((8, 8, 3)), L.Conv2D(4, 3, name="conv")], name="inner")
    h = L.Conv2D(4, 1, name="conv")(L.Conv2D(3, 1, name="pre")(inputs))   # same name, outside
    model = keras.Model(inputs, L.Flatten(name="flat")(L.Concatenate(name="cat")(
        [inner(inputs), L.Cropping2D(1, name="crop")(h)])))
    with pytest.raises(ValueError, match="two layers named 'conv'"):
        tfhybrid.transform(model, "f", fallback="replicate")


@pytest.mark.skipif(world_size() != 2, reason="the same code at -np 4")
def test_ls_refuses_a_base_unfrozen_after_transform(grid_of):
    """ls fixes which weights train at transform: the script's unfreezing of the
    base (followed at compile) is refused at fit with the way out, on every rank."""
    grid_of(world_size())
    x, y = _data()
    source, base = _model()
    model = tfhybrid.transform(source, "ls")
    _compile(model, tfhybrid.DistributedOptimizer(keras.optimizers.SGD(0.01)))
    base.trainable = True
    _compile(model, tfhybrid.DistributedOptimizer(keras.optimizers.SGD(0.01)))
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH)
    with pytest.raises(ValueError, match="frozen or unfrozen after tfhybrid.transform"):
        model.fit(tfhybrid.data.shard(ds, model=model), epochs=1, verbose=0)


def test_oracle_and_plan_see_the_layers_of_a_nested_base():
    from tfhybrid.oracle.profile import profile

    model, _ = _model(frozen=False)
    flat = profile(model)
    names = [row.name for row in flat.rows]
    assert "blk_c1" in names and "base" not in names
