"""How gradients travel on the wire: a small pluggable compressor, as in Horovod.

A :class:`Compressor` turns each gradient into the tensor that is all-reduced
(``compress``) and the sum back into a gradient (``decompress``), and says
how many bytes an item costs on the wire (``wire_itemsize``, for the bucket
plan and ``describe``). Two are built in, :attr:`Compression.none` and
:attr:`Compression.fp16`; pass either, its name, or your own subclass to
``tfhybrid.DistributedOptimizer(compression=...)``.

Gradients are scaled (averaged) *before* ``compress``, so a float16 sum of
p averaged terms cannot overflow where the sum of raw terms could.

Example:
    >>> class BF16(Compressor):
    ...     name = "bf16"
    ...     def compress(self, g):
    ...         if not g.dtype.is_floating:
    ...             return g, None
    ...         return tf.cast(g, tf.bfloat16), g.dtype
    ...     def decompress(self, s, ctx):
    ...         return s if ctx is None else tf.cast(s, ctx)
    ...     def wire_itemsize(self, dtype):
    ...         return 2 if dtype.is_floating else dtype.size
    >>> opt = tfhybrid.DistributedOptimizer(keras.optimizers.SGD(0.1), compression=BF16())
"""
from __future__ import annotations

import tensorflow as tf

from tfhybrid import errors


class Compressor:
    """Base class: the identity (what :attr:`Compression.none` is).

    Subclasses override :meth:`compress`, :meth:`decompress` and
    :meth:`wire_itemsize`, and set ``name`` (saved in the optimizer's config;
    a user-defined compressor is restored by passing it again).
    """

    name = "none"

    def compress(self, gradient):
        """``(wire tensor, context)`` for one (already scaled) gradient."""
        return gradient, None

    def decompress(self, summed, context):
        """The gradient from the all-reduced wire tensor and ``compress``'s context."""
        return summed

    def wire_itemsize(self, dtype) -> int:
        """Bytes per item of a gradient of ``dtype`` on the wire."""
        return tf.as_dtype(dtype).size

    @property
    def is_identity(self) -> bool:
        """True when gradients travel unchanged (Horovod may then scale the fused buffer)."""
        return type(self).compress is Compressor.compress

    def __repr__(self):
        return f"{type(self).__name__}(name={self.name!r})"


class NoneCompressor(Compressor):
    """Gradients travel in their own dtype."""


class FP16Compressor(Compressor):
    """Floating-point gradients travel as float16: half the bytes of float32,
    about 3 significant digits."""

    name = "fp16"

    def compress(self, gradient):
        if gradient.dtype in (tf.float32, tf.float64):
            return tf.cast(gradient, tf.float16), gradient.dtype
        return gradient, None

    def decompress(self, summed, context):
        return summed if context is None else tf.cast(summed, context)

    def wire_itemsize(self, dtype) -> int:
        dtype = tf.as_dtype(dtype)
        return 2 if dtype in (tf.float32, tf.float64) else dtype.size


class Compression:
    """The built-in compressors (Horovod's ``hvd.Compression`` spelling)."""

    none = NoneCompressor()
    fp16 = FP16Compressor()


BUILT_IN = {"none": Compression.none, "fp16": Compression.fp16}


def as_compressor(value) -> Compressor:
    """A :class:`Compressor` from a name (``"none"``, ``"fp16"``), None, a
    Compressor instance or subclass.

    Raises:
        ValueError: for an unknown name or another type.
    """
    if value is None:
        return Compression.none
    if isinstance(value, str) and value in BUILT_IN:
        return BUILT_IN[value]
    if isinstance(value, Compressor):
        return value
    if isinstance(value, type) and issubclass(value, Compressor):
        return value()
    raise errors.invalid_value("compression", value, tuple(BUILT_IN),
                               where="tfhybrid.DistributedOptimizer",
                               fix="Or pass a tfhybrid.optimizer.Compressor instance.")
