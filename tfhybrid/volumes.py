"""Sharded volume input: every rank reads only its block of every sample.

A volume too large for one device (ParaDL's CosmoFlow: one 4x512^3 sample)
must not be loaded whole by every rank only to keep a block of it.
:func:`volumes` (``tfhybrid.data.volumes``) reads, for each global batch,
this rank's rows (the data split of :func:`tfhybrid.data.shard`) and of
each of them only this rank's spatial block (the block grid the transformed
model's input ``SpatialScatter`` would keep), straight from

* one ``.npy`` file of all samples ``(N, D, H, W, C)``, memory-mapped
  (``np.load(mmap_mode="r")``): a block is one slice of the map;
* a directory (or glob pattern, or list) of per-sample ``.npy`` files
  ``(D, H, W, C)``, each memory-mapped when read;
* any array-like with ``shape``, ``dtype`` and numpy slicing (a numpy array
  or memmap, an ``h5py`` dataset: h5py reads only the slice; h5py itself is
  never imported here).

Labels come from the same kinds of sources: per-voxel labels (the volume's
spatial axes, with or without a channel axis) are split like the model's
output (a block when the transformed model's output is a block, whole when
it is gathered); per-sample labels (CosmoFlow's regression targets) are read
as rows.

The transformed model is made to accept the blocks: its input
``SpatialScatter`` becomes a :class:`BlockInputScatter`, which splits a full
volume as before and passes a block through (decided per axis by the
static size), and the model's input check accepts either size. Only the
ranks of a model group that hold the same sample rows feed different
blocks, so the guards' same-rows check is skipped for such a model.
"""
from __future__ import annotations

import dataclasses
import glob
import math
import os
from typing import Optional, Tuple

import numpy as np
import tensorflow as tf

from tfhybrid import runtime
from tfhybrid import spatial_geometry as sp

WHERE = "tfhybrid.data.volumes"


# -- sources ---------------------------------------------------------------------

class ArraySource:
    """Samples along axis 0 of one array-like (numpy array, ``.npy`` memmap, h5py dataset).

    ``read(i, region)`` slices ``array[i][region]`` in one indexing call, so
    a memory map or an h5py dataset reads only the block.
    """

    def __init__(self, array, label):
        self.array, self.label = array, label
        self.n = int(array.shape[0])
        self.sample_shape = tuple(int(s) for s in array.shape[1:])
        self.dtype = np.dtype(array.dtype)

    def read(self, i, region):
        return np.asarray(self.array[(int(i),) + tuple(region)])


class NpySource(ArraySource):
    """All samples in one ``.npy`` file, memory-mapped anew for every read.

    Each read maps the file, copies one sample's block out and drops the
    map, so the pages touched do not stay in this process's resident set.
    """

    def __init__(self, path, label):
        self.path = path
        super().__init__(np.load(path, mmap_mode="r"), label)
        self.array = None          # no long-lived map

    def read(self, i, region):
        mapped = np.load(self.path, mmap_mode="r")
        return np.array(mapped[(int(i),) + tuple(region)])


class FileSource:
    """One ``.npy`` file per sample; each is memory-mapped and sliced when read."""

    def __init__(self, files, label):
        self.files, self.label = [os.fspath(f) for f in files], label
        first = np.load(self.files[0], mmap_mode="r")
        self.n = len(self.files)
        self.sample_shape = tuple(int(s) for s in first.shape)
        self.dtype = np.dtype(first.dtype)
        del first

    def read(self, i, region):
        path = self.files[int(i)]
        sample = np.load(path, mmap_mode="r")
        if tuple(sample.shape) != self.sample_shape or sample.dtype != self.dtype:
            raise ValueError(
                f"{WHERE}: {self.label} file {path!r} holds an array of shape "
                f"{tuple(sample.shape)} and dtype {sample.dtype}, but the first file "
                f"{self.files[0]!r} holds {self.sample_shape} {self.dtype}; every per-sample "
                "file must hold one sample of the same shape and dtype.")
        return np.array(sample[tuple(region)])     # a copy of the block; the map is closed


