"""``tfhybrid.gather``: a plain Keras model with the full weights of a
transformed model (collective: every rank must call it).

The original architecture is rebuilt from the serialization recorded by
:func:`tfhybrid.transform`; each layer's full weights come from its
parallel counterpart: filter/channel-parallel layers all-gather their
slices (``to_layer``), spatial convolutions and SyncBatchNormalization
already hold full weights, copies are read directly.
"""
from __future__ import annotations

import json

import keras

from tfhybrid.comm import backend
from tfhybrid.watchdog import collective_api
from tfhybrid.transformer.api import info_of
from tfhybrid.transformer.rewrite import find_layer
from tfhybrid.transformer.source import finalize_states, rebuild

_SLICED = ("filter", "channel")


@collective_api("tfhybrid.gather")
def gather(model):
    """The original (untransformed) architecture with ``model``'s full weights.

    Collective: call on every rank, in the same order; every rank receives
    the same full model. It ends with a world barrier, so a script may end
    or build another model right after it. It contains no tfhybrid layer, so
    ``gather(model).save("x.keras")`` loads with plain ``keras``; to resume
    on another world size, ``tfhybrid.transform(keras.saving.load_model(
    "x.keras"), strategy)``.

    Args:
        model: A model returned by :func:`tfhybrid.transform`.

    Returns:
        A new, uncompiled Keras model (Sequential if the original was).

    Raises:
        ValueError: if ``model`` was not returned by tfhybrid.transform.

    Example:
        >>> tfhybrid.gather(pmodel).save("model.keras")   # on every rank
    """
    if hasattr(model, "gathered") and hasattr(model, "fc_part"):   # ls (layer_separation)
        return model.gathered()
    if hasattr(model, "gathered") and hasattr(model, "pipeline_state"):   # p (pipeline.py)
        return model.gathered()
    info = info_of(model)
    full = rebuild(info.source, getattr(info, "objects", None))
    for np in info.plan.nodes:
        target = full.get_layer(np.name)
        if not target.weights:
            continue
        layer = find_layer(model, np.name)
        if np.kind in _SLICED:
            layer = layer.to_layer()
        target.set_weights(layer.get_weights())
        finalize_states(target)
    # The allgathers above run in model groups; a group that finished first
    # must not move on (or exit, taking Horovod's process sets with it) while
    # another group is still gathering.
    if backend.is_initialized():
        backend.barrier()
    return full
