"""Filter- and channel-parallel ``Conv2D``/``Conv3D`` layers (ParaDL 3.3 "f" and "c").

:class:`FilterParallelConv2D` / :class:`FilterParallelConv3D` split the
filters (output channels) over a group of K ranks,
:class:`ChannelParallelConv2D` / :class:`ChannelParallelConv3D` the input
channels. Same arguments as ``keras.layers.Conv2D`` / ``Conv3D``
(``channels_last``, ``groups=1``) plus ``group``/``input_layout``/
``output_layout``; the layout semantics are those of
:mod:`tfhybrid.layers.parallel_dense` along the channel axis. A
``FilterParallelConv2D(output_layout="split")`` followed by a
``ChannelParallelConv2D(input_layout="split")`` costs one all-reduce
forward, instead of ParaDL's gather/scatter per layer (the same for 3-D).
One convolution mixin (:class:`_ConvOp`) serves both ranks: the 2-D and
3-D classes differ only in ``_RANK`` and the Keras class they replace.
"""
from __future__ import annotations

import math

import keras
from keras import ops

from tfhybrid.layers.partitioned import IO_REPLICATED, ChannelParallel, FilterParallel

_PACKAGE = "tfhybrid"


def _per_axis(value, rank, layer, arg):
    """``value`` as a tuple of ``rank`` positive ints (an int is repeated)."""
    if isinstance(value, int) and not isinstance(value, bool):
        value = (value,) * rank
    value = tuple(value)
    if len(value) != rank or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 1
                                     for v in value):
        raise ValueError(f"Layer '{layer}': received an invalid value for `{arg}`, expected "
                         f"a positive int or a tuple of {rank} of them. Received: "
                         f"{arg}={value!r}")
    return value


def _conv_length(n, k, s, d, padding):
    if n is None:
        return None
    if padding == "same":
        return math.ceil(n / s)
    return (n - d * (k - 1) - 1) // s + 1


class _ConvOp:
    """The convolution of ``keras.layers.Conv2D`` (``_RANK`` 2) or ``Conv3D``
    (``_RANK`` 3) as hooks for the partitioned bases."""

    _RANK = 2
    _SOURCE = keras.layers.Conv2D
    _OUT_ARG = "filters"

    def __init__(self, filters, kernel_size, strides=1, padding="valid",
                 data_format=None, dilation_rate=1, activation=None, use_bias=True,
                 kernel_initializer="glorot_uniform", bias_initializer="zeros",
                 kernel_regularizer=None, bias_regularizer=None, activity_regularizer=None,
                 kernel_constraint=None, bias_constraint=None, group="model",
                 input_layout=IO_REPLICATED, output_layout=IO_REPLICATED, **kwargs):
        super().__init__(activation, use_bias, kernel_initializer, bias_initializer,
                         kernel_regularizer, bias_regularizer, activity_regularizer,
                         kernel_constraint, bias_constraint, group, input_layout,
                         output_layout, **kwargs)
        self._set_conv(filters, kernel_size, strides, padding, data_format, dilation_rate)
        self._init_partition()

    def get_config(self):
        return self._conv_config(super().get_config())

    def _set_conv(self, filters, kernel_size, strides, padding, data_format, dilation_rate):
        if isinstance(filters, bool) or not isinstance(filters, int) or filters < 1:
            raise ValueError(f"Layer '{self.name}': received an invalid value for `filters`, "
                             f"expected a positive integer. Received: filters={filters!r}")
        data_format = data_format or keras.config.image_data_format()
        if data_format != "channels_last":
            raise ValueError(f"Layer '{self.name}': received data_format={data_format!r}; "
                             "parallel convolutions support 'channels_last' only (transpose "
                             "the input, or use keras.layers.Permute).")
        padding = str(padding).lower()
        if padding not in ("valid", "same"):
            raise ValueError(f"Layer '{self.name}': received padding={padding!r}; expected "
                             "'valid' or 'same'.")
        self.filters = filters
        rank = self._RANK
        self.kernel_size = _per_axis(kernel_size, rank, self.name, "kernel_size")
        self.strides = _per_axis(strides, rank, self.name, "strides")
        self.dilation_rate = _per_axis(dilation_rate, rank, self.name, "dilation_rate")
        self.padding = padding
        self.data_format = data_format
        self.input_spec = keras.layers.InputSpec(ndim=rank + 2)

    def _out_dim(self):
        return self.filters

    def _kernel_shape(self, in_dim, out_dim):
        return self.kernel_size + (in_dim, out_dim)

    @classmethod
    def _source_input_shape(cls, in_dim):
        return (None,) * (cls._RANK + 1) + (in_dim,)

    def _linear(self, x, kernel):
        return ops.conv(x, kernel, strides=self.strides, padding=self.padding,
                        data_format=self.data_format, dilation_rate=self.dilation_rate)

    def compute_output_shape(self, input_shape):
        spatial = [_conv_length(n, k, s, d, self.padding) for n, k, s, d in zip(
            input_shape[1:self._RANK + 1], self.kernel_size, self.strides, self.dilation_rate)]
        return (input_shape[0], *spatial, self._out_channels())

    def _conv_config(self, config):
        config.update({"filters": self.filters, "kernel_size": self.kernel_size,
                       "strides": self.strides, "padding": self.padding,
                       "data_format": self.data_format, "dilation_rate": self.dilation_rate})
        return config