def _is_pattern(text):
    return any(c in text for c in "*?[")


def open_source(source, label="inputs"):
    """The :class:`ArraySource`/:class:`FileSource` of one ``volumes`` argument.

    Raises:
        ValueError: for a path that is neither a ``.npy`` file, a directory of
            them nor a glob pattern matching some, or an empty list.
        TypeError: for any other kind of value.
    """
    if isinstance(source, (str, bytes, os.PathLike)):
        path = os.fsdecode(source)
        if os.path.isdir(path):
            files = sorted(glob.glob(os.path.join(path, "*.npy")))
            if not files:
                raise ValueError(f"{WHERE}: Received {label}={path!r}, a directory without "
                                 ".npy files; expected one .npy file per sample in it.")
            return FileSource(files, label)
        if _is_pattern(path):
            files = sorted(glob.glob(path))
            if not files:
                raise ValueError(f"{WHERE}: Received {label}={path!r}, a pattern that matches "
                                 "no file; expected one .npy file per sample.")
            return FileSource(files, label)
        if path.endswith(".npy") and os.path.isfile(path):
            return NpySource(path, label)
        raise ValueError(f"{WHERE}: Received {label}={path!r}; expected an existing .npy file "
                         "of all samples (N, ...), a directory of per-sample .npy files or a "
                         "glob pattern of them.")
    if isinstance(source, (list, tuple)):
        if not source or not all(isinstance(f, (str, bytes, os.PathLike)) for f in source):
            raise ValueError(f"{WHERE}: Received {label} as a {type(source).__name__} of "
                             f"{len(source)} items; expected a non-empty list of per-sample "
                             ".npy file names.")
        return FileSource(source, label)
    if all(hasattr(source, a) for a in ("shape", "dtype", "__getitem__")) and \
            len(getattr(source, "shape", ())) >= 1:
        return ArraySource(source, label)
    raise TypeError(f"{WHERE}: Received {label} of type {type(source).__name__}; expected a "
                    ".npy path, a directory/pattern/list of per-sample .npy files, or an "
                    "array-like (numpy array, memmap, h5py dataset).")


# -- who reads what ----------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class VolumeLayout:
    """What this rank reads of every global batch.

    Attributes:
        blocks: Number of row blocks a global batch is split into.
        index: This rank's row block.
        parts: Spatial block grid of the input (one entry per spatial axis;
            all 1 when the model takes whole volumes).
        coords: This rank's block coordinate along each spatial axis.
        label_parts: Block grid of per-voxel labels (all 1: whole).
        label_coords: This rank's block coordinate in ``label_parts``
            (default: ``coords``).
    """

    blocks: int
    index: int
    parts: Tuple[int, ...]
    coords: Tuple[int, ...]
    label_parts: Tuple[int, ...]
    label_coords: Optional[Tuple[int, ...]] = None

    def rows(self, batch_size):
        """This rank's rows ``[start, stop)`` of a global batch."""
        local = batch_size // self.blocks
        return self.index * local, (self.index + 1) * local

    @staticmethod
    def _region(shape, parts, coords, what):
        region = []
        for d, (size, k, c) in enumerate(zip(shape, parts, coords)):
            if size % k:
                axis = sp.SPATIAL_AXES.get(len(parts), [f"axis {i + 1}" for i in
                                                        range(len(parts))])[d]
                raise ValueError(
                    f"{WHERE}: the {what} of spatial shape {tuple(shape)} cannot be split over "
                    f"the {'x'.join(map(str, parts))} block grid: {axis}={size} is not "
                    f"divisible by {k}; use a multiple of {k} "
                    f"(e.g. {size - size % k or k} or {size - size % k + k}), or another grid.")
            n, c = size // k, c if k > 1 else 0        # whole along unsplit axes
            region.append(slice(c * n, (c + 1) * n))
        return tuple(region)

    def input_region(self, sample_shape):
        """Slices of one input sample (spatial axes, then the whole channel axis)."""
        ndim = len(self.parts)
        spatial = self._region(sample_shape[:ndim], self.parts, self.coords, "input")
        return spatial + (slice(None),) * (len(sample_shape) - ndim)

    def label_region(self, sample_shape):
        """Slices of one label sample: a block of per-voxel labels, else all of it."""
        ndim = len(self.parts)
        if len(sample_shape) < ndim:      # per-sample labels (e.g. regression targets)
            return (slice(None),) * len(sample_shape)
        coords = self.coords if self.label_coords is None else self.label_coords
        spatial = self._region(sample_shape[:ndim], self.label_parts, coords, "labels")
        return spatial + (slice(None),) * (len(sample_shape) - ndim)

    @staticmethod
    def block_shape(sample_shape, region):
        """The shape of ``sample[region]`` (slices with explicit bounds or ``:``)."""
        return tuple(len(range(*s.indices(n))) for s, n in zip(region, sample_shape))


