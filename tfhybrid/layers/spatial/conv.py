"""Spatially parallel convolutions: ``SpatialConv2D`` and ``SpatialConv3D``.

Domain parallelism (Gholami et al., ParaDL's spatial strategy ``s``): the
input of a convolution is split into blocks along height, width (depth) or a
block grid over a group of ranks; every rank holds the full, identical
weights and computes its block of the output after receiving the halo
(the rows of its neighbours' blocks that its output windows reach). Halo
widths follow from kernel size, stride, dilation and padding; zero padding
is applied only at the global border, exactly as Keras/TF pad the full
input (including TF's asymmetric ``same`` padding for stride 2), so the
blocks concatenate to the output of the plain Keras layer.

Each rank's kernel and bias gradients cover only its block of the output:
they are partial sums, tagged ``VariableLayout("partial", group)`` so that
:class:`tfhybrid.DistributedOptimizer` sums them over the spatial group.
"""
from __future__ import annotations

import os

import keras
from keras import ops

from tfhybrid.layers.spatial import core
from tfhybrid.layout import VariableLayout, set_layout


# The block convolution (core.block_conv: the block's own 'same' conv plus thin
# halo corrections, no halo-extended copy of the block; bench/volume_memory.py)
# is the default wherever its plans allow. TFHYBRID_BLOCK_CONV=0 selects the
# windowed path (one 'valid' conv of the halo-extended block), whose sums are
# bit-identical to Keras' own convolution of the padded input; the block
# convolution adds the same products in another order (float32 rounding apart,
# equal: a VGG16 'ds' run once looked 0.1-5% off, which was one ReLU input at
# 6e-9 of a 7e-3 layer flipping sign with the order; see test_strategies_apps).
BLOCK_CONV = os.environ.get("TFHYBRID_BLOCK_CONV", "1") != "0"


class _SpatialConv(core.SpatialMixin):
    """Shared implementation of SpatialConv2D/3D (mixed into keras ConvND)."""

    _takes_overlap = True
    _keras_class = None
    _default_split = "height"

    def __init__(self, filters, kernel_size, strides=1, padding="valid", dilation_rate=1,
                 activation=None, use_bias=True, split=None, group="model", overlap=None,
                 border_padding=None, **kwargs):
        super().__init__(filters=filters, kernel_size=kernel_size, strides=strides,
                         padding=padding, dilation_rate=dilation_rate, activation=activation,
                         use_bias=use_bias, **kwargs)
        self._init_conv_spatial(split, group, overlap)
        self._init_border_padding(border_padding)

    def _init_conv_spatial(self, split, group, overlap):
        """The spatial arguments, once the Keras layer is initialised (channels_last only)."""
        if self.data_format != "channels_last":
            raise ValueError(f"{self._label()}: only data_format='channels_last' is supported; "
                             f"received data_format={self.data_format!r}.")
        self._init_spatial(self._default_split if split is None else split, group, overlap)

    def build(self, input_shape):
        self._spatial_groups()      # collective: registers the block grid's groups
        super().build(input_shape)  # creates kernel/bias, validates via compute_output_shape
        layout = VariableLayout("partial", self.group)
        set_layout(self._kernel, layout)
        if self.use_bias:
            set_layout(self.bias, layout)

    def _windows(self):
        return tuple(d * (k - 1) + 1 for k, d in zip(self.kernel_size, self.dilation_rate))

    def _halo_conv(self, inputs, op, kernel):
        """``op(x, kernel, padding)`` (``"same"`` or ``"valid"``, a convolution
        linear in ``x``) of this rank's block with its halo: the block's own
        ``same`` operation plus thin halo corrections (no halo-extended, padded
        copy of the block in forward or backward) where the plans allow, else
        one ``valid`` operation of the halo-extended block."""
        plans = core.window_plans(self, inputs.shape, self._windows(), self.strides,
                                  self._plan_padding())
        overlap = self._overlap_now()
        if BLOCK_CONV and not overlap and core.block_conv_possible(plans):
            outputs = core.block_conv(inputs, plans, self._spatial_groups(), op, kernel,
                                      f"{self.name}.halo")
            if outputs is not None:
                return outputs
        return core.windowed(inputs, plans, self._spatial_groups(),
                             lambda x, _ranges, k: op(x, k, "valid"), 0.0,
                             f"{self.name}.halo", overlap, params=(kernel,))

    def _finish(self, outputs):
        """Bias and activation, as the Keras layer applies them."""
        if self.use_bias:
            outputs = ops.add(outputs, ops.reshape(self.bias, (1,) * (self.rank + 1) + (-1,)))
        if self.activation is not None:
            outputs = self.activation(outputs)
        return outputs

    def call(self, inputs):
        def conv(x, kernel, padding):
            return ops.conv(x, kernel, strides=list(self.strides), padding=padding,
                            dilation_rate=self.dilation_rate, data_format="channels_last")

        return self._finish(self._halo_conv(inputs, conv, ops.convert_to_tensor(self.kernel)))

    def compute_output_shape(self, input_shape):
        return core.output_block_shape(self, input_shape, self._windows(), self.strides,
                                       self._plan_padding(), self.filters)

    @staticmethod
    def _weights_input_shape(conv):
        """An input shape that builds ``conv``'s weights (spatial sizes unknown)."""
        channels = conv._kernel.shape[-2] * conv.groups
        return (None,) + (None,) * conv.rank + (channels,)


