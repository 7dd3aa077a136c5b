"""The original model's recipe for :func:`tfhybrid.gather`, checked at transform time.

``gather`` rebuilds the original architecture from the Keras serialization
that :func:`tfhybrid.transform` records. A model that Keras cannot rebuild
from its serialization would fail only there, after training. This module
records the serialization together with the *live* Python objects the
rebuild needs in this process, and checks every layer when the model is
transformed:

* ``Lambda`` layers: Keras refuses to deserialize a Python lambda
  (``safe_mode``), cannot find a named function defined in a script, and a
  lambda re-created from its bytecode loses its globals (``keras``, ``np``);
  the rebuild uses the layer's own function object instead (the
  serialization comes from a model built in this process, so nothing
  untrusted is executed).
* Layer classes that are not registered with
  ``@keras.saving.register_keras_serializable()``: the rebuild uses the
  class object itself.
* What cannot work is refused by :func:`record` with a ValueError naming
  the layer and the fix: a layer whose ``get_config()`` does not give back
  its constructor arguments (``from_config`` fails), a config Keras cannot
  serialize to JSON, a custom function or object inside a layer's config
  that is not registered.

Example:
    >>> text, objects = record(model)          # in transform
    >>> full = rebuild(text, objects)          # in gather
"""
from __future__ import annotations

import json
import types

import keras
from keras.src.saving import serialization_lib

LIVE = "tfhybrid>live:"
_LAMBDA_FIELDS = ("function", "output_shape", "mask")
_FIX = ("register it with @keras.saving.register_keras_serializable() and give it a "
        "get_config() that returns every __init__ argument (the layer must satisfy "
        "type(layer).from_config(layer.get_config()))")


def _is_builtin(cls) -> bool:
    return (cls.__module__ or "").split(".")[0] == "keras"


def _walk(model, path=()):
    """(path, layer) of every layer, nested models included, in a fixed order."""
    for layer in getattr(model, "layers", ()):
        here = path + (layer.name,)
        yield here, layer
        if isinstance(layer, keras.Model) or hasattr(layer, "layers"):
            yield from _walk(layer, here)


def _lambda_key(path, field):
    return LIVE + "/".join(path) + "." + field


def live_objects(model, path=()) -> dict:
    """Name -> live class or function the rebuild of ``model`` needs here."""
    objects = {}
    items = list(_walk(model, path))
    if path:
        items.insert(0, (path, model))
    for path, layer in items:
        cls = type(layer)
        if not _is_builtin(cls):
            objects[keras.saving.get_registered_name(cls)] = cls
        objects.update(_attribute_objects(layer))
        if isinstance(layer, keras.layers.Lambda):
            for field, value in _lambda_callables(layer):
                objects[_lambda_key(path, field)] = value
    return objects


def _attribute_objects(layer) -> dict:
    """Unregistered functions (an ``activation=my_fn``) and custom objects (an
    initializer instance) held by a layer, by the name its config records."""
    out = {}
    for value in vars(layer).values():
        if isinstance(value, types.FunctionType) and not _is_builtin_fn(value):
            if not _shadows_builtin(value.__name__):
                out[value.__name__] = value
        elif hasattr(value, "get_config") and not isinstance(value, (keras.layers.Layer,
                                                                     type)):
            if not _is_builtin(type(value)):
                out[keras.saving.get_registered_name(type(value))] = type(value)
    return out


def _is_builtin_fn(fn) -> bool:
    return (getattr(fn, "__module__", "") or "").split(".")[0] in ("keras", "tensorflow")


def _shadows_builtin(name) -> bool:
    try:
        keras.activations.get(name)
        return True
    except Exception:  # noqa: BLE001 - not a Keras name: safe to map to the live function
        return False


def _lambda_callables(layer):
    values = {"function": layer.function, "output_shape": getattr(layer, "_output_shape", None),
              "mask": layer.mask}
    return [(f, values[f]) for f in _LAMBDA_FIELDS if callable(values[f])]


def _patch(config, objects, path=()):
    """Point every Lambda callable of a serialized layer or model (at ``path``,
    its own name included; () for the top model) at its live object, in place."""
    inner = config.get("config") if isinstance(config, dict) else None
    if not isinstance(inner, dict):
        return
    if config.get("class_name") == "Lambda":
        for field in _LAMBDA_FIELDS:
            key = _lambda_key(path, field)
            if key in objects:
                inner[field] = {"module": None, "class_name": "function", "config": key,
                                "registered_name": key}
        return
    for sub in inner.get("layers") or ():
        if isinstance(sub, dict) and isinstance(sub.get("config"), dict):
            _patch(sub, objects, path + (sub["config"].get("name"),))


def _deserialize(config, objects):
    with serialization_lib.SafeModeScope(False), keras.saving.custom_object_scope(objects):
        return keras.saving.deserialize_keras_object(config, custom_objects=objects,
                                                     safe_mode=False)


