"""Learning-rate warmup and schedule callbacks with a Keras LearningRateSchedule
optimizer under horovodrun: the same weights as single-process training."""
import keras
import numpy as np
import pytest
import tensorflow as tf

import tfhybrid
from tfhybrid.callbacks import LearningRateScheduleCallback, LearningRateWarmupCallback
from tfhybrid.comm import backend

from conftest import randn


def _callbacks():
    return [LearningRateWarmupCallback(warmup_steps=3, initial_scale=0.25),
            LearningRateScheduleCallback(multiplier=lambda e: 0.5 ** e, start_epoch=1)]


@pytest.mark.parametrize("strategy,mp", [("d", 1), ("df", 2)])
def test_schedule_optimizer_with_warmup_matches_single_process(grid_of, strategy, mp):
    grid_of(mp)
    keras.utils.set_random_seed(1)
    inputs = keras.Input((5,))
    hidden = keras.layers.Dense(8, activation="tanh", name="fc1")(inputs)
    model = keras.Model(inputs, keras.layers.Dense(4, name="fc2")(hidden))
    x, y = randn((24, 5), "lr-x"), randn((24, 4), "lr-y")
    schedule = lambda: keras.optimizers.schedules.ExponentialDecay(0.2, 4, 0.7)  # noqa: E731

    pmodel = tfhybrid.transform(model, strategy=strategy)
    pmodel.compile(optimizer=tfhybrid.DistributedOptimizer(keras.optimizers.SGD(schedule())),
                   loss="mse")
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(8, drop_remainder=True)
    pmodel.fit(tfhybrid.data.shard(data, model=pmodel), epochs=3, verbose=0, shuffle=False,
               callbacks=tfhybrid.callbacks.standard() + _callbacks())
    got = tfhybrid.gather(pmodel).get_weights()

    model.compile(optimizer=keras.optimizers.SGD(schedule()), loss="mse")    # one process
    model.fit(x, y, batch_size=8, epochs=3, verbose=0, shuffle=False, callbacks=_callbacks())
    for a, b in zip(got, model.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    backend.barrier()
