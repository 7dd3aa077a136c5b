"""Per-layer profile of a Keras 3 model: what the oracle's formulas consume.

:func:`profile` walks a Sequential or Functional model once and returns a
:class:`ModelProfile` whose rows give, per layer and per sample, the
quantities of ParaDL's notation (Table 2): parameters ``|w_l|`` and biases
``|bi_l|``, forward/backward FLOPs, input and output sizes ``|x_l|``,
``|y_l|``, input channels ``C_l``, filters ``F_l``, spatial extents, and
halo sizes for a split of the first spatial axis.

Approximations (what it ignores): FLOPs count multiply-adds as 2 and ignore
memory traffic, so element-wise layers are cheap on paper but not always in
practice (calibrated ``layer_times`` fix that); backward FLOPs are 2x forward
for layers with weights (input and weight gradients) and 1x otherwise; a
fused activation (``Dense(activation="relu")``) adds |y| forward and backward;
layers used several times (shared layers) are counted once per node call
only through their first call; nested models are profiled as one opaque
layer of kind ``"other"`` (their parameters are counted, not their FLOPs).

Example:
    >>> import keras
    >>> m = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4)])
    >>> prof = profile(m)
    >>> (prof.rows[0].kind, prof.rows[0].params, prof.rows[0].fwd_flops)
    ('dense', 36, 68)
"""
from __future__ import annotations

import dataclasses
import math
from typing import Sequence

_ELEMENTWISE = {"ReLU", "Activation", "LeakyReLU", "ELU", "PReLU", "Softmax", "Dropout",
                "SpatialDropout2D", "SpatialDropout3D", "GaussianNoise", "Rescaling",
                "Normalization"}
_RESHAPE = {"Flatten", "Reshape", "ZeroPadding2D", "ZeroPadding3D", "ZeroPadding1D",
            "Permute", "Cropping2D", "Cropping3D", "InputLayer", "Identity"}
_MERGE = {"Add", "Concatenate", "Multiply", "Average", "Maximum", "Subtract"}


@dataclasses.dataclass(frozen=True)
class LayerRow:
    """One layer of a profile; sizes are per sample, in items (not bytes).

    Attributes:
        name: Layer name.
        kind: One of conv, dense, pool, norm, elementwise, merge, reshape,
            input, other.
        params: All trainable and non-trainable parameters.
        weights: ``|w_l|`` (kernel items; all params but biases).
        biases: ``|bi_l|``.
        fwd_flops / bwd_flops: FLOPs for one sample.
        x / y: ``|x_l|`` / ``|y_l|`` items per sample (x sums all inputs).
        channels / filters: ``C_l`` / ``F_l`` (last axis of input / output).
        spatial_in / spatial_out: spatial extents (H, W[, D]) or ().
        kernel / strides: spatial kernel (dilation included) and strides.
        halo_x / halo_dy: items per sample one rank sends to one neighbour
            for ``x`` (forward) and ``dL/dy`` (backward) when the first
            spatial axis is split (0 when the kernel needs no halo).
        ccr: SplitBrain's computation-to-communication ratio for dense
            layers: (fwd+bwd FLOPs) / (|x| + |y|) items exchanged per sample.
        batch_stats: A BatchNormalization (its training moments are
            synchronized over the ranks that split the batch).
        global_pool: ``"average"`` or ``"max"`` for a channels-last
            GlobalAveragePooling2D/3D or GlobalMaxPooling2D/3D (under s/ds it
            pools the blocks and combines their sums or maxima: no gather),
            else ``""``.

    Example:
        >>> LayerRow("fc", "dense", 36, 32, 4, 72, 144, 8, 4, 8, 4).filters
        4
    """

    name: str
    kind: str
    params: int
    weights: int
    biases: int
    fwd_flops: float
    bwd_flops: float
    x: int
    y: int
    channels: int
    filters: int
    spatial_in: tuple = ()
    spatial_out: tuple = ()
    kernel: tuple = ()
    strides: tuple = ()
    halo_x: int = 0
    halo_dy: int = 0
    ccr: float = 0.0
    batch_stats: bool = False
    global_pool: str = ""

    @property
    def has_weights(self) -> bool:
        return self.weights > 0

    def halo_for(self, axis_splits: Sequence[int]) -> tuple:
        """(halo_x, halo_dy) items per sample for a split of the spatial axes.

        ``axis_splits`` gives the number of blocks along each spatial axis;
        the halo of one rank is the sum over split axes of one face.

        Example:
            >>> r = LayerRow("c", "conv", 0, 0, 0, 0, 0, 64, 64, 1, 1, (8, 8), (8, 8), (3, 3), (1, 1))
            >>> r.halo_for((2, 1))
            (8, 8)
        """
        hx = hdy = 0
        for axis, parts in enumerate(axis_splits):
            if parts <= 1 or axis >= len(self.kernel):
                continue
            rows = _halo_rows(self.kernel[axis], self.strides[axis])
            if rows == 0:
                continue
            face_in = self.x // max(self.spatial_in[axis], 1)
            face_out = self.y // max(self.spatial_out[axis], 1)
            hx += rows * face_in
            hdy += math.ceil(rows / self.strides[axis]) * face_out
        return hx, hdy


