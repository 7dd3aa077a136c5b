"""A plain description of a Keras model's layer graph, for the planner.

:func:`describe_graph` reads a Sequential or Functional Keras 3 model once and
returns a :class:`GraphSpec`: its layer calls in topological order, each as a
:class:`NodeSpec` holding only plain Python values (class name, shapes, the
few config fields the rules need). The planner in :mod:`.rules` and
:mod:`.planner` works on this description only, so planning is testable
without Horovod and without building any parallel layer.

Subclassed models (whose ``call`` is arbitrary Python) have no graph to
read and are rejected with a ValueError.
"""
from __future__ import annotations

import dataclasses
from typing import Dict, Optional, Tuple

import keras

_ATTRS = ("units", "filters", "kernel_size", "strides", "padding", "dilation_rate", "groups",
          "data_format", "activation", "use_bias", "pool_size", "rate", "seed", "axis",
          "cropping", "interpolation", "output_padding", "size", "shared_axes")


@dataclasses.dataclass(frozen=True)
class NodeSpec:
    """One layer call of the model.

    Attributes:
        name: Layer name (unique in the model).
        cls: Layer class name, e.g. ``"Dense"``.
        inputs: Ids of the tensors the call consumes, in call order.
        output: Id of the tensor it produces.
        in_shapes: Shapes of the inputs (batch axis first, None when unknown).
        out_shape: Shape of the output.
        attrs: Selected config fields (units, filters, activation, ...).
        n_params: Number of weights (trainable and not) of the layer.
        param_bytes: Bytes of the layer's trainable weights.
    """

    name: str
    cls: str
    inputs: Tuple[int, ...]
    output: int
    in_shapes: Tuple[tuple, ...]
    out_shape: tuple
    attrs: Dict[str, object] = dataclasses.field(default_factory=dict)
    n_params: int = 0
    param_bytes: int = 0

    def attr(self, key, default=None):
        """A config field of the layer (``default`` when absent)."""
        return self.attrs.get(key, default)

    @property
    def in_channels(self) -> Optional[int]:
        """Size of the last axis of the first input."""
        return self.in_shapes[0][-1] if self.in_shapes and self.in_shapes[0] else None


@dataclasses.dataclass(frozen=True)
class GraphSpec:
    """A model's layer calls in topological order.

    Attributes:
        name: Model name.
        nodes: The calls, producers before consumers.
        inputs: Tensor ids of the model inputs.
        outputs: Tensor ids of the model outputs.
    """

    name: str
    nodes: Tuple[NodeSpec, ...]
    inputs: Tuple[int, ...]
    outputs: Tuple[int, ...]

    def node(self, name: str) -> NodeSpec:
        """The node of layer ``name``."""
        for n in self.nodes:
            if n.name == name:
                return n
        raise KeyError(name)

    def consumers(self, tensor: int) -> Tuple[NodeSpec, ...]:
        """Nodes that consume ``tensor``."""
        return tuple(n for n in self.nodes if tensor in n.inputs)

    def names(self) -> Tuple[str, ...]:
        return tuple(n.name for n in self.nodes)


def as_functional(model, flatten=False):
    """``model`` as a Functional model sharing its layers (Sequential is rebuilt).

    With ``flatten``, models used as layers (a ``keras.applications`` base in
    transfer learning, a Sequential block) are inlined: see
    :func:`flatten_nested`.

    Raises:
        ValueError: for subclassed models or unbuilt Sequential models.
    """
    functional = _as_functional(model)
    if flatten and any(isinstance(layer, keras.Model) for layer in functional.layers):
        return flatten_nested(functional)
    return functional


