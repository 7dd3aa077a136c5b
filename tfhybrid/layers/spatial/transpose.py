"""Spatially parallel transposed convolutions: ``SpatialConv2DTranspose`` and
``SpatialConv3DTranspose`` (the up-sampling path of a U-Net decoder).

A transposed convolution adds ``x[i] * K[t]`` to output row ``i * s + t -
crop`` (:class:`tfhybrid.spatial_geometry.TransposeGeometry`). Rank ``r``
computes its block of output rows ``[r*m, (r+1)*m)``: it receives from its
neighbours the input rows whose contributions reach that block (a halo of
at most ``ceil(window / stride)`` rows; none for the U-Net's usual ``2x2``
kernel with stride 2, ``valid``), pads rows beyond the global border with
zeros, runs a ``valid`` transposed convolution on the halo-extended block
and keeps the rows of its output block. The blocks concatenate to what the
Keras layer computes on the whole input, for strides 1 and 2 (any stride)
and padding ``same``/``valid``.

Kernel and bias gradients cover only this rank's block of the output: they
are partial sums over the spatial group (``VariableLayout("partial")``),
summed by :class:`tfhybrid.DistributedOptimizer` as for
:class:`tfhybrid.layers.SpatialConv2D`.
"""
from __future__ import annotations

import keras
from keras import ops

from tfhybrid import spatial_geometry as sp
from tfhybrid.layers.spatial import core
from tfhybrid.layout import VariableLayout, set_layout


class _SpatialConvTranspose(core.SpatialMixin):
    """Shared implementation of SpatialConv2DTranspose/3DTranspose."""

    _takes_overlap = True
    _keras_class = None

    def __init__(self, filters, kernel_size, strides=1, padding="valid", output_padding=None,
                 dilation_rate=1, activation=None, use_bias=True, split=None, group="model",
                 overlap=None, **kwargs):
        super().__init__(filters=filters, kernel_size=kernel_size, strides=strides,
                         padding=padding, output_padding=output_padding,
                         dilation_rate=dilation_rate, activation=activation,
                         use_bias=use_bias, **kwargs)
        if self.data_format != "channels_last":
            raise ValueError(f"{self._label()}: only data_format='channels_last' is supported; "
                             f"received data_format={self.data_format!r}.")
        if self.output_padding is not None:
            raise ValueError(f"{self._label()}: Received output_padding="
                             f"{self.output_padding!r}; spatial transposed convolutions support "
                             "output_padding=None only (the output size follows from the "
                             "stride and padding). Keep this layer replicated.")
        if any(d != 1 for d in self.dilation_rate):
            raise ValueError(f"{self._label()}: Received dilation_rate={self.dilation_rate!r}; "
                             "spatial transposed convolutions support dilation_rate=1 only. "
                             "Keep this layer replicated.")
        # overlap is accepted for a uniform config; the halo (if any) is exchanged first.
        self._init_spatial(self._default_split if split is None else split, group, overlap)

    def build(self, input_shape):
        self._spatial_groups()      # collective: registers the block grid's groups
        super().build(input_shape)
        layout = VariableLayout("partial", self.group)
        set_layout(self.kernel, layout)
        if self.use_bias:
            set_layout(self.bias, layout)

    def _transpose_plans(self, local_shape):
        """One validated AxisPlan (of a TransposeGeometry) per spatial axis."""
        key = tuple(local_shape[1:1 + self._ndim])
        if key not in self._plans:
            dims = self._static_spatial(local_shape)
            plans = []
            for d, (n, g) in enumerate(zip(dims, self._spatial_groups())):
                geom = sp.TransposeGeometry(n * g.size, g.size, self.kernel_size[d],
                                            self.strides[d], self.padding)
                if geom.problem():
                    raise ValueError(sp.axis_problem_message(
                        self._label(), self._global_shape(local_shape), self._grid_shape(),
                        sp.SPATIAL_AXES[self._ndim][d], geom))
                plans.append(sp.AxisPlan(geom, g.index))
            self._plans[key] = tuple(plans)
        return self._plans[key]

    def call(self, inputs):
        plans = self._transpose_plans(inputs.shape)
        ext = core.assemble(inputs, plans, self._spatial_groups(), 0.0, f"{self.name}.halo",
                            with_halo=True)
        outputs = ops.conv_transpose(ext, self.kernel, strides=list(self.strides),
                                     padding="valid", output_padding=None,
                                     dilation_rate=1, data_format="channels_last")
        for d, plan in enumerate(plans):
            start, size = plan.geometry.offset(plan.index), plan.geometry.out_block
            if start != 0 or size != outputs.shape[d + 1]:
                outputs = core._slice_axis(outputs, d + 1, start, size)
        if self.use_bias:
            outputs = ops.add(outputs, ops.reshape(self.bias, (1,) * (self._ndim + 1) + (-1,)))
        if self.activation is not None:
            outputs = self.activation(outputs)
        return outputs

    def compute_output_shape(self, input_shape):
        input_shape = tuple(input_shape)
        if any(v is None for v in input_shape[1:1 + self._ndim]):
            return (input_shape[0],) + (None,) * self._ndim + (self.filters,)
        plans = self._transpose_plans(input_shape)
        return (input_shape[0],) + tuple(p.geometry.out_block for p in plans) + (self.filters,)

    @staticmethod
    def _weights_input_shape(conv):
        """An input shape that builds ``conv``'s weights (spatial sizes unknown)."""
        channels = conv.kernel.shape[-1]   # (spatial..., filters, input channels)
        return (None,) + (None,) * len(conv.kernel_size) + (channels,)


