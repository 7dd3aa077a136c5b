"""``tfhybrid.gather``: a plain Keras model with the full weights of a
transformed model (collective: every rank must call it).

The original architecture is rebuilt from the serialization recorded by
:func:`tfhybrid.transform`; each layer's full weights come from its
parallel counterpart: filter/channel-parallel layers all-gather their
slices (``to_layer``), spatial convolutions and SyncBatchNormalization
already hold full weights, copies are read directly.
"""
from __future__ import annotations

import functools
import os

from tfhybrid.comm import backend
from tfhybrid.watchdog import collective_api
from tfhybrid.transformer.api import info_of
from tfhybrid.transformer.parts import PartModel
from tfhybrid.transformer.graph import find_nested_layer, set_trainable_flags
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
        >>> tfhybrid.gather(pmodel).save("model.keras")   # on every rank (atomic)
    """
    if isinstance(model, PartModel):       # p, ls: their own gather
        return atomic_saves(model.gathered())
    info = info_of(model)
    full = rebuild(info.source, getattr(info, "objects", None))
    operations = {n.name for n in info.graph.nodes if n.attr("operation")}   # x / 255.0
    weighted = [np for np in info.plan.nodes
                if np.name not in operations and find_nested_layer(full, np.name).weights]
    # frozen or unfrozen since transform (fine-tuning): the source recorded the flags
    # of that moment; a frozen BatchNormalization also runs in inference
    set_trainable_flags(full, {np.name: find_layer(model, np.name).trainable
                               for np in weighted})
    for np in weighted:
        target = find_nested_layer(full, np.name)     # inside a nested model too
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
    return atomic_saves(full)


def atomic_saves(model):
    """``model.save``/``save_weights`` to a local path write a file of their own
    and rename it onto the path (``os.replace``, atomic).

    Every rank holds the same gathered model, and scripts save it on every
    rank (``gather(model).save("model.keras")``): Keras opens the path with
    truncation in each process, so a rank truncating while another still
    writes could leave a file mixing two writes (the zip's metadata carries
    the save time). With the rename the path always holds one rank's whole
    file. Saving on rank 0 only (``if tfhybrid.is_root():``) spares the
    other ranks' writes.
    """
    for name in ("save", "save_weights"):
        keras_method = getattr(model, name)
        object.__setattr__(model, name, _renamed_onto_path(keras_method))
    return model


def _renamed_onto_path(keras_method):
    @functools.wraps(keras_method)
    def method(filepath, *args, **kwargs):
        # file objects, remote paths, Keras' overwrite prompt, directories, shards: as Keras
        if (not isinstance(filepath, (str, os.PathLike)) or "://" in os.fspath(filepath)
                or args or kwargs.get("overwrite", True) is not True
                or kwargs.get("zipped") is False or kwargs.get("max_shard_size") is not None):
            return keras_method(filepath, *args, **kwargs)
        path = os.fspath(filepath)
        head, tail = os.path.split(path)
        # Keras checks the suffix (.keras, .weights.h5): keep the whole name at the end
        part = os.path.join(head, f".tfhybrid-{os.getpid()}-{tail}")
        try:
            out = keras_method(part, *args, **kwargs)
            os.replace(part, path)
        finally:
            if os.path.exists(part):
                os.remove(part)
        return out
    return method