def flatten_nested(model):
    """A Functional model calling the layers of every nested model directly.

    Each model used as a layer is replaced by its own layer calls (the same
    layer objects, so the same weights and ``trainable`` flags), recursively.
    The function is the same: Keras' Functional and Sequential pass the call's
    ``training`` on to their layers, as the flat model does. Layer names must
    stay unique across the levels (Keras only asks it per model).

    Raises:
        ValueError: a subclassed model used as a layer, or a layer name used
            at two levels.
    """
    from keras import tree

    def operation_fn(op):
        if isinstance(op, keras.Sequential):
            def call(x, *args, **kwargs):
                for layer in op.layers:
                    x = operation_fn(layer)(x)
                return x
            return call
        if isinstance(op, keras.Model):
            if not _is_functional(op):
                raise ValueError(
                    f"Layer {op.name!r} is a subclassed model ({type(op).__name__}) used as a "
                    "layer; tfhybrid.transform reads the layer graph of Sequential and "
                    "Functional models only. Rewrite it with the functional API.")

            def call(*args, **kwargs):
                inputs = args[0] if len(args) == 1 else list(args)
                return op._run_through_graph(inputs, operation_fn=operation_fn)
            return call
        return op

    names = {}
    for layer in _leaf_layers(model):
        other = names.setdefault(layer.name, layer)
        if other is not layer:
            raise ValueError(
                f"Model {model.name!r} has two layers named {layer.name!r} (one inside a "
                "model used as a layer): tfhybrid.transform inlines nested models and needs "
                "one name per layer. Rename one (e.g. keras.applications bases take "
                "name=...; layers take name=...).")
    inputs = tree.map_structure(
        lambda t: keras.Input(batch_shape=t.shape, dtype=t.dtype, name=t.name),
        model._inputs_struct)
    outputs = model._run_through_graph(inputs, operation_fn=operation_fn)
    return keras.Model(inputs, outputs, name=model.name)


def _leaf_layers(model):
    """The layers of ``model`` that are no models, inside nested models too, in order."""
    for layer in getattr(model, "layers", ()):
        if isinstance(layer, keras.Model):
            yield from _leaf_layers(layer)
        else:
            yield layer


def weighted_leaves(model):
    """The layers with weights of ``model``, inside nested models too, in order."""
    return (layer for layer in _leaf_layers(model) if layer.weights)


def set_trainable_flags(model, flags):
    """Set ``{layer name: trainable}`` on ``model``'s layers, nested ones included.

    A nested model becomes trainable when any of its layers is (Keras lists no
    trainable weights under a container whose own flag is False, whatever its
    layers' flags: a base frozen at transform and unfrozen since). Setting a
    container's flag sets its layers' flags, so containers go first (outer
    before inner), then the layers."""
    def containers(m):
        for layer in m.layers:
            if isinstance(layer, keras.Model):
                names = [leaf.name for leaf in weighted_leaves(layer)]
                layer.trainable = any(flags.get(n, True) for n in names) or not names
                containers(layer)

    containers(model)
    for name, flag in flags.items():
        find_nested_layer(model, name).trainable = bool(flag)


def find_nested_layer(model, name):
    """``model.get_layer(name)``, looking inside models used as layers too."""
    for layer in model.layers:
        if layer.name == name:
            return layer
    for layer in model.layers:
        if isinstance(layer, keras.Model):
            try:
                return find_nested_layer(layer, name)
            except ValueError:
                pass
    raise ValueError(f"No such layer: {name} in model {model.name!r}.")


