"""Geometry of spatial (domain) parallelism: who needs which rows (pure Python).

A sliding-window op (convolution or pooling) along one spatial axis of
global size ``N`` split into ``k`` equal blocks of ``n = N / k`` rows is
described by its effective window ``w = dilation * (kernel - 1) + 1``, its
stride ``s`` and Keras/TF padding:

* ``valid``: ``N_out = (N - w) // s + 1``, no padding;
* ``same``: ``N_out = ceil(N / s)``, ``pad = max((N_out - 1) * s + w - N, 0)``
  of which ``pad // 2`` rows go before the first row and the rest after the
  last one (TF's asymmetric rule, also for stride 2).

Rank ``i`` computes output rows ``[i*m, (i+1)*m)`` with ``m = N_out / k``
and therefore needs global input rows ``[i*m*s - pad_lo, (i+1)*m*s - s + w -
pad_lo)``. Relative to its own block this is ``need_lo`` rows before and
``need_hi`` rows after (negative: own rows it can drop). ``need_lo`` may
differ between ranks (``valid`` padding, odd strides), so the halo exchange
moves the largest interior need of the group (``ex_lo``/``ex_hi``, the same
on every rank, as the collective requires) and each rank crops what it
does not use. Rows beyond the global border are padding added locally.

Output rows whose windows lie inside the locally available rows form the
*interior* ``[a, b)``; they can be computed while the halo is in flight.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Optional, Sequence, Tuple

from tfhybrid.process_grid import Group, ravel, unravel

SPATIAL_AXES = {2: ("height", "width"), 3: ("depth", "height", "width")}


def window_output(size: int, window: int, stride: int, padding):
    """(output size, rows of padding before the first row) of one axis.

    ``padding`` is ``"valid"``, ``"same"`` or explicit rows ``(before, after)``
    (zero padding at the global border, as ``ZeroPadding2D`` adds).
    """
    if isinstance(padding, tuple):
        lo, hi = padding
        return max((size + lo + hi - window) // stride + 1, 0), lo
    if padding == "valid":
        return max((size - window) // stride + 1, 0), 0
    out = -(-size // stride)
    total = max((out - 1) * stride + window - size, 0)
    return out, total // 2


@dataclasses.dataclass(frozen=True)
class AxisGeometry:
    """A window op along one axis of global ``size`` split into ``parts`` blocks."""

    size: int
    parts: int
    window: int
    stride: int
    padding: str

    @property
    def block(self) -> int:
        return self.size // self.parts

    @property
    def out_size(self) -> int:
        return window_output(self.size, self.window, self.stride, self.padding)[0]

    @property
    def out_block(self) -> int:
        return self.out_size // self.parts

    def need(self, i: int) -> Tuple[int, int]:
        """Rows rank ``i`` needs before and after its block (may be negative)."""
        _, pad_lo = window_output(self.size, self.window, self.stride, self.padding)
        n, m, s = self.block, self.out_block, self.stride
        start = i * m * s - pad_lo
        stop = (i + 1) * m * s - s + self.window - pad_lo
        return i * n - start, stop - (i + 1) * n

    def exchange(self) -> Tuple[int, int]:
        """Uniform halo widths (lo, hi) moved between neighbours of the group."""
        if self.parts == 1:
            return 0, 0
        lo = max([0] + [self.need(i)[0] for i in range(1, self.parts)])
        hi = max([0] + [self.need(i)[1] for i in range(self.parts - 1)])
        return lo, hi

    def problem(self) -> Optional[str]:
        """Why this geometry cannot be split, or None when it can."""
        k = self.parts
        if self.size % k:
            return f"size {self.size} does not split evenly over {k} ranks"
        if self.out_size < 1:
            return f"size {self.size} is smaller than the window {self.window}"
        if self.out_size % k:
            return (f"the output size {self.out_size} (stride {self.stride}, padding "
                    f"'{self.padding}') does not split evenly over {k} ranks")
        lo, hi = self.exchange()
        if max(lo, hi) > self.block:
            return (f"the blocks of {self.block} rows are smaller than the halo "
                    f"(lo={lo}, hi={hi} rows)")
        return None

    def nearest_valid(self, limit: int = 4096) -> Tuple[Optional[int], Optional[int]]:
        """The nearest valid global sizes below and above ``size``."""
        def ok(n):
            return dataclasses.replace(self, size=n).problem() is None
        below = next((n for n in range(self.size - 1, 0, -1) if ok(n)), None)
        above = next((n for n in range(self.size + 1, self.size + limit) if ok(n)), None)
        return below, above


@dataclasses.dataclass(frozen=True)
class AxisPlan:
    """What rank ``index`` does along one axis (all sizes in rows)."""

    geometry: AxisGeometry
    index: int

    @property
    def need(self):
        return self.geometry.need(self.index)

    @property
    def border(self) -> Tuple[bool, bool]:
        """Whether this rank's block touches the global start / end."""
        return self.index == 0, self.index == self.geometry.parts - 1

    @property
    def halo(self) -> Tuple[bool, bool]:
        """Whether rows from the previous / next rank are needed."""
        (lo, hi), (blo, bhi) = self.need, self.border
        return lo > 0 and not blo, hi > 0 and not bhi

    def take(self, with_halo: bool) -> Tuple[int, int]:
        """Rows kept before / after the own block (negative: cropped)."""
        (lo, hi), (hlo, hhi) = self.need, self.halo
        return (lo if with_halo and hlo else min(lo, 0),
                hi if with_halo and hhi else min(hi, 0))

    def pads(self) -> Tuple[int, int]:
        """Rows of global-border padding added locally before / after."""
        (lo, hi), (blo, bhi) = self.need, self.border
        return (max(lo, 0) if blo else 0, max(hi, 0) if bhi else 0)

    def interior(self) -> Tuple[int, int]:
        """Output rows ``[a, b)`` computable from locally available rows."""
        g = self.geometry
        (lo, _), (hlo, hhi) = self.need, self.halo
        m, s, w = g.out_block, g.stride, g.window
        # In coordinates of the halo-extended input, the own block starts at
        # row ``lo`` and ends at ``lo + block``.
        a = min(-(-lo // s), m) if hlo else 0
        b = min((lo + g.block - w) // s + 1, m) if hhi else m
        return a, max(a, b)

    def local_offset(self) -> int:
        """Rows of the full (halo-extended) input before the local-only input."""
        return self.need[0] if self.halo[0] else 0


def transpose_output(size: int, window: int, stride: int, padding: str):
    """(output size, rows cropped before the first output row) of a transposed
    convolution along one axis (Keras ``Conv2DTranspose``/``Conv3DTranspose``
    without ``output_padding``, dilation 1).

    The op is the gradient of a convolution of the *output* with the same
    window, stride and padding: ``valid`` gives ``size * stride + max(window
    - stride, 0)`` rows, ``same`` gives ``size * stride`` rows and crops
    ``max(window - stride, 0) // 2`` rows before the first one (TF's rule
    for the forward convolution's padding).

    Example:
        >>> transpose_output(8, 3, 2, "same"), transpose_output(8, 2, 2, "valid")
        ((16, 0), (16, 0))
    """
    extra = max(window - stride, 0)
    if padding == "valid":
        return size * stride + extra, 0
    return size * stride, extra // 2


@dataclasses.dataclass(frozen=True)
class TransposeGeometry(AxisGeometry):
    """A transposed convolution along one axis of global ``size`` split into ``parts``.

    Input row ``i`` adds ``x[i] * K[t]`` to output row ``o = i * s + t - crop``
    (``t < w``; ``crop`` from :func:`transpose_output`). Rank ``r`` computes
    output rows ``[r*m, (r+1)*m)``; it needs the input rows ``[a, b)`` whose
    contributions reach them, with ``a`` no later than ``(r*m + crop) / s``
    and ``b`` such that a ``valid`` transposed convolution of rows ``[a, b)``
    (``(b - a) * s + max(w - s, 0)`` rows, its row ``j`` being global row
    ``a * s + j - crop``) covers them. :meth:`offset` is the first kept row
    of that local result. ``need`` and the halo exchange are those of
    :class:`AxisGeometry` (rows beyond the global border are zeros).
    """

    @property
    def out_size(self) -> int:
        return transpose_output(self.size, self.window, self.stride, self.padding)[0]

    def _rows(self, i: int) -> Tuple[int, int]:
        """Input rows ``[a, b)`` rank ``i`` needs (global, may exceed the border)."""
        w, s, m = self.window, self.stride, self.out_block
        crop = transpose_output(self.size, w, s, self.padding)[1]
        first, last = i * m + crop, (i + 1) * m + crop   # in uncropped output rows
        a = min(-(-(first - w + 1) // s), first // s)
        b = max((last - 1) // s + 1, -(-(last - max(w - s, 0)) // s))
        return a, b

    def need(self, i: int) -> Tuple[int, int]:
        a, b = self._rows(i)
        n = self.block
        return i * n - a, b - (i + 1) * n

    def offset(self, i: int) -> int:
        """Row of the local ``valid`` result where rank ``i``'s output block starts."""
        crop = transpose_output(self.size, self.window, self.stride, self.padding)[1]
        return i * self.out_block + crop - self._rows(i)[0] * self.stride

    def problem(self) -> Optional[str]:
        k = self.parts
        if self.size % k:
            return f"size {self.size} does not split evenly over {k} ranks"
        if self.out_size % k:
            return (f"the output size {self.out_size} (stride {self.stride}, window "
                    f"{self.window}, padding '{self.padding}') does not split evenly over "
                    f"{k} ranks")
        lo, hi = self.exchange()
        if max(lo, hi) > self.block:
            return (f"the blocks of {self.block} rows are smaller than the halo "
                    f"(lo={lo}, hi={hi} rows)")
        return None


def axis_problem_message(layer, shape, grid_shape, axis_name, geometry) -> str:
    """ValueError text for an axis that cannot be split."""
    below, above = geometry.nearest_valid()
    sizes = " or ".join(str(v) for v in (below, above) if v is not None)
    if not sizes:
        sizes = (f"none found (no size splits both the input and the output of this "
                 f"window/stride/padding over {geometry.parts} ranks; use padding='same' "
                 "or another number of ranks along this axis)")
    grid = "x".join(str(p) for p in grid_shape)
    return (f"{layer}: the input of global shape {tuple(shape)} cannot be split over the "
            f"{grid} grid along {axis_name}: {geometry.problem()}. Nearest valid global "
            f"{axis_name} sizes: {sizes}. Change the input size, the split or the "
            "number of ranks.")


# -- split specifications and spatial groups -----------------------------------

def grid_shape(split, ndim: int, group_size: int, layer: str = "layer") -> Tuple[int, ...]:
    """The block-grid shape (one entry per spatial axis) of a ``split`` argument.

    Example:
        >>> grid_shape("height", 2, 4), grid_shape((2, 2), 2, 4)
        ((4, 1), (2, 2))
    """
    names = SPATIAL_AXES[ndim]
    check_split(split, ndim, layer)
    if isinstance(split, str):
        return tuple(group_size if n == split else 1 for n in names)
    shape = tuple(int(p) for p in split)
    if math.prod(shape) != group_size:
        raise ValueError(
            f"{layer}: Received split={tuple(split)} (product {math.prod(shape)}) for a "
            f"spatial group of {group_size} ranks; the product of the block grid must "
            "equal the group size.")
    return shape


def check_split(split, ndim: int, layer: str = "layer"):
    """Validate the form of a ``split`` argument (without the group size)."""
    names = SPATIAL_AXES[ndim]
    if isinstance(split, str):
        if split not in names:
            raise ValueError(f"{layer}: Received an invalid value for `split`: {split!r}; "
                             f"expected one of {names} or a tuple of {ndim} positive "
                             "integers (the block grid).")
        return
    ok = isinstance(split, (tuple, list)) and len(split) == ndim and all(
        isinstance(p, int) and not isinstance(p, bool) and p >= 1 for p in split)
    if not ok:
        raise ValueError(f"{layer}: Received an invalid value for `split`: {split!r}; "
                         f"expected one of {names} or a tuple of {ndim} positive integers "
                         "(the block grid).")


def normalize_split(split):
    """Strings stay, sequences become tuples (JSON configs hold lists)."""
    return split if isinstance(split, str) else tuple(split)


def factor_group(group: Group, shape: Sequence[int], names: Sequence[str]) -> Tuple[Group, ...]:
    """Factor ``group`` row-major into a block grid: one sub-Group per axis.

    Example:
        >>> g = Group("model", (4, 5, 6, 7), 3)
        >>> [(s.ranks, s.index) for s in factor_group(g, (2, 2), ("h", "w"))]
        [((5, 7), 1), ((6, 7), 1)]
    """
    coords = unravel(group.index, shape)
    out = []
    for axis, name in enumerate(names):
        members = []
        for j in range(shape[axis]):
            c = list(coords)
            c[axis] = j
            members.append(group.ranks[ravel(c, shape)])
        out.append(Group(name, tuple(members), coords[axis]))
    return tuple(out)


def all_factored(groups: Sequence[Sequence[int]], shape) -> Tuple[Tuple[int, ...], ...]:
    """Every sub-group of every group (same order on every rank)."""
    result = []
    for ranks in groups:
        for index in range(len(ranks)):
            for sub in factor_group(Group("g", tuple(ranks), index), shape,
                                    [str(i) for i in range(len(shape))]):
                if sub.ranks not in result:
                    result.append(sub.ranks)
    return tuple(result)


# -- the `spatial=` option of transform and the oracle: one reading -------------

def default_spatial(ndim: int = 2) -> str:
    """The split s/ds use when ``spatial`` is not given: the first spatial axis
    (``"height"`` for images, ``"depth"`` for volumes)."""
    return SPATIAL_AXES[ndim][0]


def spatial_grid(spatial, model_size: int, strategy: str, ndim: int = 2) -> Tuple[int, ...]:
    """The block grid for the ``spatial`` option over a model group of ``model_size``:
    (ph, pw) for image models (``ndim=2``), (pd, ph, pw) for volumes (``ndim=3``).

    Raises:
        ValueError: when the grid does not have ``model_size`` ranks or does
            not fit the model's number of spatial axes.

    Example:
        >>> spatial_grid("height", 4, "s")
        (4, 1)
        >>> spatial_grid(None, 2, "ds", ndim=3)
        (2, 1, 1)
    """
    names = SPATIAL_AXES[ndim]
    if spatial is None:
        spatial = default_spatial(ndim)
    if isinstance(spatial, str) and spatial in names:
        return tuple(model_size if n == spatial else 1 for n in names)
    if isinstance(spatial, (tuple, list)) and len(spatial) == ndim and all(
            isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in spatial):
        if math.prod(spatial) != model_size:
            what = " * ".join("p" + n[0] for n in names)
            raise ValueError(
                f"Received spatial={tuple(spatial)!r} ({math.prod(spatial)} ranks) for "
                f"strategy {strategy!r} on model groups of {model_size} ranks; {what} must "
                f"equal model_parallel, e.g. spatial={(model_size,) + (1,) * (ndim - 1)!r} or "
                f"call tfhybrid.init(model_parallel={math.prod(spatial)}).")
        return tuple(spatial)
    shape = "(pd, ph, pw)" if ndim == 3 else "(ph, pw)"
    kind = "a volume (5-D input)" if ndim == 3 else "an image (4-D input)"
    raise ValueError(f"Received an invalid value for `spatial`: spatial={spatial!r} for {kind} "
                     f"model; expected one of {', '.join(map(repr, names))} or a "
                     f"tuple {shape}.")