def input_scatter(model):
    """The ``SpatialScatter`` that alone consumes ``model``'s single input, or None.

    Only then can the model be fed blocks: another consumer of the input
    (a replicated layer, a skip connection) needs the whole volume.
    """
    from tfhybrid.layers.spatial.io import SpatialScatter

    inputs = getattr(model, "inputs", None)
    if not inputs or len(inputs) != 1:
        return None
    source = inputs[0]
    consumers = []
    for layer in model.layers:
        for node in getattr(layer, "_inbound_nodes", []):
            if any(t is source for t in tf.nest.flatten(node.input_tensors)):
                consumers.append(layer)
    if len(consumers) == 1 and isinstance(consumers[0], SpatialScatter):
        return consumers[0]
    return None


def _model_ndim(model):
    inputs = getattr(model, "inputs", None)
    if not inputs or len(inputs) != 1:
        raise ValueError(f"{WHERE}: Received model {getattr(model, 'name', model)!r} with "
                         f"{len(inputs or [])} inputs; volumes feeds models of one volume "
                         "input (batch, spatial..., channels).")
    return len(inputs[0].shape) - 2


def _model_grid(model, scatter, ndim):
    grid = runtime.current_grid()
    if scatter is None:
        return (1,) * ndim
    return sp.grid_shape(scatter.split, ndim, grid.model_size, f"{WHERE} (model input)")


def _output_label_parts(model, parts, label_shape, output=0):
    """Per axis, the split of per-voxel labels the model's output number ``output``
    expects (1: whole)."""
    outputs = getattr(model, "outputs", None) or []
    ndim = len(parts)
    from tfhybrid.layers.spatial.output import split_outputs_of

    split = split_outputs_of(model)
    if split is not None:     # per-voxel outputs kept in spatial blocks (U-Nets under s/ds)
        flags, grid = split
        whole = output >= len(flags) or not flags[output]
        return (1,) * ndim if whole else tuple(int(k) for k in grid)
    if len(outputs) != 1 or len(outputs[0].shape) < ndim + 1:
        return (1,) * ndim
    out = outputs[0].shape[1:ndim + 1]
    result = []
    for d, (size, k) in enumerate(zip(label_shape[:ndim], parts)):
        if out[d] is None or out[d] == size or k == 1:
            result.append(1)
        elif out[d] * k == size:
            result.append(k)
        else:
            raise ValueError(
                f"{WHERE}: per-voxel labels of spatial shape {tuple(label_shape[:ndim])} do "
                f"not match the model's output {tuple(outputs[0].shape)} (this rank's block "
                f"of a {'x'.join(map(str, parts))} grid): along axis {d + 1} the labels hold "
                f"{size}, the output {out[d]} per rank. Give labels of the model's global "
                "output shape.")
    return tuple(result)


