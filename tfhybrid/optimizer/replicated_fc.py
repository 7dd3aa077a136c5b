"""Lee et al.'s replicated gradient computation for fully-connected layers.

In plain data parallelism a Dense layer's K_b x K_c weight gradient is
all-reduced. Lee et al. (Section III-C.2) instead all-gather the layer's
input activations and output errors, (K_b + K_c) x N values for a global
batch of N, and let every rank compute the weight gradient of the whole
global batch itself. For the first FC layers of a CNN (VGG-A: 25,088 x 4,096
weights) this moves far fewer bytes.

:func:`replicate_fc_gradients` hooks the first ``f`` ``keras.layers.Dense``
layers of a model: their forward pass is unchanged; in the backward pass one
allgather of ``[activations | errors]`` over the batch-split group yields
``dW = A^T E / G`` and ``db = sum(E) / G``, which *is* the global-batch
gradient, so the :class:`tfhybrid.DistributedOptimizer` skips their
reduction (the variables are marked pre-reduced). The input gradient stays
local (``dx = E W^T``).

Differences from the paper: the gather happens in the backward pass (one
collective instead of one in forward and one in backward), and the update is
not delayed to the next mini-batch, so training stays exactly synchronous.
"""
from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf

from tfhybrid.comm import backend
from tfhybrid.comm.primitives import resolve_group
from tfhybrid.layout import layout_of
from tfhybrid.optimizer.reduction import is_prereduced, mark_prereduced

_HOOKED = "_tfhybrid_replicated_fc"


def dense_layers(model, include_parallel=False):
    """``keras.layers.Dense`` layers of ``model`` in forward order (nested models too);
    with ``include_parallel``, tfhybrid's filter/channel-parallel Dense layers too."""
    out = []
    for layer in getattr(model, "layers", []):
        if isinstance(layer, keras.layers.Dense) or (
                include_parallel and getattr(type(layer), "_SOURCE", None) is keras.layers.Dense):
            out.append(layer)
        elif hasattr(layer, "layers"):
            out.extend(dense_layers(layer, include_parallel))
    return out


def replicate_fc_gradients(model, f: int, group: str = None):
    """Compute the weight gradients of the first ``f`` Dense layers replicated.

    Args:
        model: A built Keras model (Sequential or functional).
        f: Number of Dense layers, counted from the input, to hook.
        group: Group the batch is split over ("data" or "world"). Defaults to
            the model's ``_tfhybrid_batch_split`` (set by strategies whose
            early layers are data-parallel over all ranks), else "data".

    Returns:
        The number of layers newly hooked (already hooked layers are kept).

    Raises:
        ValueError: if ``f`` is not a non-negative integer, exceeds the number
            of Dense layers, the model is not built, or a layer is not a
            plain replicated Dense (quantized, LoRA or partitioned).

    Example:
        >>> model = keras.Sequential([keras.Input((32,)), keras.layers.Dense(64),
        ...                           keras.layers.Dense(10)])
        >>> replicate_fc_gradients(model, 1)
        1
    """
    if isinstance(f, bool) or not isinstance(f, int) or f < 0:
        raise ValueError(f"Received an invalid value for `replicate_fc_gradients`: f={f!r}; "
                         "expected a non-negative integer (number of Dense layers).")
    layers = dense_layers(model)
    if f > len(layers):
        raise ValueError(f"Received replicate_fc_gradients={f}, but model {model.name!r} has "
                         f"only {len(layers)} Dense layers; use at most {len(layers)}.")
    group = group or getattr(model, "_tfhybrid_batch_split", "data")
    if group not in ("data", "world"):
        raise ValueError(f"Received group={group!r} for replicated FC gradients; "
                         "expected 'data' or 'world'.")
    hooked = 0
    for layer in layers[:f]:
        if getattr(layer, _HOOKED, None) is None:
            _hook(layer, group)
            hooked += 1
    return hooked


def _check_hookable(layer):
    if not layer.built:
        raise ValueError(f"Dense layer {layer.name!r} is not built; build the model (call it "
                         "once or give it an Input) before replicate_fc_gradients.")
    if getattr(layer, "lora_enabled", False) or getattr(layer, "quantization_mode", None):
        raise ValueError(f"Dense layer {layer.name!r} uses LoRA or quantization, which "
                         "replicated FC gradients do not support; lower "
                         "replicate_fc_gradients so it excludes this layer.")
    for var in layer.trainable_variables:
        if layout_of(var).kind != "replicated" or is_prereduced(var):
            raise ValueError(f"Dense layer {layer.name!r} holds a {layout_of(var).kind} "
                             "weight; only replicated Dense layers can replicate gradients.")


def _hook(layer, group):
    _check_hookable(layer)

    def call(inputs, training=None):
        x = tf.cast(inputs, layer.compute_dtype)
        kernel = tf.cast(tf.convert_to_tensor(layer.kernel), layer.compute_dtype)
        bias = [] if layer.bias is None else [tf.cast(tf.convert_to_tensor(layer.bias),
                                                       layer.compute_dtype)]
        y = _replicated_dense(x, kernel, bias, resolve_group(group), layer.name)
        return layer.activation(y) if layer.activation is not None else y

    object.__setattr__(layer, "call", call)
    object.__setattr__(layer, _HOOKED, group)
    for var in layer.trainable_variables:
        mark_prereduced(var)


def _replicated_dense(x, kernel, bias, group, name):
    """``x @ kernel (+ bias)`` whose weight gradients cover the whole group's batch."""
    k_in, k_out = kernel.shape

    @tf.custom_gradient
    def forward(x, kernel, *bias):
        x2 = tf.reshape(x, [-1, k_in])
        y2 = tf.matmul(x2, kernel)
        if bias:
            y2 = y2 + bias[0]
        y = tf.reshape(y2, tf.concat([tf.shape(x)[:-1], [k_out]], 0))

        def grad(dy):
            e2 = tf.reshape(dy, [-1, k_out])
            dx = tf.reshape(tf.matmul(e2, kernel, transpose_b=True), tf.shape(x))
            both = tf.concat([x2, e2], axis=1)           # one collective: [A | E]
            if group.size > 1:
                both = backend.allgather(both, group.ranks, f"{name}.replicated_fc")
            a_all, e_all = both[:, :k_in], both[:, k_in:]
            inv = 1.0 / group.size
            grads = [dx, tf.matmul(a_all, e_all, transpose_a=True) * inv]
            if bias:
                grads.append(tf.reduce_sum(e_all, axis=0) * inv)
            return grads

        return y, grad

    return forward(x, kernel, *bias)


def fc_gather_bytes(layer, global_batch: int) -> int:
    """Bytes one hooked layer gathers per step: (K_b + K_c) x N x itemsize."""
    k_in, k_out = layer.kernel.shape
    return int((k_in + k_out) * global_batch * np.dtype(layer.compute_dtype).itemsize)
