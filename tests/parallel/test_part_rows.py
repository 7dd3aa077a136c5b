"""p and ls fed a Horovod-style per-rank slice of the data.

Under ``p`` the stages of a pipeline must feed the same rows; under ``ls`` an
FC worker feeds its CONV workers' rows joined in order (what
``tfhybrid.data.shard(..., model=model)`` gives each part). A script that
slices the arrays per rank as for data parallelism (``x[rank::size]``) gives
the last stage, or the FC worker, the labels of other rows than the first
stage's or the CONV workers' inputs: unguarded, the model would train on
mismatched rows and labels, silently. The guards compare the batches of the
first two steps of a fit and the first batch of an evaluate (one scalar
allgather each) and raise on every rank, naming the fix. Also here, scripts
on the right rows under p/ls: ``fit(validation_data=...)`` and
``callbacks.standard()`` on two fits.
"""
import keras
import numpy as np
import pytest
import tensorflow as tf

import tfhybrid
from tfhybrid import guards

from conftest import reference_once, world_size
from stage_testing import B, compile_sgd, data
from test_layer_separation import vgg_fc_head

CASES = [("p", 2), ("ls", 1)] + ([("p", 4), ("ls", 1, 2)] if world_size() > 2 else [])


def _model(case, grid_of):
    strategy, mp = case[0], case[1]
    grid_of(mp)
    keras.utils.set_random_seed(3)
    options = {"fc_workers": case[2]} if len(case) > 2 else {}
    model = tfhybrid.transform(vgg_fc_head(), strategy, **options)
    compile_sgd(model, True)
    return model


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_a_per_rank_slice_is_refused_on_every_rank(grid_of, case):
    model = _model(case, grid_of)
    x, y = data()
    size, rank = tfhybrid.size(), tfhybrid.rank()
    with pytest.raises(guards.ConsistencyError, match=r"fed other rows.*tfhybrid\.data\.shard"):
        model.fit(x[rank::size], y[rank::size], batch_size=4, epochs=1,
                  shuffle=False, verbose=0)
    with pytest.raises(guards.ConsistencyError, match="at the first batch of evaluate"):
        model.evaluate(x[rank::size], y[rank::size], batch_size=4, verbose=0)
    local = tfhybrid.data.local_batch_size(B, model)      # right rows, sliced validation
    xl, yl = tfhybrid.data.shard((x, y), model=model, batch_size=B)
    with pytest.raises(guards.ConsistencyError, match="at the first batch of evaluate"):
        model.fit(xl, yl, batch_size=local, epochs=1, shuffle=False, verbose=0,
                  validation_data=(x[rank::size], y[rank::size]), validation_batch_size=4)


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_the_blocks_of_data_shard_pass(grid_of, case):
    model = _model(case, grid_of)
    x, y = data()
    local = tfhybrid.data.local_batch_size(B, model)
    xl, yl = tfhybrid.data.shard((x, y), model=model, batch_size=B)
    model.fit(xl, yl, batch_size=local, epochs=2, shuffle=False, verbose=0)
    model.evaluate(xl, yl, batch_size=local, verbose=0)
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(B)
    model.fit(tfhybrid.data.shard(ds, model=model), epochs=1, verbose=0)


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_fit_validation_data_equals_one_process(grid_of, case):
    """fit(validation_data=...) failed on p and ls ("evaluate() got multiple values
    for argument 'return_dict'") on some ranks, the others waiting in the
    validation's collectives until the watchdog ended the job."""
    model = _model(case, grid_of)
    x, y = data()

    def compute():
        keras.utils.set_random_seed(3)
        reference = vgg_fc_head()
        compile_sgd(reference, False)
        return reference.fit(x, y, batch_size=B, epochs=2, shuffle=False, verbose=0,
                             validation_data=(x[:B * 2], y[:B * 2])).history
    want = reference_once(compute, x, y)
    local = tfhybrid.data.local_batch_size(B, model)
    xl, yl = tfhybrid.data.shard((x, y), model=model, batch_size=B)
    xv, yv = tfhybrid.data.shard((x[:B * 2], y[:B * 2]), model=model, batch_size=B)
    got = model.fit(xl, yl, batch_size=local, epochs=2, shuffle=False, verbose=0,
                    validation_data=(xv, yv)).history
    for key in ("loss", "val_loss", "val_accuracy"):
        np.testing.assert_allclose(got[key], want[key], rtol=1e-4, err_msg=key)


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_two_fits_with_the_standard_callbacks_equal_one_process(grid_of, case):
    """callbacks.standard() (its broadcast of every variable from rank 0) failed
    under ls ("Mismatched BROADCAST tensor shapes": CONV and FC workers hold other
    optimizer slots); a second fit with new callbacks must not reset the FC part
    to rank 0's stale copy."""
    model = _model(case, grid_of)
    x, y = data()

    def compute():
        keras.utils.set_random_seed(3)
        reference = vgg_fc_head()
        compile_sgd(reference, False)
        want = []
        for _ in range(2):
            want += reference.fit(x, y, batch_size=B, epochs=1, shuffle=False,
                                  verbose=0).history["loss"]
        return want, reference.get_weights()
    want, weights = reference_once(compute, x, y)
    local = tfhybrid.data.local_batch_size(B, model)
    xl, yl = tfhybrid.data.shard((x, y), model=model, batch_size=B)
    got = []
    for _ in range(2):
        got += model.fit(xl, yl, batch_size=local, epochs=1, shuffle=False, verbose=0,
                         callbacks=tfhybrid.callbacks.standard()).history["loss"]
    np.testing.assert_allclose(got, want, rtol=1e-4)
    full = tfhybrid.gather(model)
    for a, b in zip(full.get_weights(), weights):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