def plan(model=None, spatial=None, ndim=3, label_shape=None, split_labels=None, output=0):
    """The :class:`VolumeLayout` of this rank (pure: no collective, no reading).

    Args:
        model: The transformed model (or None): its batch split and its input
            block grid (when a ``SpatialScatter`` alone consumes its input).
        spatial: Without a model, the block grid over the model group
            (``"depth"``, ``(pd, ph, pw)``, ...); with one, it must agree.
        ndim: Number of spatial axes (ignored with a model).
        label_shape: Shape of one label sample (None: no labels).
        split_labels: Per-voxel labels split like the input (True), whole
            (False), or None: as the model's output (whole without a model).
        output: The model output the labels belong to (models of several outputs).

    Raises:
        ValueError: for a ``spatial`` that disagrees with the model or does
            not fit the model group.
    """
    from tfhybrid.data import batch_split

    grid = runtime.current_grid()
    blocks, index = batch_split(model)
    if model is not None:
        ndim = _model_ndim(model)
        scatter = input_scatter(model)
        parts = _model_grid(model, scatter, ndim)
        if spatial is not None:
            wanted = sp.spatial_grid(spatial, grid.model_size, "s", ndim)
            if tuple(wanted) != tuple(parts):
                raise ValueError(
                    f"{WHERE}: Received spatial={spatial!r} (grid {wanted}) but the model "
                    f"{model.name!r} splits its input over the grid {parts}. Omit spatial= "
                    "with model= (the model's split is used).")
    elif spatial is not None:
        parts = sp.spatial_grid(spatial, grid.model_size, "s", ndim)
    else:
        parts = (1,) * ndim
    parts = tuple(int(p) for p in parts)
    coords = _coords(grid, parts)
    label_parts = (1,) * ndim
    if label_shape is not None and len(label_shape) >= ndim:
        if split_labels is None:
            label_parts = (_output_label_parts(model, parts, label_shape, output)
                           if model is not None else (1,) * ndim)
        elif split_labels:
            label_parts = parts
    label_parts = tuple(int(k) for k in label_parts)
    return VolumeLayout(blocks, index, parts, coords, label_parts, _coords(grid, label_parts))


def _coords(grid, parts):
    """This rank's block coordinate in the row-major block grid ``parts`` of its model group."""
    if math.prod(parts) > 1:
        return tuple(g.index for g in grid.subgroups(parts))
    return (0,) * len(parts)


# -- the model side: accept blocks ------------------------------------------------

def _block_input_class():
    from tfhybrid import comm
    from tfhybrid.layers.spatial.io import SpatialScatter

    import keras

    @keras.saving.register_keras_serializable(package="tfhybrid")
    class BlockInputScatter(SpatialScatter):
        """A ``SpatialScatter`` that also accepts this rank's block.

        Along each split axis, an input of the global size is split as by
        ``SpatialScatter``; an input of the block size is this rank's block
        already (fed by :func:`tfhybrid.data.volumes`) and passes through.
        """

        def __init__(self, *args, full_shape=None, **kwargs):
            super().__init__(*args, **kwargs)
            self.full_shape = None if full_shape is None else tuple(full_shape)

        def call(self, inputs):
            for axis, g in self._axes():
                size = inputs.shape[axis]
                full = self.full_shape[axis] if self.full_shape else None
                if size is not None and full is not None and size * g.size == full:
                    continue                           # already this rank's block
                inputs = comm.split(inputs, axis, g, name=f"{self.name}.split")
            return inputs

        def compute_output_shape(self, input_shape):
            shape = list(input_shape)
            for d, k in enumerate(self._grid_shape()):
                full = self.full_shape[d + 1] if self.full_shape else None
                if shape[d + 1] is not None and not (full and shape[d + 1] * k == full):
                    shape[d + 1] //= k
            return tuple(shape)

        def get_config(self):
            config = super().get_config()
            config["full_shape"] = list(self.full_shape) if self.full_shape else None
            return config

    return BlockInputScatter


_CLASSES = {}


def block_input_scatter_class():
    """The :class:`BlockInputScatter` class (built once, on first use)."""
    if "scatter" not in _CLASSES:
        _CLASSES["scatter"] = _block_input_class()
    return _CLASSES["scatter"]