def _as_functional(model):
    if not isinstance(model, keras.Model):
        raise TypeError(
            f"Received an invalid `model` of type {type(model).__name__} ({model!r:.60}); "
            "expected a built Keras 3 model (keras.Sequential or keras.Model(inputs, outputs))"
            ". tf.keras / Keras 2 models are not supported: build it with `import keras`.")
    if isinstance(model, keras.Sequential):
        if not model.built or not model.inputs:
            raise ValueError(
                f"Received an unbuilt Sequential model {model.name!r}; give it an "
                "`keras.Input(shape=...)` as first layer or call `model.build(input_shape)` "
                "before tfhybrid.transform.")
        x = inputs = keras.Input(batch_shape=model.inputs[0].shape, dtype=model.inputs[0].dtype,
                                 name=model.inputs[0].name)
        for layer in model.layers:
            x = layer(x)
        return keras.Model(inputs, x, name=model.name)
    if not _is_functional(model):
        raise ValueError(
            f"Received a subclassed model {model.name!r} ({type(model).__name__}); "
            "tfhybrid.transform reads the layer graph of Sequential and Functional models "
            "only. Rewrite it with the functional API (keras.Input + layer calls + "
            "keras.Model(inputs, outputs)), or build the parallel model by hand from "
            "tfhybrid.layers. For data parallelism alone no transform is needed: compile "
            "it with tfhybrid.DistributedOptimizer(optimizer), feed "
            "tfhybrid.data.shard(dataset) and pass callbacks=tfhybrid.callbacks.standard() "
            "to fit (as with Horovod).")
    return model


def _is_functional(model):
    from keras.src.models.functional import Functional

    return isinstance(model, Functional)


def describe_graph(model) -> GraphSpec:
    """The :class:`GraphSpec` of a Functional model (see :func:`as_functional`).

    Example:
        >>> spec = describe_graph(as_functional(model))
        >>> [n.cls for n in spec.nodes][:2]
        ['Conv2D', 'MaxPooling2D']
    """
    ids: Dict[int, int] = {}

    def tid(t):
        return ids.setdefault(id(t), len(ids))

    inputs = tuple(tid(t) for t in model.inputs)
    nodes, seen = [], set()
    for depth in sorted(model._nodes_by_depth, reverse=True):
        for node in model._nodes_by_depth[depth]:
            if not node.operation or node.is_input:
                continue
            nodes.append(_node_spec(node, tid, seen))
    outputs = tuple(tid(t) for t in model.outputs)
    return GraphSpec(model.name, tuple(nodes), inputs, outputs)


# keras.ops operations computed per element (``x / 255.0``, ``keras.ops.relu(x)``,
# ``a + b`` on tensors of one shape): any layout of their tensor inputs passes.
ELEMENTWISE_OPS = frozenset((
    "Abs", "Absolute", "Add", "Arccos", "Arccosh", "Arcsin", "Arcsinh", "Arctan", "Arctanh",
    "Cast", "Ceil", "Celu", "Clip", "Copy", "Cos", "Cosh", "Divide", "Elu", "Equal", "Erf",
    "Erfinv", "Exp", "Exp2", "Expm1", "Floor", "FloorDivide", "Gelu", "Greater",
    "GreaterEqual", "HardShrink", "HardSigmoid", "HardSilu", "HardTanh", "Heaviside", "Hypot",
    "LeakyRelu", "Less", "LessEqual", "Log", "Log10", "Log1p", "Log2", "LogSigmoid",
    "Logaddexp", "LogicalAnd", "LogicalNot", "LogicalOr", "Maximum", "Minimum", "Mod",
    "Multiply", "NanToNum", "Negative", "NotEqual", "Power", "Reciprocal", "Relu", "Relu6",
    "Round", "Rsqrt", "Selu", "Sigmoid", "Sign", "Signbit", "Silu", "Sin", "Sinc", "Sinh",
    "SoftShrink", "Softplus", "Softsign", "SparsePlus", "SparseSigmoid", "Sqrt", "Square",
    "Squareplus", "Subtract", "Tan", "Tanh", "TanhShrink", "TrueDivide", "Trunc", "Where"))


def is_operation(op) -> bool:
    """True for a functional-graph node that is a ``keras.ops`` operation
    (``x / 255.0``, ``keras.ops.relu(x)``), not a layer: no weights, no config
    of its own, reused as is by :mod:`.rewrite`."""
    return not isinstance(op, keras.layers.Layer)