def _halo_rows(k: int, s: int) -> int:
    """Rows one block needs from one neighbour: ceil((k - s) / 2), at least 0."""
    return max(0, math.ceil((k - s) / 2))


@dataclasses.dataclass(frozen=True)
class ModelProfile:
    """The rows of a model plus its input size.

    ``split`` (optional, one bool per row) is a layer configuration (ParaDL's
    ``.lc`` files): when given, filter/channel/spatial strategies split only
    the rows marked True and run the others replicated.

    Example:
        >>> import keras
        >>> p = profile(keras.Sequential([keras.Input((8,)), keras.layers.Dense(4)]))
        >>> p.total_params, p.input_items
        (36, 8)
    """

    name: str
    rows: tuple
    input_items: int
    split: tuple | None = None

    @property
    def total_params(self) -> int:
        return sum(r.params for r in self.rows)

    @property
    def total_weights(self) -> int:
        return sum(r.weights for r in self.rows)

    @property
    def total_fwd_flops(self) -> float:
        return sum(r.fwd_flops for r in self.rows)

    def index(self, name: str) -> int:
        """Position of the row called ``name`` (ValueError if absent)."""
        for i, r in enumerate(self.rows):
            if r.name == name:
                return i
        raise ValueError(f"No layer named {name!r} in profile {self.name!r}.")

    def to_dicts(self) -> list:
        """Rows as plain dicts (for JSON)."""
        return [dataclasses.asdict(r) for r in self.rows]


def _shape_of(t):
    return tuple(int(d) if d is not None else 1 for d in t.shape[1:])


def _items(shape) -> int:
    return int(math.prod(shape)) if shape else 1


def _io(layer):
    ins = layer.input if isinstance(layer.input, (list, tuple)) else [layer.input]
    outs = layer.output if isinstance(layer.output, (list, tuple)) else [layer.output]
    return [_shape_of(t) for t in ins], [_shape_of(t) for t in outs]


def _param_split(layer):
    total = sum(int(math.prod(w.shape)) for w in layer.weights)
    biases = sum(int(math.prod(w.shape)) for w in layer.weights
                 if w.path.endswith("bias") or w.name == "bias")
    return total, biases


def _fused_activation(layer) -> bool:
    act = getattr(layer, "activation", None)
    name = getattr(act, "__name__", "linear")
    return layer.__class__.__name__ not in ("Activation",) and name not in ("linear", None)