def accept_blocks(model):
    """Make transformed ``model`` accept this rank's spatial block of its input.

    Its input ``SpatialScatter`` becomes a ``BlockInputScatter`` (a full
    volume is still split; a block passes through), the model's input check
    leaves the split axes' sizes open, and the guards' same-rows check is
    skipped (the ranks of a model group then feed different blocks of the
    same rows). Idempotent. Returns True when the model takes blocks.
    """
    import keras

    scatter = input_scatter(model)
    if scatter is None:
        return False
    cls = block_input_scatter_class()
    full = tuple(model.inputs[0].shape)
    if not isinstance(scatter, cls):
        scatter.__class__ = cls
        scatter.full_shape = full
    parts = _model_grid(model, scatter, len(full) - 2)
    open_shape = [None] + [None if k > 1 else s for s, k in zip(full[1:-1], parts)] + [full[-1]]
    model.input_spec = [keras.layers.InputSpec(shape=tuple(open_shape),
                                               allow_last_axis_squeeze=True)]
    object.__setattr__(model, "_tfhybrid_block_input", True)
    return True


# -- the dataset -------------------------------------------------------------------

def _check_batch_size(batch_size, blocks, n):
    from tfhybrid.data import _divisible_error

    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"{WHERE}: Received an invalid value for `batch_size`: "
                         f"{batch_size!r}; expected the global batch size (a positive "
                         "integer).")
    if batch_size % blocks:
        raise ValueError(f"{WHERE}: " + _divisible_error(batch_size, blocks))
    if n < batch_size:
        raise ValueError(f"{WHERE}: Received batch_size={batch_size} for {n} samples; the "
                         f"global batch must not exceed the number of samples (use at most "
                         f"{n}).")


def _shuffle_buffer(shuffle, n):
    if shuffle is None or shuffle is False:
        return None
    if shuffle is True:
        return n
    if isinstance(shuffle, int) and shuffle >= 1:
        return shuffle
    raise ValueError(f"{WHERE}: Received an invalid value for `shuffle`: {shuffle!r}; "
                     "expected True (a full shuffle of the samples every epoch), False, or a "
                     "shuffle buffer size in samples (a positive integer).")


def _open_sources(x, y, sample_weight, model):
    """``(x source, label sources, weight sources, several, several_w)`` of ``volumes``'
    arguments, checked to hold the same samples; ``several``: one label source per
    output, ``several_w``: one weight source per output."""
    xs = open_source(x, "x")
    # a tuple of sources, one per output (a tuple of paths of a one-output model
    # stays one source of per-sample files)
    several = isinstance(y, tuple) and (
        len(getattr(model, "outputs", None) or []) > 1 or
        not all(isinstance(v, (str, bytes, os.PathLike)) for v in y))
    labels = [open_source(v, f"y[{i}]" if several else "y")
              for i, v in enumerate(y if several else ([] if y is None else [y]))]
    if sample_weight is not None and not labels:
        raise ValueError(f"{WHERE}: Received sample_weight without y; give the labels "
                         "(y=...) the weights apply to.")
    several_w = several and isinstance(sample_weight, tuple)
    weights = [open_source(v, f"sample_weight[{i}]" if several_w else "sample_weight")
               for i, v in enumerate(sample_weight if several_w else
                                     ([] if sample_weight is None else [sample_weight]))]
    if several_w and len(weights) != len(labels):
        raise ValueError(f"{WHERE}: Received {len(weights)} sample_weight sources for "
                         f"{len(labels)} label sources; give one per output.")
    for src in labels + weights:
        if src.n != xs.n:
            raise ValueError(f"{WHERE}: Received x of {xs.n} samples and {src.label} of "
                             f"{src.n}; x and {src.label} must hold the same samples.")
    return xs, labels, weights, several, several_w


def _input_ndim(xs, model):
    """The number of spatial axes of the samples of ``xs``; raises ValueError unless they
    are volumes or images of ``model``'s input shape (when a model is given)."""
    ndim = len(xs.sample_shape) - 1
    if ndim not in sp.SPATIAL_AXES:
        raise ValueError(f"{WHERE}: Received x with samples of shape {xs.sample_shape}; "
                         "expected (D, H, W, C) volumes or (H, W, C) images, one row per "
                         "sample.")
    if model is not None:
        expected = tuple(model.inputs[0].shape[1:]) if getattr(model, "inputs", None) else None
        if expected is not None and tuple(xs.sample_shape) != tuple(
                s if s is not None else xs.sample_shape[i] for i, s in enumerate(expected)):
            raise ValueError(f"{WHERE}: Received x with samples of shape {xs.sample_shape}, "
                             f"but model {model.name!r} takes {expected}; give the whole "
                             "volumes of the model's input shape.")
    return ndim