def operation_kind(node) -> str:
    """How the planner treats a ``keras.ops`` node: ``"elementwise"`` (a
    per-element op of one tensor and scalars), ``"merge"`` (a per-element op of
    tensors of one shape and scalars), ``"concat"`` (``keras.ops.concatenate``
    of tensors of one rank: planned as a Concatenate layer of that axis) or
    ``"full"`` (anything else: its split inputs are gathered first, always
    correct)."""
    import numpy as np

    op = node.operation
    if not type(op).__module__.startswith("keras."):
        return "full"
    if type(op).__name__ == "Concatenate":   # keras.ops.concatenate: see rules.Concat
        ranks = {len(t.shape) for t in node.input_tensors}
        return "concat" if len(ranks) == 1 and isinstance(getattr(op, "axis", None), int) \
            else "full"
    if type(op).__name__ not in ELEMENTWISE_OPS:
        return "full"
    args = keras.tree.flatten((node.arguments.args, node.arguments.kwargs))
    for value in args:
        if isinstance(value, keras.KerasTensor) or value is None or isinstance(value, str):
            continue
        if np.size(value) != 1:          # a per-channel constant broadcast over a split
            return "full"
    shapes = {tuple(t.shape) for t in node.input_tensors}
    if len(shapes) != 1 or shapes != {tuple(node.outputs[0].shape)}:
        return "full"       # a broadcast, or keras.ops.where(condition): indices
    return "elementwise" if len(node.input_tensors) == 1 else "merge"


def _node_spec(node, tid, seen):
    layer = node.operation
    if is_operation(layer):
        return _operation_spec(node, tid)
    if layer.name in seen:
        raise ValueError(
            f"Layer {layer.name!r} ({type(layer).__name__}) is called more than once "
            "(a shared layer); tfhybrid.transform needs one call per layer. Use a "
            "separate layer per call.")
    seen.add(layer.name)
    if len(node.outputs) != 1:
        raise ValueError(f"Layer {layer.name!r} ({type(layer).__name__}) returns "
                         f"{len(node.outputs)} tensors; tfhybrid.transform supports layers "
                         "with one output.")
    config = layer.get_config() if hasattr(layer, "get_config") else {}
    attrs = {k: _plain(config[k]) for k in _ATTRS if k in config}
    if isinstance(layer, keras.Model):     # a model used as a layer (transfer learning)
        attrs["nested_model"] = True
    if any(base.__name__ == "DataLayer" for base in type(layer).__mro__):
        attrs["preprocessing"] = True      # Rescaling, Normalization, RandomFlip, Resizing...
    weights = list(layer.weights)
    return NodeSpec(
        name=layer.name, cls=type(layer).__name__,
        inputs=tuple(tid(t) for t in node.input_tensors), output=tid(node.outputs[0]),
        in_shapes=tuple(tuple(t.shape) for t in node.input_tensors),
        out_shape=tuple(node.outputs[0].shape), attrs=attrs,
        n_params=int(sum(_size(w) for w in weights)),
        param_bytes=int(sum(_size(w) * _itemsize(w) for w in layer.trainable_weights)))


def _operation_spec(node, tid):
    op = node.operation
    return NodeSpec(
        name=op.name, cls=type(op).__name__,
        inputs=tuple(tid(t) for t in node.input_tensors), output=tid(node.outputs[0]),
        in_shapes=tuple(tuple(t.shape) for t in node.input_tensors),
        out_shape=tuple(node.outputs[0].shape),
        attrs=_operation_attrs(node))


def _operation_attrs(node):
    kind = operation_kind(node)
    attrs = {"operation": kind}
    if kind == "concat":
        attrs["axis"] = node.operation.axis
    return attrs


def _plain(value):
    if isinstance(value, list):
        return tuple(value)
    if isinstance(value, dict):  # e.g. a serialized activation
        inner = value.get("config")
        if isinstance(inner, dict):
            return inner.get("name", value.get("class_name"))
        return inner if isinstance(inner, str) else value.get("class_name")  # a function
    return value


def _size(w):
    n = 1
    for d in w.shape:
        n *= int(d)
    return n


def _itemsize(w):
    import numpy as np

    return np.dtype(w.dtype).itemsize