@keras.saving.register_keras_serializable(package="tfhybrid")
class SpatialConv2D(_SpatialConv, keras.layers.Conv2D):
    """2-D convolution over an NHWC input split into blocks over a group of ranks.

    The input is this rank's block of the full NHWC tensor, split along
    height, width, or a ``(ph, pw)`` block grid (blocks in group-rank order,
    row-major for grids); the output is this rank's block of what
    ``keras.layers.Conv2D`` computes on the full input. Halo rows and
    columns are exchanged with the neighbouring blocks
    (:func:`tfhybrid.comm.halo_exchange`); in a graph, the interior of the
    block is convolved while the halo is in flight (``overlap``).

    Args:
        filters, kernel_size, strides, padding, dilation_rate, activation,
        use_bias, **kwargs: as ``keras.layers.Conv2D`` (channels_last only).
        split: "height", "width" or a tuple ``(ph, pw)`` with ``ph * pw``
            equal to the group size.
        group: Group the blocks are split over ("model", "data" or "world").
        overlap: Overlap the halo exchange with the interior convolution
            when running in a graph (``tf.function``, ``model.fit``). None
            (default): only when a GPU is visible; on CPU-only hosts the
            extra ops cost more than they hide (``bench/spatial.py``).

    Raises:
        ValueError: for an invalid ``split``, or (at build/call) when the
            global size, the output size or the blocks do not fit the grid;
            the message names the shape, the grid and the nearest valid sizes.

    Example:
        >>> tfhybrid.init(model_parallel=2)          # horovodrun -np 2
        >>> conv = SpatialConv2D(16, 3, padding="same", split="height")
        >>> y = conv(x_block)     # x_block: (batch, H/2, W, C), y: (batch, H/2, W, 16)
        >>> # or from an existing, built layer:
        >>> spatial = SpatialConv2D.from_layer(keras_conv, split=(1, 2))
    """

    _keras_class = keras.layers.Conv2D
    _ndim = 2
    _default_split = "height"


@keras.saving.register_keras_serializable(package="tfhybrid")
class SpatialConv3D(_SpatialConv, keras.layers.Conv3D):
    """3-D convolution over an NDHWC volume split into blocks over a group of ranks.

    The volumetric counterpart of :class:`SpatialConv2D` (CosmoFlow-like
    inputs too large for one device): equals ``keras.layers.Conv3D`` on the
    full volume, block by block.

    Args:
        filters, kernel_size, strides, padding, dilation_rate, activation,
        use_bias, **kwargs: as ``keras.layers.Conv3D`` (channels_last only).
        split: "depth", "height", "width" or a tuple ``(pd, ph, pw)`` whose
            product equals the group size.
        group: Group the blocks are split over.
        overlap: Overlap the halo exchange with the interior convolution in
            a graph (None: only when a GPU is visible).

    Raises:
        ValueError: as :class:`SpatialConv2D`.

    Example:
        >>> conv = SpatialConv3D(8, 3, padding="same", split="depth")
        >>> y = conv(x_block)     # x_block: (batch, D/k, H, W, C)
    """

    _keras_class = keras.layers.Conv3D
    _ndim = 3
    _default_split = "depth"


