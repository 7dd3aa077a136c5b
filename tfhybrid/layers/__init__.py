"""Parallel Keras 3 layers of tfhybrid."""

# -- spatial (domain) parallelism: tfhybrid/layers/spatial/ ------------------
from tfhybrid.layers.spatial import (SpatialAveragePooling2D, SpatialAveragePooling3D,  # noqa: F401
                                     SpatialConv2D, SpatialConv3D, SpatialCropping2D,
                                     SpatialCropping3D, SpatialGather,
                                     SpatialMaxPooling2D, SpatialMaxPooling3D,
                                     SpatialScatter, SpatialZeroPadding2D,
                                     SpatialZeroPadding3D, SpatialConv2DTranspose,
                                     SpatialConv3DTranspose, SpatialGroupNormalization,
                                     SpatialDepthwiseConv2D, SpatialSeparableConv2D,
                                     SpatialUpSampling2D, SpatialGlobalAveragePooling2D,
                                     SpatialGlobalAveragePooling3D, SpatialGlobalMaxPooling2D,
                                     SpatialGlobalMaxPooling3D)
# -- end spatial ------------------------------------------------------------------

# -- model parallelism (filter/channel), SplitBrain boundaries, sync batch norm --
# tfhybrid/layers/{partitioned,parallel_dense,parallel_conv,splitbrain,sync_bn}.py
from tfhybrid.layers.parallel_conv import (ChannelParallelConv2D, ChannelParallelConv3D,  # noqa: F401
                                          FilterParallelConv2D, FilterParallelConv3D)
from tfhybrid.layers.parallel_dense import ChannelParallelDense, FilterParallelDense  # noqa: F401
from tfhybrid.layers.splitbrain import ModuloInverseLayer, ModuloLayer, ShardLayer  # noqa: F401
from tfhybrid.layers.sync_bn import SyncBatchNormalization  # noqa: F401
# -- end model parallelism ----------------------------------------------------------