@keras.saving.register_keras_serializable(package="tfhybrid")
class SpatialConv2DTranspose(_SpatialConvTranspose, keras.layers.Conv2DTranspose):
    """2-D transposed convolution of an NHWC input split into blocks over a group of ranks.

    Equals ``keras.layers.Conv2DTranspose`` on the full input, block by block
    (strides 1, 2 or more; padding ``same`` or ``valid``): each rank receives
    the few input rows of its neighbours whose contributions reach its
    output block, then computes that block locally.

    Args:
        filters, kernel_size, strides, padding, activation, use_bias,
        **kwargs: as ``keras.layers.Conv2DTranspose`` (channels_last,
            ``output_padding=None`` and ``dilation_rate=1`` only).
        split: "height", "width" or a tuple ``(ph, pw)``.
        group: Group the blocks are split over ("model", "data" or "world").
        overlap: Accepted for symmetry with :class:`SpatialConv2D`; unused.

    Raises:
        ValueError: for output_padding, dilation, channels_first, or (at
            build/call) when the input or output does not split over the grid
            (with the nearest valid global sizes).

    Example:
        >>> up = SpatialConv2DTranspose(8, 2, strides=2, split="height")
        >>> y = up(x_block)     # (batch, H/k, W, C) -> (batch, 2H/k, 2W, 8)
    """

    _keras_class = keras.layers.Conv2DTranspose
    _ndim = 2
    _default_split = "height"


@keras.saving.register_keras_serializable(package="tfhybrid")
class SpatialConv3DTranspose(_SpatialConvTranspose, keras.layers.Conv3DTranspose):
    """3-D transposed convolution of an NDHWC volume split into blocks over a group of ranks.

    The volumetric counterpart of :class:`SpatialConv2DTranspose`: equals
    ``keras.layers.Conv3DTranspose`` on the full volume, block by block.

    Args:
        filters, kernel_size, strides, padding, activation, use_bias,
        **kwargs: as ``keras.layers.Conv3DTranspose`` (channels_last,
            ``output_padding=None`` and ``dilation_rate=1`` only).
        split: "depth", "height", "width" or a tuple ``(pd, ph, pw)``.
        group: Group the blocks are split over.
        overlap: Accepted for symmetry with :class:`SpatialConv3D`; unused.

    Raises:
        ValueError: as :class:`SpatialConv2DTranspose`.

    Example:
        >>> up = SpatialConv3DTranspose(8, 2, strides=2, split="depth")
        >>> y = up(x_block)     # (batch, D/k, H, W, C) -> (batch, 2D/k, 2H, 2W, 8)
    """

    _keras_class = keras.layers.Conv3DTranspose
    _ndim = 3
    _default_split = "depth"