def _first_line(err) -> str:
    text = str(err).strip()
    for marker in ("Exception encountered: ", "Exception encountered:"):
        if marker in text:
            text = text.rsplit(marker, 1)[1]
    line = text.splitlines()[0] if text else type(err).__name__
    return line if len(line) <= 300 else line[:297] + "..."


def _layer_error(layer, what, err):
    cls = type(layer)
    if _is_builtin(cls):
        where, fix = "a Keras built-in layer", (
            "register the custom function or object in its config (activation, initializer, "
            "regularizer, ...) with @keras.saving.register_keras_serializable(), or give it "
            "a get_config()")
    else:
        where, fix = f"class {cls.__module__}.{cls.__qualname__}", (
            f"{_FIX}; a custom function or object in its config (activation, initializer, "
            "...) must be registered the same way")
    return ValueError(
        f"tfhybrid.transform cannot record layer {layer.name!r} ({cls.__name__}, {where}) for "
        f"tfhybrid.gather, which rebuilds the original model from its Keras serialization: "
        f"{what} ({type(err).__name__}: {_first_line(err)}). To fix, {fix}.")


def check_layer(layer, path, objects):
    """Raise the ValueError of :func:`record` when ``layer`` cannot be rebuilt."""
    try:
        config = keras.saving.serialize_keras_object(layer)
        json.dumps(config)
    except Exception as err:  # noqa: BLE001 - any failure means gather cannot rebuild it
        raise _layer_error(layer, "its config does not serialize to JSON", err) from None
    config.pop("build_config", None)    # no weights are allocated for the check
    config.pop("compile_config", None)
    _patch(config, objects, path)
    try:
        rebuilt = _deserialize(config, objects)
    except Exception as err:  # noqa: BLE001
        raise _layer_error(layer, "Keras cannot rebuild it from its config", err) from None
    if getattr(rebuilt, "name", layer.name) != layer.name:
        raise ValueError(
            f"tfhybrid.transform cannot record layer {layer.name!r} ({type(layer).__name__}) "
            f"for tfhybrid.gather: rebuilt from its get_config() it is named "
            f"{rebuilt.name!r}, so gather could not find it. To fix, start its get_config() "
            "with config = super().get_config() (which holds the name) and add its own "
            "__init__ arguments; pass **kwargs on to super().__init__().")


def record(model):
    """(JSON of ``model``'s Keras serialization, live objects) for :func:`rebuild`.

    Raises:
        ValueError: a layer gather could not rebuild (names the layer and the fix).
    """
    objects = live_objects(model)
    for path, layer in _walk(model):
        if len(path) == 1:       # nested models are rebuilt (and checked) as one layer
            check_layer(layer, path, objects)
    try:
        text = json.dumps(keras.saving.serialize_keras_object(model))
    except Exception as err:  # noqa: BLE001
        raise ValueError(f"tfhybrid.transform cannot record model {model.name!r} for "
                         f"tfhybrid.gather: its Keras serialization is not JSON "
                         f"({type(err).__name__}: {_first_line(err)}). To fix, make every "
                         "layer's get_config() return plain values.") from None
    return text, objects


def rebuild(text, objects=None):
    """The model serialized by :func:`record`, with fresh weights.

    Raises:
        ValueError: Keras could not rebuild it (names the cause and the fix).
    """
    objects = dict(objects or {})
    config = json.loads(text)
    _patch(config, objects)
    try:
        return _deserialize(config, objects)
    except Exception as err:  # noqa: BLE001
        raise ValueError(
            f"tfhybrid.gather cannot rebuild the original model from its Keras serialization "
            f"({type(err).__name__}: {_first_line(err)}). To fix, make every custom layer "
            f"rebuildable: {_FIX}.") from None


def copy_layer(layer, config):
    """``type(layer).from_config(config)`` for a layer of a model built in this
    process (Lambda layers, also inside a nested model, keep their own
    function objects; see the module doc)."""
    objects = live_objects(layer, (layer.name,))
    if not objects:
        return type(layer).from_config(config)
    _patch({"class_name": type(layer).__name__, "config": config}, objects, (layer.name,))
    with serialization_lib.SafeModeScope(False), keras.saving.custom_object_scope(objects):
        return type(layer).from_config(config)


def finalize_states(model_or_layer):
    """Recompute the derived state of layers whose weights were set directly
    (``set_weights``/``assign``), as Keras' own loading does: an adapted
    ``Normalization`` keeps its mean and variance as tensors computed from its
    weights by ``finalize_state`` (without it, a transformed or gathered model
    normalised with the freshly built layer's statistics: outputs 5e-3 off,
    under every strategy). Returns its argument."""
    layers = (model_or_layer._flatten_layers(include_self=True)
              if hasattr(model_or_layer, "_flatten_layers") else [model_or_layer])
    for layer in layers:
        finalize = getattr(layer, "finalize_state", None)
        if callable(finalize) and getattr(layer, "built", False):
            finalize()
    return model_or_layer