@keras.saving.register_keras_serializable(package=_PACKAGE)
class FilterParallelConv2D(_ConvOp, FilterParallel):
    """``Conv2D`` with its filters split over a group (filter parallelism).

    Each of the K ranks holds the kernel ``(kh, kw, in, filters/K)`` and bias
    ``(filters/K,)`` of its block of filters (tagged sharded, axis -1) and
    computes those output channels from the full input.

    Args:
        filters: Number of output channels of the whole layer (divisible by K).
        kernel_size, strides, padding, dilation_rate, activation, use_bias,
        kernel_initializer, bias_initializer, kernel_regularizer,
        bias_regularizer, activity_regularizer, kernel_constraint,
        bias_constraint: As ``keras.layers.Conv2D`` (padding "valid"/"same").
        data_format: ``"channels_last"`` (or None with that Keras default).
        group: Group the filters are split over.
        input_layout: ``"replicated"`` (default; input gradient all-reduced)
            or ``"replicated_partial_grad"`` (input gradient left partial for
            a producer that sums it).
        output_layout: ``"replicated"`` (default; all-gather of the
            channels), ``"replicated_partial_grad"`` (``comm.shard``) or
            ``"split"`` (own block of channels for a following
            :class:`ChannelParallelConv2D` with ``input_layout="split"``).
        **kwargs: Base layer arguments.

    Raises:
        ValueError: if ``filters`` is not divisible by the group size, for
            ``channels_first``, or an unknown layout/padding.

    Example:
        >>> tfhybrid.init(model_parallel=2)
        >>> conv = FilterParallelConv2D(32, 3, padding="same", activation="relu")
        >>> y = conv(images)                         # same as Conv2D(32, 3, ...)
        >>> conv = FilterParallelConv2D.from_layer(built_conv2d, output_layout="split")
    """


@keras.saving.register_keras_serializable(package=_PACKAGE)
class ChannelParallelConv2D(_ConvOp, ChannelParallel):
    """``Conv2D`` with its input channels split over a group (channel parallelism).

    Each of the K ranks holds the kernel ``(kh, kw, in/K, filters)`` of its
    block of input channels (tagged sharded, axis -2) and computes a partial
    sum of the output; the bias is whole on every rank.

    Args:
        filters: Number of output channels.
        kernel_size, strides, padding, dilation_rate, activation, use_bias,
        kernel_initializer, bias_initializer, kernel_regularizer,
        bias_regularizer, activity_regularizer, kernel_constraint,
        bias_constraint: As ``keras.layers.Conv2D`` (padding "valid"/"same").
        data_format: ``"channels_last"`` (or None with that Keras default).
        group: Group the input channels are split over.
        input_layout: ``"replicated"`` (default; split here, gradient
            all-gathered), ``"replicated_partial_grad"`` (split, gradient left
            partial) or ``"split"`` (input already holds this rank's block of
            channels).
        output_layout: ``"replicated"`` (default; all-reduce, bias,
            activation) or ``"partial"`` (partial sums, bias on group index 0,
            no activation).
        **kwargs: Base layer arguments.

    Raises:
        ValueError: if the input channels are not divisible by the group
            size, for ``channels_first``, or an unknown layout/padding.

    Example:
        >>> tfhybrid.init(model_parallel=2)
        >>> f = FilterParallelConv2D(32, 3, padding="same", output_layout="split")
        >>> c = ChannelParallelConv2D(64, 3, padding="same", input_layout="split")
        >>> y = c(f(images))            # == Conv2D(64,3)(Conv2D(32,3)(images)), one allreduce
    """


@keras.saving.register_keras_serializable(package=_PACKAGE)
class FilterParallelConv3D(_ConvOp, FilterParallel):
    """``Conv3D`` with its filters split over a group (filter parallelism).

    :class:`FilterParallelConv2D` for volumes (NDHWC): each of the K ranks
    holds the kernel ``(kd, kh, kw, in, filters/K)`` and bias
    ``(filters/K,)`` of its block of filters (tagged sharded, axis -1).
    Arguments, layouts and errors are those of :class:`FilterParallelConv2D`
    with ``kernel_size``/``strides``/``dilation_rate`` of three axes, as
    ``keras.layers.Conv3D``.

    Example:
        >>> tfhybrid.init(model_parallel=2)
        >>> conv = FilterParallelConv3D(16, 3, padding="same", activation="relu")
        >>> y = conv(volumes)                        # same as Conv3D(16, 3, ...)
        >>> conv = FilterParallelConv3D.from_layer(built_conv3d, output_layout="split")
    """

    _RANK = 3
    _SOURCE = keras.layers.Conv3D


@keras.saving.register_keras_serializable(package=_PACKAGE)
class ChannelParallelConv3D(_ConvOp, ChannelParallel):
    """``Conv3D`` with its input channels split over a group (channel parallelism).

    :class:`ChannelParallelConv2D` for volumes (NDHWC): each of the K ranks
    holds the kernel ``(kd, kh, kw, in/K, filters)`` of its block of input
    channels (tagged sharded, axis -2) and computes a partial sum of the
    output; the bias is whole on every rank. Arguments, layouts and errors
    are those of :class:`ChannelParallelConv2D`, as ``keras.layers.Conv3D``.

    Example:
        >>> tfhybrid.init(model_parallel=2)
        >>> f = FilterParallelConv3D(16, 3, padding="same", output_layout="split")
        >>> c = ChannelParallelConv3D(32, 3, padding="same", input_layout="split")
        >>> y = c(f(volumes))           # == Conv3D(32,3)(Conv3D(16,3)(volumes)), one allreduce
    """

    _RANK = 3
    _SOURCE = keras.layers.Conv3D


__all__ = ["FilterParallelConv2D", "ChannelParallelConv2D", "FilterParallelConv3D",
           "ChannelParallelConv3D"]