def _conv_row(layer, xs, ys, total, biases):
    x, y = xs[0], ys[0]
    spatial_in, spatial_out = x[:-1], y[:-1]
    c, f = x[-1], y[-1]
    groups = int(getattr(layer, "groups", 1) or 1)
    cls = layer.__class__.__name__
    rate = tuple(getattr(layer, "dilation_rate", (1,) * len(spatial_in)))
    ksize = tuple(layer.kernel_size)
    kernel = tuple((k - 1) * d + 1 for k, d in zip(ksize, rate))
    strides = tuple(layer.strides)
    out_pts = _items(spatial_out)
    if cls.startswith("Depthwise"):
        macs = math.prod(ksize) * f * out_pts
    elif cls.startswith("Separable"):
        macs = math.prod(ksize) * c * out_pts + c * f * out_pts
    else:
        macs = math.prod(ksize) * (c // groups) * f * out_pts
    fwd = 2 * macs + (_items(y) if biases else 0)
    return dict(kind="conv", fwd_flops=fwd, bwd_flops=2 * fwd, channels=c, filters=f,
                spatial_in=spatial_in, spatial_out=spatial_out, kernel=kernel, strides=strides)


def _dense_row(layer, xs, ys, total, biases):
    x, y = xs[0], ys[0]
    rows = _items(x[:-1])
    fwd = 2 * x[-1] * y[-1] * rows + (_items(y) if biases else 0)
    ccr = 3 * fwd / max(_items(x) + _items(y), 1)
    return dict(kind="dense", fwd_flops=fwd, bwd_flops=2 * fwd, channels=x[-1],
                filters=y[-1], ccr=ccr)


def _pool_row(layer, xs, ys, total, biases):
    x, y = xs[0], ys[0]
    cls = layer.__class__.__name__
    if cls.startswith("Global"):
        kind = "average" if cls.startswith("GlobalAverage") else "max"
        on_blocks = getattr(layer, "data_format", "channels_last") == "channels_last" \
            and len(x) in (3, 4)     # 2-D and 3-D: what s/ds split
        return dict(kind="pool", fwd_flops=_items(x), bwd_flops=_items(x), channels=x[-1],
                    filters=y[-1], spatial_in=x[:-1], spatial_out=(),
                    global_pool=kind if on_blocks else "")
    pool = tuple(layer.pool_size)
    strides = tuple(layer.strides or pool)
    fwd = _items(y) * math.prod(pool)
    return dict(kind="pool", fwd_flops=fwd, bwd_flops=_items(x), channels=x[-1], filters=y[-1],
                spatial_in=x[:-1], spatial_out=y[:-1], kernel=pool, strides=strides)


def _simple_row(kind, fwd_per_y, bwd_per_y):
    def build(layer, xs, ys, total, biases):
        y = sum(_items(s) for s in ys)
        n_in = len(xs)
        mult = max(n_in - 1, 1) if kind == "merge" else 1
        return dict(kind=kind, fwd_flops=fwd_per_y * y * mult, bwd_flops=bwd_per_y * y * mult,
                    channels=xs[0][-1] if xs[0] else 1, filters=ys[0][-1] if ys[0] else 1,
                    spatial_in=xs[0][:-1], spatial_out=ys[0][:-1])
    return build


def _batch_norm_row(layer, xs, ys, total, biases):
    row = _simple_row("norm", 4, 8)(layer, xs, ys, total, biases)
    row["batch_stats"] = True
    return row


def _classify(layer):
    cls = layer.__class__.__name__
    if "Conv" in cls and hasattr(layer, "kernel_size"):
        return _conv_row
    if cls in ("Dense", "EinsumDense"):
        return _dense_row
    if "Pooling" in cls:
        return _pool_row
    if "BatchNormalization" in cls:
        return _batch_norm_row
    if "Normalization" in cls and cls != "Normalization":
        return _simple_row("norm", 4, 8)
    if cls in _ELEMENTWISE:
        return _simple_row("elementwise", 1, 1)
    if cls in _MERGE:
        return _simple_row("merge", 1, 1)
    if cls in _RESHAPE:
        return _simple_row("input" if cls == "InputLayer" else "reshape", 0, 0)
    return _simple_row("other", 0, 0)


def profile_layer(layer) -> LayerRow:
    """Profile one built Keras layer (it must have been called on a tensor).

    Example:
        >>> import keras
        >>> m = keras.Sequential([keras.Input((8, 8, 3)), keras.layers.Conv2D(4, 3, padding="same")])
        >>> profile_layer(m.layers[0]).halo_x
        24
    """
    xs, ys = _io(layer)
    total, biases = _param_split(layer)
    info = _classify(layer)(layer, xs, ys, total, biases)
    if info["kind"] in ("conv", "dense") and _fused_activation(layer):
        extra = sum(_items(s) for s in ys)
        info["fwd_flops"] += extra
        info["bwd_flops"] += extra
    row = LayerRow(name=layer.name, params=total, weights=total - biases, biases=biases,
                   x=sum(_items(s) for s in xs), y=sum(_items(s) for s in ys), **info)
    if row.kernel:
        hx, hdy = row.halo_for((2,) + (1,) * (len(row.kernel) - 1))
        row = dataclasses.replace(row, halo_x=hx, halo_dy=hdy)
    return row


def profile(model) -> ModelProfile:
    """Profile a built Keras 3 Sequential or Functional model per layer.

    Args:
        model: A ``keras.Model`` whose layers have known input shapes (build it
            with ``keras.Input`` or call it once). A :class:`ModelProfile` is
            returned unchanged.

    Returns:
        A :class:`ModelProfile` with one :class:`LayerRow` per layer (input
        layers are skipped), in the model's layer order.

    Raises:
        TypeError: ``model`` is not a Keras model.
        ValueError: the model is not built (no input shapes).

    Example:
        >>> import keras
        >>> m = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2, activation="relu")])
        >>> [r.kind for r in profile(m).rows]
        ['dense']
    """
    if isinstance(model, ModelProfile):
        return model
    import keras  # noqa: WPS433 (Keras only here, to walk the model)

    if not isinstance(model, keras.Model):
        raise TypeError(f"profile() expects a keras.Model or ModelProfile; received "
                        f"{type(model).__name__}.")
    try:
        inputs = model.inputs
    except (AttributeError, ValueError):
        inputs = None
    if not inputs:
        raise ValueError(f"Model {model.name!r} is not built: create it with keras.Input(...) "
                         "or call it on a batch before profiling.")
    if any(isinstance(layer, keras.Model) for layer in model.layers):
        from tfhybrid import hooks    # a base in transfer learning: its layers, as transform
        model = hooks.call("as_functional", model, flatten=True)   # sees them (transformer.graph)
    rows = tuple(profile_layer(layer) for layer in model.layers
                 if layer.__class__.__name__ != "InputLayer")
    input_items = sum(_items(_shape_of(t)) for t in inputs)
    return ModelProfile(name=model.name, rows=rows, input_items=input_items)