def _regions(xs, labels, weights, layout, model, spatial, ndim, split_labels):
    """``[(source, region)]``: the input's block, then each output's labels and weights
    cut as that output is split (:func:`plan` with ``output=``)."""
    sources = [(xs, layout.input_region(xs.sample_shape))]
    for i, src in enumerate(labels):
        lay = layout if i == 0 else plan(model, spatial, ndim, src.sample_shape, split_labels,
                                         output=i)
        sources.append((src, lay.label_region(src.sample_shape)))
    for i, src in enumerate(weights):    # cut like the labels of their output
        lay = plan(model, spatial, ndim, src.sample_shape, split_labels, output=i)
        sources.append((src, lay.label_region(src.sample_shape)))
    return sources


def _block_reader(sources, local, n_labels, several, several_w):
    """A tf.data map function from ``local`` sample ids to the element ``x``, ``(x, y)``
    or ``(x, y, sample_weight)`` of their blocks ``sources`` (:func:`_regions`)."""

    def load(ids):
        out = []
        for src, region in sources:
            block = np.empty((len(ids),) + VolumeLayout.block_shape(src.sample_shape, region),
                             src.dtype)
            for j, i in enumerate(ids):
                block[j] = src.read(i, region)
            out.append(block)
        return tuple(out)

    specs = [tf.TensorSpec((local,) + VolumeLayout.block_shape(s.sample_shape, r),
                           tf.as_dtype(s.dtype)) for s, r in sources]

    def read(ids):
        tensors = tf.numpy_function(load, [ids], [s.dtype for s in specs], stateful=False)
        tensors = [tf.ensure_shape(t, s.shape) for t, s in zip(tensors, specs)]
        if len(tensors) == 1:
            return tensors[0]
        y_part = tuple(tensors[1:1 + n_labels]) if several else tensors[1]
        w_part = tuple(tensors[1 + n_labels:])
        return (tensors[0], y_part) + ((w_part if several_w else w_part[0],) if w_part else ())

    return read


