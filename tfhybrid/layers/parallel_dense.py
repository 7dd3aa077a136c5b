"""Filter- and channel-parallel ``Dense`` layers (ParaDL 3.3, Megatron column/row).

:class:`FilterParallelDense` splits the output units over a group of K
ranks, :class:`ChannelParallelDense` the input features. By default each is
a drop-in replacement of ``keras.layers.Dense``: it takes and returns the
full tensor, replicated over the group, and equals the dense layer in value
and gradient. Chaining a filter-parallel layer with ``output_layout="split"``
into a channel-parallel layer with ``input_layout="split"`` exchanges
nothing in between: the pair costs one all-reduce forward (the channel
layer's reduce) and one backward (the filter layer's input copy).
"""
from __future__ import annotations

import keras
from keras import ops

from tfhybrid.layers.partitioned import IO_REPLICATED, ChannelParallel, FilterParallel

_PACKAGE = "tfhybrid"


class _DenseOp:
    """The matmul of ``keras.layers.Dense`` as hooks for the partitioned bases."""

    _SOURCE = keras.layers.Dense
    _OUT_ARG = "units"

    def __init__(self, units, activation=None, use_bias=True,
                 kernel_initializer="glorot_uniform", bias_initializer="zeros",
                 kernel_regularizer=None, bias_regularizer=None, activity_regularizer=None,
                 kernel_constraint=None, bias_constraint=None, group="model",
                 input_layout=IO_REPLICATED, output_layout=IO_REPLICATED, **kwargs):
        super().__init__(activation, use_bias, kernel_initializer, bias_initializer,
                         kernel_regularizer, bias_regularizer, activity_regularizer,
                         kernel_constraint, bias_constraint, group, input_layout,
                         output_layout, **kwargs)
        self._set_units(units)
        self._init_partition()

    def get_config(self):
        return self._dense_config(super().get_config())

    def _set_units(self, units):
        if isinstance(units, bool) or not isinstance(units, int) or units < 1:
            raise ValueError(f"Layer '{self.name}': received an invalid value for `units`, "
                             f"expected a positive integer. Received: units={units!r}")
        self.units = units
        self.input_spec = keras.layers.InputSpec(min_ndim=2)

    def _out_dim(self):
        return self.units

    @staticmethod
    def _kernel_shape(in_dim, out_dim):
        return (in_dim, out_dim)

    @staticmethod
    def _source_input_shape(in_dim):
        return (None, in_dim)

    def _linear(self, x, kernel):
        return ops.matmul(x, kernel)

    def compute_output_shape(self, input_shape):
        return tuple(input_shape[:-1]) + (self._out_channels(),)

    def _dense_config(self, config):
        config["units"] = self.units
        return config


@keras.saving.register_keras_serializable(package=_PACKAGE)
class FilterParallelDense(_DenseOp, FilterParallel):
    """``Dense`` with its output units split over a group (filter parallelism).

    Each of the K ranks of ``group`` holds the kernel columns ``(in, units/K)``
    and bias ``(units/K,)`` of its block of output units (tagged
    ``VariableLayout("sharded", group, axis=-1)``) and computes that block
    from the full input.

    Args:
        units: Number of output units of the *whole* layer (divisible by K).
        activation, use_bias, kernel_initializer, bias_initializer,
        kernel_regularizer, bias_regularizer, activity_regularizer,
        kernel_constraint, bias_constraint: As ``keras.layers.Dense``.
        group: Group the units are split over ("model", "data", "world" or a
            :class:`tfhybrid.process_grid.Group`).
        input_layout: ``"replicated"`` (default: the input is R and its
            gradient is all-reduced over the group, so it is R too) or
            ``"replicated_partial_grad"`` (the input gradient is left partial
            for a producer that sums it: ``ModuloLayer``, ``ShardLayer``,
            ``comm.batch_gather``/``comm.shard``).
        output_layout: ``"replicated"`` (default: all-gather, the full output
            for replicated consumers), ``"replicated_partial_grad"`` (full
            output whose consumers are partitioned: ``comm.shard``) or
            ``"split"`` (this rank's block of units, for a following
            :class:`ChannelParallelDense` with ``input_layout="split"``).
        **kwargs: Base layer arguments (``name``, ``dtype``, ...).

    Raises:
        ValueError: if ``units`` is not divisible by the group size, a layout
            is unknown, or a channel-mixing activation (softmax) is combined
            with ``output_layout="split"``.

    Example:
        >>> tfhybrid.init(model_parallel=2)                  # horovodrun -np 2
        >>> layer = FilterParallelDense(64, activation="relu")
        >>> y = layer(x)                                     # same as Dense(64)(x)
        >>> pair = [FilterParallelDense(64, output_layout="split"),
        ...         ChannelParallelDense(10, input_layout="split")]   # one allreduce
        >>> layer = FilterParallelDense.from_layer(built_dense)   # sliced weights
    """


@keras.saving.register_keras_serializable(package=_PACKAGE)
class ChannelParallelDense(_DenseOp, ChannelParallel):
    """``Dense`` with its input features split over a group (channel parallelism).

    Each of the K ranks of ``group`` holds the kernel rows ``(in/K, units)``
    of its block of input features (tagged ``VariableLayout("sharded",
    group, axis=-2)``) and computes a partial sum of the output; the bias is
    whole on every rank.

    Args:
        units: Number of output units.
        activation, use_bias, kernel_initializer, bias_initializer,
        kernel_regularizer, bias_regularizer, activity_regularizer,
        kernel_constraint, bias_constraint: As ``keras.layers.Dense``.
        group: Group the input features are split over.
        input_layout: ``"replicated"`` (default: full input, split here; the
            input gradient is all-gathered to R), ``"replicated_partial_grad"``
            (full input whose gradient is left partial, no communication) or
            ``"split"`` (the input is already this rank's block of features,
            e.g. from ``FilterParallelDense(output_layout="split")``).
        output_layout: ``"replicated"`` (default: all-reduce, then bias and
            activation) or ``"partial"`` (partial sums; the bias is added on
            group index 0 only and tagged ``partial``; activation must be
            None). The consumer of a partial output must reduce it.
        **kwargs: Base layer arguments.

    Raises:
        ValueError: if the number of input features is not divisible by the
            group size, a layout is unknown, or an activation is combined
            with ``output_layout="partial"``.

    Example:
        >>> tfhybrid.init(model_parallel=2)
        >>> layer = ChannelParallelDense(10)
        >>> y = layer(x)                    # same as Dense(10)(x), one allreduce
        >>> layer = ChannelParallelDense.from_layer(built_dense, input_layout="split")
    """


__all__ = ["FilterParallelDense", "ChannelParallelDense"]