class _SpatialDepthwise(_SpatialConv):
    """Shared call of the depthwise convolutions (mixed into a Keras class).

    A depthwise convolution is linear in its input like a convolution, so the
    halo machinery is the same (:func:`core.block_conv` or
    :func:`core.windowed`) with ``ops.depthwise_conv`` as the operation. The
    depthwise kernel's gradient is a partial sum over the group; a separable
    convolution's 1x1 pointwise step needs no halo and runs on the block.
    """

    def __init__(self, *args, split=None, group="model", overlap=None, **kwargs):
        # the Keras class's own arguments (not _SpatialConv.__init__'s, which are Conv's)
        self._keras_class.__init__(self, *args, **kwargs)
        self._init_conv_spatial(split, group, overlap)

    def _depthwise_kernel(self):
        return self.kernel

    def build(self, input_shape):
        self._spatial_groups()      # collective: registers the block grid's groups
        self._keras_class.build(self, input_shape)
        layout = VariableLayout("partial", self.group)
        for v in self.trainable_weights:
            set_layout(v, layout)

    def _depthwise_blocks(self, inputs):
        """This rank's block of the depthwise convolution (no bias, no activation)."""
        def depthwise(x, kernel, padding):
            return ops.depthwise_conv(x, kernel, strides=tuple(self.strides), padding=padding,
                                      dilation_rate=self.dilation_rate,
                                      data_format="channels_last")

        return self._halo_conv(inputs, depthwise,
                               ops.convert_to_tensor(self._depthwise_kernel()))

    def compute_output_shape(self, input_shape):
        channels = self._output_channels(input_shape[-1])
        return core.output_block_shape(self, input_shape, self._windows(), self.strides,
                                       self.padding, channels)


@keras.saving.register_keras_serializable(package="tfhybrid")
class SpatialDepthwiseConv2D(_SpatialDepthwise, keras.layers.DepthwiseConv2D):
    """``keras.layers.DepthwiseConv2D`` over an NHWC input split into blocks.

    Equals the Keras layer on the full input, block by block (MobileNet- and
    EfficientNet-style blocks under ``s``/``ds``); halo as
    :class:`SpatialConv2D`, kernel and bias gradients partial over the group.

    Args:
        kernel_size, strides, padding, depth_multiplier, dilation_rate,
        activation, use_bias, **kwargs: as ``keras.layers.DepthwiseConv2D``
        (channels_last only).
        split, group, overlap: as :class:`SpatialConv2D`.

    Example:
        >>> dw = SpatialDepthwiseConv2D(3, padding="same", split="height")
        >>> y = dw(x_block)       # (batch, H/k, W, C) -> (batch, H/k, W, C)
    """

    _keras_class = keras.layers.DepthwiseConv2D
    _ndim = 2
    _default_split = "height"

    def call(self, inputs):
        return self._finish(self._depthwise_blocks(inputs))

    def _output_channels(self, channels):
        return None if channels is None else channels * self.depth_multiplier

    @staticmethod
    def _weights_input_shape(conv):
        return (None, None, None, conv.kernel.shape[-2])


@keras.saving.register_keras_serializable(package="tfhybrid")
class SpatialSeparableConv2D(_SpatialDepthwise, keras.layers.SeparableConv2D):
    """``keras.layers.SeparableConv2D`` over an NHWC input split into blocks.

    The depthwise step exchanges the halo (as :class:`SpatialDepthwiseConv2D`);
    the 1x1 pointwise step runs on the block. Both kernels' gradients and the
    bias's are partial over the group.

    Args:
        filters, kernel_size, strides, padding, depth_multiplier,
        dilation_rate, activation, use_bias, **kwargs: as
        ``keras.layers.SeparableConv2D`` (channels_last only).
        split, group, overlap: as :class:`SpatialConv2D`.

    Example:
        >>> sep = SpatialSeparableConv2D(32, 3, padding="same", split="height")
        >>> y = sep(x_block)      # (batch, H/k, W, C) -> (batch, H/k, W, 32)
    """

    _keras_class = keras.layers.SeparableConv2D
    _ndim = 2
    _default_split = "height"

    def _depthwise_kernel(self):
        return self.depthwise_kernel

    def call(self, inputs):
        depthwise = self._depthwise_blocks(inputs)
        outputs = ops.conv(depthwise, self.pointwise_kernel, strides=1, padding="valid",
                           data_format="channels_last")
        return self._finish(outputs)

    def _output_channels(self, channels):
        return self.filters

    @staticmethod
    def _weights_input_shape(conv):
        return (None, None, None, conv.depthwise_kernel.shape[-2])