def volumes(x, y=None, *, batch_size, model=None, spatial=None, split_labels=None,
            shuffle=False, seed=None, prefetch=1, sample_weight=None, autotune=False):
    """This rank's blocks of volume samples, batched for ``model.fit``.

    Each global batch of ``batch_size`` samples is split into row blocks as
    :func:`tfhybrid.data.shard` splits it for ``model`` (the data group),
    and of each of its rows this rank reads only the spatial block its
    model expects: the block the transformed model's input ``SpatialScatter``
    keeps (that scatter then passes it through, see :func:`accept_blocks`),
    or the whole volume for a model that takes whole volumes (``d``, ``f``,
    no spatial split at the input). Nothing else of the sample is read: a
    ``.npy`` file is memory-mapped and sliced once per sample.

    Args:
        x: The input volumes: a ``.npy`` file of all samples ``(N, D, H, W,
            C)`` (``(N, H, W, C)`` for images), a directory / glob pattern /
            list of per-sample ``.npy`` files ``(D, H, W, C)``, or an
            array-like (numpy array or memmap, h5py dataset).
        y: Optional labels, from the same kinds of source: per-voxel
            ``(N, D, H, W[, K])`` or per-sample ``(N, ...)`` (e.g. regression
            targets). For a model of several outputs, a *tuple* of sources, one
            per output in order (a list, or a tuple of paths for a model of one
            output, is one source of per-sample files); the labels of a split
            output are read as blocks, the others whole.
        batch_size: The global batch (all ranks together); the partial last
            batch is dropped.
        model: The transformed model to feed; it is made to accept blocks
            (:func:`accept_blocks`). None: rows split by the data axis and
            the ``spatial`` grid (default: whole volumes).
        spatial: Without a model, the block grid over the model group, as
            transform's ``spatial=`` ("depth", (pd, ph, pw), ...).
        split_labels: Per-voxel labels: None (default) splits them as the
            model's output is split (whole when it is gathered); True/False
            force it.
        shuffle: True shuffles all samples anew every epoch, an int is a
            shuffle buffer size in samples; the same order on every rank
            (one seed). False (default): file order.
        seed: The shuffle seed; None draws one on rank 0 and broadcasts it
            (then ``volumes`` is collective: call it on every rank).
        prefetch: Local batches read ahead (0: none).
        sample_weight: Optional weights (same kinds of source), per voxel
            ``(N, D, H, W)`` (read as blocks like the first output's labels) or
            per sample ``(N,)``; needs ``y``. With a tuple of label sources, a
            tuple of one weight source per output (cut like that output's labels).
        autotune: False (default): tf.data autotuning off for this pipeline;
            True keeps it (see :func:`tfhybrid.data.shard`).

    Returns:
        A ``tf.data.Dataset`` of ``x``, ``(x, y)`` or ``(x, y, sample_weight)``
        local batches (``y`` a tuple for a tuple of label sources) with a
        known number of steps per epoch (``N // batch_size``).

    Raises:
        ValueError: for sources of different lengths, a batch not divisible
            by the data-parallel ranks, a volume not divisible by the block
            grid, labels that do not match the model's output, or an invalid
            ``shuffle``.

    Example:
        >>> model = tfhybrid.transform(cosmoflow, "s")
        >>> model.compile(optimizer=tfhybrid.DistributedOptimizer(keras.optimizers.SGD()),
        ...               loss="mse")
        >>> model.fit(tfhybrid.data.volumes("x.npy", "y.npy", batch_size=4, model=model,
        ...                                 shuffle=True), epochs=2)
    """
    xs, labels, weights, several, several_w = _open_sources(x, y, sample_weight, model)
    ys = labels[0] if labels else None
    ndim = _input_ndim(xs, model)
    layout = plan(model, spatial, ndim, ys.sample_shape if ys is not None else None,
                  split_labels)
    if model is not None and several and len(labels) != len(getattr(model, "outputs", [])):
        raise ValueError(f"{WHERE}: Received a tuple of {len(labels)} label sources for "
                         f"model {model.name!r} of {len(model.outputs)} outputs; give one "
                         "source per output.")
    _check_batch_size(batch_size, layout.blocks, xs.n)
    buffer = _shuffle_buffer(shuffle, xs.n)
    if model is not None and math.prod(layout.parts) > 1:
        accept_blocks(model)
    sources = _regions(xs, labels, weights, layout, model, spatial, ndim, split_labels)
    start, stop = layout.rows(batch_size)
    read = _block_reader(sources, stop - start, len(labels), several, several_w)
    order = tf.data.Dataset.range(xs.n)
    if buffer is not None:
        from tfhybrid.data import _shared_seed
        order = order.shuffle(buffer, seed=_shared_seed(seed), reshuffle_each_iteration=True)
    order = order.batch(batch_size, drop_remainder=True).map(lambda ids: ids[start:stop])
    dataset = order.map(read, num_parallel_calls=1, deterministic=True)
    if prefetch:
        dataset = dataset.prefetch(prefetch)
    from tfhybrid.data import _without_autotune_stall
    return _without_autotune_stall(dataset, autotune)


def block_of(array, layout: VolumeLayout, labels=False):
    """This rank's block of every sample of in-memory ``array`` (tests, references).

    Example:
        >>> block_of(x, plan(spatial="depth"))   # (N, D/p, H, W, C) on each rank
    """
    array = np.asarray(array)
    shape = array.shape[1:]
    region = layout.label_region(shape) if labels else layout.input_region(shape)
    return array[(slice(None),) + region]


__all__ = ["volumes", "plan", "VolumeLayout", "accept_blocks", "open_source", "block_of",
           "input_scatter"]
