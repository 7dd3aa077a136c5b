"""Learning-rate callbacks with float rates and with Keras LearningRateSchedules (one process)."""
import keras
import numpy as np
import pytest

import tfhybrid
from tfhybrid.callbacks import (LearningRateScheduleCallback, LearningRateWarmupCallback,
                                ScaledSchedule)

STEPS = 4           # batches per epoch


def _fit(lr, callbacks, epochs=2, distributed=True):
    """Train w in loss = mean(x * w) with x = 1: each SGD step is w -= lr_t exactly.

    Returns (the learning rates the steps used, read from the weight, and the
    learning rates seen at each batch begin)."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(
        1, use_bias=False, kernel_initializer="zeros")])
    opt = keras.optimizers.SGD(lr)
    model.compile(optimizer=tfhybrid.DistributedOptimizer(opt) if distributed else opt,
                  loss=lambda y, p: keras.ops.mean(p))
    weights = []
    record = keras.callbacks.LambdaCallback(
        on_train_batch_end=lambda b, logs: weights.append(float(model.get_weights()[0][0, 0])))
    x = np.ones((STEPS, 1), np.float32)
    model.fit(x, x, batch_size=1, epochs=epochs, verbose=0, shuffle=False,
              callbacks=[*callbacks, record])
    return -np.diff([0.0] + weights), model


def test_warmup_with_float_rate_reads_the_optimizer_rate():
    used, _ = _fit(0.4, [LearningRateWarmupCallback(warmup_steps=4, initial_scale=0.25)])
    np.testing.assert_allclose(used, [0.1, 0.175, 0.25, 0.325, 0.4, 0.4, 0.4, 0.4], rtol=1e-6)


@pytest.mark.parametrize("distributed", [True, False])
def test_warmup_scales_a_schedule(distributed):
    schedule = keras.optimizers.schedules.ExponentialDecay(0.4, decay_steps=1, decay_rate=0.5)
    used, model = _fit(schedule, [LearningRateWarmupCallback(warmup_steps=4, initial_scale=0.25)],
                       distributed=distributed)
    scale = [0.25 + 0.75 * min(1, t / 4) for t in range(8)]
    np.testing.assert_allclose(used, [0.4 * 0.5 ** t * s for t, s in enumerate(scale)], rtol=1e-5)
    inner = getattr(model.optimizer, "inner_optimizer", model.optimizer)
    assert isinstance(inner._learning_rate, ScaledSchedule)


def test_schedule_callback_multiplies_a_schedule_per_epoch_and_per_batch():
    schedule = keras.optimizers.schedules.PiecewiseConstantDecay([100], [0.2, 0.1])
    used, _ = _fit(schedule, [LearningRateScheduleCallback(multiplier=0.5, start_epoch=1)])
    np.testing.assert_allclose(used, [0.2] * 4 + [0.1] * 4, rtol=1e-6)
    used, _ = _fit(schedule, [LearningRateScheduleCallback(
        multiplier=lambda e: 1.0 / (1 + e), staircase=False)])
    np.testing.assert_allclose(used, [0.2 / (1 + t / STEPS) for t in range(8)], rtol=1e-6)


def test_schedule_callbacks_on_float_rate_make_a_step_schedule():
    used, _ = _fit(0.2, [LearningRateScheduleCallback(multiplier=1.0, end_epoch=1),
                         LearningRateScheduleCallback(multiplier=0.1, start_epoch=1)])
    np.testing.assert_allclose(used, [0.2] * 4 + [0.02] * 4, rtol=1e-6)


def test_warmup_and_schedule_compose_on_a_schedule_and_a_second_fit_keeps_it():
    schedule = keras.optimizers.schedules.PiecewiseConstantDecay([100], [0.2, 0.1])
    warm = LearningRateWarmupCallback(warmup_steps=2, initial_scale=0.5)
    decay = LearningRateScheduleCallback(multiplier=0.1, start_epoch=1)
    used, model = _fit(schedule, [warm, decay])
    np.testing.assert_allclose(used, [0.1, 0.15, 0.2, 0.2, 0.02, 0.02, 0.02, 0.02], rtol=1e-6)
    config = keras.optimizers.serialize(model.optimizer)      # saves with the wrapper
    again = keras.optimizers.deserialize(config)
    inner = getattr(again, "inner_optimizer", again)
    assert isinstance(inner._learning_rate, ScaledSchedule)
    assert float(inner._learning_rate.factors["multiplier"].numpy()) == pytest.approx(0.1)


@pytest.mark.parametrize("make, phrase", [
    (lambda: LearningRateWarmupCallback(target_lr=0.1, warmup_steps=2), "target_lr=0.1"),
    (lambda: LearningRateWarmupCallback(warmup_steps=2, initial_lr=0.01), "initial_lr=0.01"),
    (lambda: LearningRateScheduleCallback(initial_lr=0.1, multiplier=0.5), "initial_lr=0.1"),
])
def test_rates_given_with_a_schedule_are_refused_at_fit(make, phrase):
    schedule = keras.optimizers.schedules.ExponentialDecay(0.4, 10, 0.5)
    with pytest.raises(ValueError, match=phrase + ".*schedule"):
        _fit(schedule, [make()])


@pytest.mark.parametrize("make, phrase", [
    (lambda: LearningRateWarmupCallback(warmup_steps=0), "`warmup_steps`: 0"),
    (lambda: LearningRateWarmupCallback(warmup_steps=3, initial_scale=-1), "initial_scale"),
    (lambda: LearningRateScheduleCallback(multiplier=-2), "`multiplier`: -2"),
    (lambda: LearningRateScheduleCallback(start_epoch=3, end_epoch=2), "end_epoch=2"),
    (lambda: LearningRateScheduleCallback(steps_per_epoch=1.5), "steps_per_epoch"),
    (lambda: ScaledSchedule(3.0), "`schedule`"),
])
def test_bad_arguments(make, phrase):
    with pytest.raises(ValueError, match=phrase):
        make()


def test_a_train_step_traced_before_the_callback_reads_the_wrapped_schedule():
    schedule = keras.optimizers.schedules.PiecewiseConstantDecay([100], [0.2, 0.1])
    _, model = _fit(schedule, [], epochs=1)                 # traced with the bare schedule
    w0 = float(model.get_weights()[0][0, 0])
    x = np.ones((STEPS, 1), np.float32)
    model.fit(x, x, batch_size=1, epochs=1, verbose=0, shuffle=False,
              callbacks=[LearningRateScheduleCallback(multiplier=0.5)])
    assert float(model.get_weights()[0][0, 0]) - w0 == pytest.approx(-0.1 * STEPS, rel=1e-6)
