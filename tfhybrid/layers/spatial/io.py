"""Entry and exit of a spatially parallel region: ``SpatialScatter``, ``SpatialGather``.

``SpatialScatter`` turns the full (replicated) input of every rank of the
group into this rank's block (``tfhybrid.comm.split`` along each split
axis; the backward all-gathers the gradient). ``SpatialGather`` turns the
blocks back into the full tensor on every rank (``tfhybrid.comm.gather``;
the backward keeps this rank's block), e.g. after the last convolution and
before Flatten/Dense, as ParaDL's spatial strategy does.
"""
from __future__ import annotations

import keras
import tensorflow as tf

from tfhybrid import comm, errors
from tfhybrid.layers.spatial import core
from tfhybrid import spatial_geometry as sp


class _SpatialIO(core.SpatialMixin, keras.layers.Layer):
    """Shared parts of SpatialScatter and SpatialGather."""

    def __init__(self, split="height", group="model", **kwargs):
        super().__init__(**kwargs)
        split = sp.normalize_split(split)
        self._ndim = len(split) if not isinstance(split, str) else 2
        if isinstance(split, str) and split == "depth":
            self._ndim = 3
        self._init_spatial(split, group)

    def build(self, input_shape):
        ndim = len(input_shape) - 2
        if ndim not in sp.SPATIAL_AXES:
            raise ValueError(f"{self._label()}: expected a 4-D (NHWC) or 5-D (NDHWC) input; "
                             f"received shape {tuple(input_shape)}.")
        if ndim != self._ndim:
            self._ndim, self._groups = ndim, None
        sp.check_split(self.split, ndim, self._label())
        self._spatial_groups()  # collective: registers the block grid's groups

    def _axes(self):
        """(axis, sub-group) for every split spatial axis."""
        return [(d + 1, g) for d, g in enumerate(self._spatial_groups()) if g.size > 1]


@keras.saving.register_keras_serializable(package="tfhybrid")
class SpatialScatter(_SpatialIO):
    """Full input on every rank of the group -> this rank's spatial block.

    Place it at the input of a spatially parallel region. Every rank of the
    group must hold the same full tensor; the gradient of the full input is
    all-gathered from the blocks, so it is complete on every rank.

    Args:
        split: "height", "width" ("depth" for 5-D inputs) or a block-grid
            tuple with one entry per spatial axis, its product equal to the
            group size.
        group: Group the blocks are split over.
        **kwargs: Keras layer arguments (``name``, ``dtype``).

    Raises:
        ValueError: if a spatial size does not split evenly over the grid
            (the message gives the shape, the grid and the nearest valid sizes).

    Example:
        >>> x_block = SpatialScatter(split="height")(images)  # (B, H, W, C) -> (B, H/k, W, C)
    """

    def build(self, input_shape):
        super().build(input_shape)
        shape = self._grid_shape()
        for d, k in enumerate(shape):
            size = input_shape[d + 1]
            if size is not None and size % k:
                raise self._split_message(input_shape, shape, d, size, k)

    def _split_message(self, input_shape, shape, d, size, k):
        return errors.not_divisible(
            sp.SPATIAL_AXES[self._ndim][d], size, k,
            f"blocks along it of the {'x'.join(map(str, shape))} grid",
            where=f"{self._label()}: the input of shape {tuple(input_shape)} cannot be split")

    def call(self, inputs):
        for axis, g in self._axes():
            inputs = comm.split(inputs, axis, g, name=f"{self.name}.split")
        return inputs

    def compute_output_shape(self, input_shape):
        shape = list(input_shape)
        for d, k in enumerate(self._grid_shape()):
            if shape[d + 1] is not None:
                shape[d + 1] //= k
        return tuple(shape)


@keras.saving.register_keras_serializable(package="tfhybrid")
class SpatialGather(_SpatialIO):
    """This rank's spatial block -> the full tensor on every rank of the group.

    Place it after the last spatially parallel layer (e.g. before Flatten
    and Dense). The consumers must compute identical (replicated) values on
    every rank of the group; the backward keeps this rank's block of the
    gradient.

    Args:
        split: The split of the incoming blocks (as :class:`SpatialScatter`).
        group: Group the blocks are split over.
        **kwargs: Keras layer arguments.

    Example:
        >>> full = SpatialGather(split="height")(y_block)   # (B, H/k, W, C) -> (B, H, W, C)
        >>> logits = keras.layers.Dense(10)(keras.layers.Flatten()(full))
    """

    def call(self, inputs):
        shape = self._global_shape(inputs.shape)
        for axis, g in self._axes():
            inputs = comm.gather(inputs, axis, g, name=f"{self.name}.gather")
        # The allgather's output size is dynamic; restore the static shape so
        # Flatten/Dense (and their gradients) keep known sizes in a graph.
        return tf.ensure_shape(inputs, shape)

    def compute_output_shape(self, input_shape):
        return self._global_shape(input_shape)
