"""Shared check of the spatial-strategy model tests: ``tfhybrid.transform`` +
``fit`` on the ranks equals ``fit`` of the unmodified model in one process.

The reference is computed once per (builder, data), by rank 0
(conftest.reference_once); the transformed model is fed ``tfhybrid.data.shard`` and compiled with
``tfhybrid.DistributedOptimizer``. Its predictions before training must match
the original's (rtol 1e-5), its gathered weights after one epoch the
reference's (rtol 1e-4, atol 1e-6), and the reference must have moved
(else the comparison would be vacuous).
"""
import keras
import numpy as np
import tensorflow as tf

import tfhybrid
from tfhybrid.compose import transform
from tfhybrid.transformer import gather

from conftest import reference_once

LR, LOSS = 0.1, "sparse_categorical_crossentropy"
_REFERENCES = {}


def dataset(x, y, batch):
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(batch, drop_remainder=True)


def _compile(model, optimizer):
    model.compile(optimizer=optimizer, loss=LOSS, jit_compile=False)
    return model


def reference(build, x, y, batch):
    """Weights after single-process fit of ``build()`` (cached per builder;
    computed by rank 0 once per run: conftest.reference_once)."""
    key = (build.__module__, build.__name__, x.shape, batch)
    if key not in _REFERENCES:
        def compute():
            model = _compile(build(), keras.optimizers.SGD(LR))
            model.fit(dataset(x, y, batch), epochs=1, shuffle=False, verbose=0)
            return model.get_weights()
        _REFERENCES[key] = reference_once(compute, build, x, y, batch, LR, LOSS)
    return _REFERENCES[key]


def check_fit_equals_single_process(build, x, y, batch, strategy, options, layer_types):
    """Transform ``build()`` under ``strategy``; assert ``layer_types`` ({name:
    class}) in the result, then equal predictions and equal trained weights."""
    expected = reference(build, x, y, batch)
    original = build()
    initial = original.get_weights()
    pmodel = transform(original, strategy, **options)
    for name, cls in layer_types.items():
        assert isinstance(pmodel.get_layer(name), cls), (name, type(pmodel.get_layer(name)))
    _compile(pmodel, tfhybrid.DistributedOptimizer(keras.optimizers.SGD(LR)))
    blocks, index = tfhybrid.data.batch_split(pmodel)
    rows = slice(index * batch // blocks, (index + 1) * batch // blocks)
    np.testing.assert_allclose(pmodel.predict(x[rows], batch_size=batch, verbose=0),
                               original(x[rows]), rtol=1e-5, atol=1e-6)
    pmodel.fit(tfhybrid.data.shard(dataset(x, y, batch), model=pmodel), epochs=1,
               shuffle=False, verbose=0)
    actual = gather(pmodel).get_weights()
    moved = max(float(np.max(np.abs(e - i))) for e, i in zip(expected, initial))
    assert moved > 1e-3, "the reference did not train: the comparison would be vacuous"
    for i, (a, e) in enumerate(zip(actual, expected)):
        np.testing.assert_allclose(a, e, rtol=1e-4, atol=1e-6, err_msg=f"weight {i}")
    diff = max(float(np.max(np.abs(a - e))) for a, e in zip(actual, expected))
    print(f"\n{strategy} {options}: max |gathered - reference| = {diff:.2e} "
          f"(largest update {moved:.2e})")


def fit_like_one_process(model, build, x, y, lr, epochs, batch=8, loss=LOSS, key=(),
                         predict=None):
    """Fit the unmodified ``build()`` in one process (rank 0, once per run:
    conftest.reference_once; ``key``: whatever else the built model depends
    on) and transformed ``model`` (``DistributedOptimizer``, ``data.shard`` of
    global batches of ``batch``) with SGD(``lr``) for ``epochs`` on ``(x, y)``;
    assert equal History losses (rtol 1e-5) and gathered weights (rtol 1e-4,
    atol 1e-6). Returns the trained reference's predictions of ``predict``
    (None if not given)."""
    def compute():
        reference = build()
        reference.compile(optimizer=keras.optimizers.SGD(lr), loss=loss)
        history = reference.fit(x, y, batch_size=batch, epochs=epochs, shuffle=False,
                                verbose=0).history["loss"]
        predicted = None if predict is None else reference.predict(predict, verbose=0)
        return history, reference.get_weights(), [v.path for v in reference.weights], predicted

    want, weights, paths, predicted = reference_once(
        compute, build, key, x, y, lr, epochs, batch, loss, predict)
    model.compile(optimizer=tfhybrid.DistributedOptimizer(keras.optimizers.SGD(lr)), loss=loss)
    data = tfhybrid.data.shard(tf.data.Dataset.from_tensor_slices((x, y)), model=model,
                               batch_size=batch)
    got = model.fit(data, epochs=epochs, verbose=0, callbacks=tfhybrid.callbacks.standard())
    np.testing.assert_allclose(got.history["loss"], want, rtol=1e-5)
    for a, b, path in zip(gather(model).get_weights(), weights, paths):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6, err_msg=path)
    return predicted
