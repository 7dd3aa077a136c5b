"""``NoXLA``: the mixin that keeps every tfhybrid layer out of XLA.

Horovod's collectives are custom TensorFlow ops that XLA cannot compile, and
Keras 3 resolves ``jit_compile="auto"`` to XLA whenever a GPU is visible
unless some layer reports ``supports_jit = False``. ``keras.layers.Layer``
sets ``self.supports_jit = True`` on every *instance* in its ``__init__``,
which shadows a plain class attribute of the same name; this mixin makes the
attribute a read-only property, so instances report False whatever Keras (or
a user) assigns.

Example:
    >>> class MyLayer(NoXLA, keras.layers.Layer):
    ...     pass
    >>> MyLayer().supports_jit
    False
"""
from __future__ import annotations


class NoXLA:
    """Mixin (listed before the Keras base class): ``supports_jit`` is always False."""

    @property
    def supports_jit(self):
        """False: the layer calls Horovod ops, which XLA cannot compile."""
        return False

    @supports_jit.setter
    def supports_jit(self, value):
        # keras.layers.Layer.__init__ assigns True; the layer never supports XLA.
        del value
