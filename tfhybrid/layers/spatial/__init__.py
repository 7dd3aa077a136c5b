"""Spatial (domain) parallelism layers, Gholami et al. / ParaDL strategy ``s``.

A spatially parallel region of a CNN::

    x = SpatialScatter(split="height")(images)            # full -> own block
    x = SpatialConv2D(32, 3, padding="same", activation="relu")(x)
    x = SpatialMaxPooling2D(2)(x)
    x = SpatialConv2D(64, 3, padding="same", activation="relu")(x)
    x = SpatialGather(split="height")(x)                   # blocks -> full
    logits = keras.layers.Dense(10)(keras.layers.Flatten()(x))

Element-wise layers (activations, dropout with a group-wide seed, Add),
``Concatenate`` along channels of equally split blocks (U-Net skips),
nearest-neighbour ``UpSampling2D/3D`` and a softmax over channels work on
blocks unchanged (bilinear ``UpSampling2D`` with a one-row halo:
``SpatialUpSampling2D``, :mod:`.upsample`); ``SpatialConv2DTranspose``/``SpatialConv3DTranspose``
up-sample with a halo, so a whole U-Net runs on blocks. Every layer here equals its Keras counterpart on
the full input, block by block, in outputs and gradients; convolution
weights are partial over the group (``VariableLayout("partial", group)``).

Modules: :mod:`tfhybrid.spatial_geometry` (which rows each rank holds and
needs; pure Python, beside the process grid), :mod:`.core` (halo assembly and
overlapped execution), :mod:`.conv`, :mod:`.pool`, :mod:`.io` (scatter and
gather), :mod:`.border` (zero padding and cropping), :mod:`.transpose`
(transposed convolutions), :mod:`.group_norm` (GroupNormalization with the
whole volume's moments), :mod:`.global_pool` (global average and max
pooling: the blocks' sums or maxima combined, no gather), :mod:`.output` (per-voxel outputs kept in blocks:
their loss, metrics and labels).
"""
from tfhybrid.layers.spatial.conv import (SpatialConv2D, SpatialConv3D, SpatialDepthwiseConv2D,
                                          SpatialSeparableConv2D)
from tfhybrid.layers.spatial.group_norm import SpatialGroupNormalization
from tfhybrid.layers.spatial.global_pool import (SpatialGlobalAveragePooling2D,
                                                 SpatialGlobalAveragePooling3D,
                                                 SpatialGlobalMaxPooling2D,
                                                 SpatialGlobalMaxPooling3D)
from tfhybrid.layers.spatial.border import (SpatialCropping2D, SpatialCropping3D,
                                            SpatialZeroPadding2D, SpatialZeroPadding3D)
from tfhybrid.layers.spatial.io import SpatialGather, SpatialScatter
from tfhybrid.layers.spatial.pool import (SpatialAveragePooling2D, SpatialAveragePooling3D,
                                          SpatialMaxPooling2D, SpatialMaxPooling3D)
from tfhybrid.layers.spatial.transpose import SpatialConv2DTranspose, SpatialConv3DTranspose
from tfhybrid.layers.spatial.upsample import SpatialUpSampling2D

__all__ = ["SpatialConv2D", "SpatialConv3D", "SpatialMaxPooling2D", "SpatialMaxPooling3D",
           "SpatialAveragePooling2D", "SpatialAveragePooling3D", "SpatialScatter",
           "SpatialGather", "SpatialZeroPadding2D", "SpatialZeroPadding3D", "SpatialCropping2D",
           "SpatialCropping3D", "SpatialConv2DTranspose", "SpatialConv3DTranspose",
           "SpatialGroupNormalization", "SpatialDepthwiseConv2D", "SpatialSeparableConv2D",
           "SpatialUpSampling2D", "SpatialGlobalAveragePooling2D",
           "SpatialGlobalAveragePooling3D", "SpatialGlobalMaxPooling2D",
           "SpatialGlobalMaxPooling3D"]
