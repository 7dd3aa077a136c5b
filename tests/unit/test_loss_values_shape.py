"""Which compiled losses tfhybrid computes on the whole batch / volume
(tfhybrid.batch_losses.loss_values_shape, batch_level): found from the shape
of the values a Keras loss's ``call`` returns, before its reduction."""
import keras
import numpy as np
import pytest
import tensorflow as tf

from tfhybrid.batch_losses import batch_level, gradient_times, loss_values_shape

Y = tf.constant(np.random.default_rng(0).random((4, 6, 6, 1)), tf.float32)
T = tf.cast(Y > 0.5, tf.float32)


class RowMean(keras.losses.Loss):
    """A user's loss reducing over two spatial axes itself."""

    def call(self, y_true, y_pred):
        return tf.reduce_mean(y_true - y_pred, axis=[1, 2])


@pytest.mark.parametrize("loss, shape, whole", [
    (keras.losses.Dice(), (), True),
    (keras.losses.Tversky(), (), True),
    (keras.losses.Dice(axis=(1, 2, 3)), (4,), False),
    (keras.losses.BinaryCrossentropy(), (4, 6, 6), False),
    (keras.losses.MeanSquaredError(), (4, 6, 6), False),
    (RowMean(), (4, 1), False),
])
def test_values_shape_and_batch_level(loss, shape, whole):
    assert tuple(loss_values_shape(loss, T, Y)) == shape
    assert batch_level(loss, T, Y) is whole


def test_not_a_keras_loss_is_left_alone():
    assert loss_values_shape(lambda t, p: t - p, T, Y) is None
    assert batch_level(lambda t, p: t - p, T, Y) is False


def test_gradient_times_keeps_the_value():
    x = tf.Variable(3.0)
    with tf.GradientTape() as tape:
        y = gradient_times(x * x, 4)
    assert float(y) == 9.0
    assert float(tape.gradient(y, x)) == 24.0
