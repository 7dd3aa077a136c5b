"""Execution of a sliding-window op on a block-split tensor (TensorFlow side).

:mod:`tfhybrid.spatial_geometry` says which rows each rank needs; this
module moves them (``tfhybrid.comm.halo_exchange``, one spatial axis after
the other so that corner blocks of a 2-D/3-D grid travel through the
neighbour that already received them), pads the global border locally with
the op's padding value, and runs the op with ``valid`` padding. Convolutions
whose ``same`` padding of the block equals the rows a rank needs take
:func:`block_conv` instead: the block's own ``same`` convolution plus thin
convolutions of the received halo pieces, with no halo-extended copy of the
block (memory: ``bench/volume_memory.py``).

With ``overlap``, output rows whose windows need no neighbour rows (the
interior) are computed from the local block alone, so in a graph the
interior op runs while the halo alltoall is in flight; the boundary strips
are computed from the halo-extended input afterwards and everything is
concatenated. Eagerly, ops run one at a time and overlap cannot help, so
the single-op path is used. ``overlap=None`` (the default) overlaps only
when a GPU is visible: on CPU-only hosts, where ranks share the cores, the
split into interior and boundary ops costs more than the hidden exchange
saves (``bench/spatial.py`` compares the two).

Also the shared base class :class:`SpatialMixin` of the spatial layers:
split/group arguments, sub-group registration and the per-shape plans.
"""
from __future__ import annotations

import tensorflow as tf

from tfhybrid import comm, runtime
from tfhybrid import spatial_geometry as sp
from tfhybrid.layers.no_xla import NoXLA
from tfhybrid.layers.partitioned import deserialize_group, serialize_group
from tfhybrid.process_grid import Group


# -- moving rows -----------------------------------------------------------------

def _slice_axis(x, axis, start, length):
    begin = [0] * x.shape.rank
    size = [-1] * x.shape.rank
    begin[axis], size[axis] = start, length
    return tf.slice(x, begin, size)


def _pad_axis(x, axis, before, after, value):
    if before == 0 and after == 0:
        return x
    pads = [(0, 0)] * x.shape.rank
    pads[axis] = (before, after)
    if value == 0:      # zeros a convolution reads: see _zero_framed
        return _zero_framed(x, pads)
    return tf.pad(x, pads, constant_values=value)


def assemble(x, plans, groups, pad_value, name, with_halo):
    """The input rows this rank's outputs need, along every spatial axis.

    Args:
        x: This rank's block (batch, spatial..., channels).
        plans: One :class:`AxisPlan` per spatial axis.
        groups: One sub-Group per spatial axis.
        pad_value: Value of the global-border padding.
        name: Base of the collective names.
        with_halo: Exchange halos (False: local rows and border padding only).
    """
    done = _block_exchange(x, plans, groups, name) if with_halo else None
    if done is not None:
        x = done
    for d, (plan, g) in enumerate(zip(plans, groups)):
        axis, n = d + 1, plan.geometry.block
        lo_ex, hi_ex = plan.geometry.exchange() if with_halo else (0, 0)
        if (lo_ex or hi_ex) and done is None:
            x = comm.halo_exchange(x, axis, lo_ex, hi_ex, g, name=f"{name}.ax{axis}")
        take_lo, take_hi = plan.take(with_halo)
        if lo_ex or hi_ex or take_lo or take_hi:
            x = _slice_axis(x, axis, lo_ex - take_lo, take_lo + n + take_hi)
        x = _pad_axis(x, axis, *plan.pads(), pad_value)
    return x


def _block_exchange(x, plans, groups, name):
    """All halo rows at once, neighbour-only (corners included), or None for the
    per-axis path (``halo_method() == "axis"``, or groups not from a grid axis).
    """
    from tfhybrid.comm import halo

    widths = [p.geometry.exchange() for p in plans]
    grid = _block_grid(plans, groups)
    if grid is None:
        return None
    mine, shape, method, every = grid
    return halo.block_halo_exchange(x, mine, shape, widths, name=name, method=method,
                                    all_groups=every)


def _block_grid(plans, groups):
    """``(spatial Group, grid shape, method, every group or None)`` of the
    neighbour-only block exchange, or None when the per-axis path is used
    (``halo_method() == "axis"``, no halo, or groups not from a grid axis).

    The spatial group is the grid axis the sub-groups were factored from (their
    names are ``"<axis>.<spatial axis>"``); the block grid is row-major.
    """
    from tfhybrid.comm import halo

    method = halo.halo_method()
    if method == "axis" or not any(lo or hi for p in plans for lo, hi in [p.geometry.exchange()]):
        return None
    grid = runtime.current_grid()
    axis = groups[0].name.split(".")[0]
    try:
        mine = grid.group(axis)
    except ValueError:
        return None
    shape = tuple(g.size for g in groups)
    names = [g.name for g in groups]
    if tuple(sp.factor_group(mine, shape, names)) != tuple(groups):
        return None
    every = _all_groups(grid, axis) if method == "pairs" else None
    return mine, shape, method, every


# -- running the op -------------------------------------------------------------

def _window_slice(x, plans, ranges, offsets):
    """Input rows of the outputs ``ranges`` (one (start, stop) per axis)."""
    for d, (plan, (p, q), off) in enumerate(zip(plans, ranges, offsets)):
        g = plan.geometry
        start, length = p * g.stride - off, (q - 1) * g.stride + g.window - p * g.stride
        if start != 0 or length != x.shape[d + 1]:
            x = _slice_axis(x, d + 1, start, length)
    return x


def windowed(x, plans, groups, op, pad_value, name, overlap, params=None):
    """Run ``op(input, ranges)`` (valid padding) for this rank's output block.

    ``op`` receives the input rows of output ranges ``[(start, stop), ...]``
    (one per spatial axis, in local output rows) and returns those outputs.

    With ``params`` (a tuple of tensors, e.g. ``(kernel,)``), ``op`` is called
    as ``op(input, ranges, *params)`` and the halo-extended, border-padded
    input is not kept for the backward pass: only the thin frame of halo and
    padding rows around this rank's block is, and the backward rebuilds the
    input from the block and the frame (see :func:`_frame_only`). Gradients
    are the same ops on the same values as without it.
    """
    full = [(0, p.geometry.out_block) for p in plans]
    zero = [0] * len(plans)
    ext = assemble(x, plans, groups, pad_value, name, with_halo=True)
    needs_halo = any(any(p.halo) for p in plans)
    interior = [p.interior() for p in plans]
    if not (overlap and needs_halo and all(b > a for a, b in interior)):
        ext = _window_slice(ext, plans, full, zero)
        if params is None:
            return op(ext, full)
        needs = [p.need for p in plans]
        if KEEP_FRAME_ONLY and all(lo >= 0 and hi >= 0 for lo, hi in needs) and \
                any(lo or hi for lo, hi in needs):
            return _frame_only(lambda t, *w: op(t, full, *w), x, ext, needs, params)
        return op(ext, full, *params)
    if params is not None:
        op = _bind(op, params)
    local = assemble(x, plans, groups, pad_value, name, with_halo=False)
    offsets = [p.local_offset() for p in plans]

    def compose(d, ranges):
        if d == len(plans):
            return op(_window_slice(local, plans, ranges, offsets), ranges)
        (a, b), m = interior[d], plans[d].geometry.out_block
        rest = full[d + 1:]
        parts = []
        for p, q in ((0, a), (b, m)):
            if q > p:
                rg = ranges + [(p, q)] + rest
                parts.append((p, op(_window_slice(ext, plans, rg, zero), rg)))
        parts.append((a, compose(d + 1, ranges + [(a, b)])))
        parts.sort(key=lambda t: t[0])
        return tf.concat([t for _, t in parts], d + 1) if len(parts) > 1 else parts[0][1]

    return compose(0, [])


KEEP_FRAME_ONLY = True   # False: keep the whole extended input (bench/probe comparison only)


def _bind(op, params):
    return lambda t, ranges: op(t, ranges, *params)


def _frame_slabs(ext, needs, sizes):
    """The rows of ``ext`` around the block, as slabs: along axis ``d``, the
    ``lo`` rows before and ``hi`` rows after the block, spanning the whole of
    ``ext`` along the axes before ``d`` and the block's rows along those after."""
    nd, slabs = len(needs), []
    for d, (lo, hi) in enumerate(needs):
        for start, length in ((0, lo), (lo + sizes[d], hi)):
            if not length:
                slabs.append(None)
                continue
            begin, size = [0] * (nd + 2), [-1] * (nd + 2)
            begin[d + 1], size[d + 1] = start, length
            for e in range(d + 1, nd):
                begin[e + 1], size[e + 1] = needs[e][0], sizes[e]
            slabs.append(tf.slice(ext, begin, size))
    return slabs


def _from_frame(x, slabs):
    """``ext`` again: the block ``x`` with the slabs of :func:`_frame_slabs` around it."""
    for d in range(len(slabs) // 2):
        parts = [t for t in (slabs[2 * d], x, slabs[2 * d + 1]) if t is not None]
        if len(parts) > 1:
            x = tf.concat(parts, d + 1)
    return x


def _frame_only(op, x, ext, needs, params):
    """``op(ext, *params)``, differentiable in ``ext`` and ``params``, keeping for
    the backward pass only ``x`` (this rank's block, which ``ext`` contains at
    offset ``needs[d][0]`` along each spatial axis) and the thin frame of halo
    and border-padding rows around it, not the whole extended copy.

    The backward rebuilds ``ext`` bit for bit (after the incoming gradient
    exists, so the rebuilt copy lives only during this op's backward) and runs
    the op's own registered gradient on it: the same values as differentiating
    ``op(ext)`` directly. A convolution's gradient needs only its inputs, so in
    a graph the recomputed forward is pruned; x's gradient arrives through
    ``ext`` (the halo exchange's backward), hence None here.
    """
    sizes = [int(v) for v in x.shape[1:1 + len(needs)]]
    params = [tf.convert_to_tensor(w) for w in params]

    @tf.custom_gradient
    def run(block, extended, *weights):
        slabs = _frame_slabs(extended, needs, sizes)
        out = op(extended, *weights)

        def grad(dy):
            with tf.control_dependencies([dy]):   # rebuild late; no merging with the forward
                again = _from_frame(tf.identity(block), [
                    None if t is None else tf.identity(t) for t in slabs])
            with tf.GradientTape() as tape:
                tape.watch(list(weights))
                y = op(again, *weights)
            dws = tape.gradient(y, list(weights), output_gradients=dy)
            # the input's gradient only after the weights': the rebuilt input (read
            # by the weights' gradient only) is freed before that gradient exists
            with tf.control_dependencies([g for g in dws if g is not None]):
                with tf.GradientTape() as tape:
                    tape.watch(again)
                    y = op(again, *weights)
                d_ext = tape.gradient(y, again, output_gradients=dy)
            return (None, d_ext, *dws)
        return out, grad

    return run(x, ext, *params)


# -- convolution on the block itself plus thin halo corrections ----------------------

def block_conv_possible(plans):
    """Whether :func:`block_conv` can run these plans: on every rank of the grid
    (a decision all ranks share, as their collectives must match), along every
    axis, a ``same`` convolution of the block pads it exactly by the rows that
    rank needs (``AxisPlan.need``: halo or global border) and yields its output
    block (e.g. ``same`` convolutions with stride 1, or stride 2 on even blocks)."""
    for p in plans:
        g = p.geometry
        out, pad_lo = sp.window_output(g.block, g.window, g.stride, "same")
        total = max((out - 1) * g.stride + g.window - g.block, 0)
        if out != g.out_block:
            return False
        if any(g.need(i) != (pad_lo, total - pad_lo) for i in range(g.parts)):
            return False
    return True


def _corrections(plans, plan):
    """Per received halo piece (offset ``o``): per spatial axis, the piece rows
    used ``(start, length)``, the zero rows around them ``(before, after)`` that
    make the thin input of a ``valid`` convolution, and the output rows it
    contributes to ``(start, length)``; None when it contributes to no output.

    Coordinates: the rank's extended input (``need`` rows before the block),
    whose ``valid`` convolution is the output block. The piece covers ext rows
    ``[P0, P1)``; outputs ``j`` with ``j*s < P1`` and ``j*s + w > P0`` read it.
    """
    out = {}
    for o, _ in plan.receive_from:
        axes = []
        for v, p, (wlo, _) in zip(o, plans, plan.widths):
            g = p.geometry
            (lo, hi), n, m, s, w = p.need, g.block, g.out_block, g.stride, g.window
            p0, p1, shift = {-1: (0, lo, wlo - lo), 1: (lo + n, lo + n + hi, -(lo + n)),
                             0: (lo, lo + n, -lo)}[v]
            ja, jb = max(0, (p0 - w) // s + 1), min(m, -(-p1 // s))
            a, b = ja * s, (jb - 1) * s + w
            u0, u1 = max(a, p0), min(b, p1)
            if p1 <= p0 or ja >= jb or u1 <= u0:
                axes = None
                break
            axes.append(((u0 + shift, u1 - u0), (u0 - a, b - u1), (ja, jb - ja)))
        out[o] = axes
    return out


def _region(t, starts, lengths):
    return tf.slice(t, [0] + list(starts) + [0], [-1] + list(lengths) + [-1])


def _zero_framed(t, pads):
    """``t`` with ``pads[axis] = (before, after)`` rows of zeros along each axis,
    concatenated rather than padded: TensorFlow's remapper (2.18 to 2.21) fuses a Pad into
    the Conv3D it feeds (oneDNN's padded convolution) and then fails on the
    Pad's other consumer (the convolution gradient's ShapeN), which drops every
    remapper fusion of the whole step ("remapper failed: ... fanout ... exist
    for missing node ... Pad")."""
    for axis, (before, after) in enumerate(pads):
        if not (before or after):
            continue
        shape = [d if d is not None else tf.shape(t)[i] for i, d in enumerate(t.shape)]

        def zeros(rows):
            return [tf.zeros(shape[:axis] + [rows] + shape[axis + 1:], t.dtype)] if rows else []
        t = tf.concat(zeros(before) + [t] + zeros(after), axis)
    return t


def _used_rows(piece, axes):
    """The rows of a received piece its thin convolution reads."""
    return _region(piece, [a[0][0] for a in axes], [a[0][1] for a in axes])


def _thin_input(used, axes):
    """The thin ``valid``-conv input of one piece: its used rows, zeros around.

    A ``tf.pad``, not :func:`_zero_framed`: ``tf.zeros`` of a static shape
    become constants a traced function holds for its lifetime (Grappler folds
    them), one per frame. The remapper failure that :func:`_zero_framed`
    avoids needs a Pad feeding a convolution and another op; :func:`block_conv`
    pads once for the forward convolution and again, separately, in the
    backward (tests/parallel/test_spatial_conv3d.py checks the graph)."""
    return tf.pad(used, [(0, 0)] + [a[1] for a in axes] + [(0, 0)])


def _same_kernel_grad(conv, t, k, dy, windows):
    """The kernel gradient of ``conv(t, k, "same")``.

    TensorFlow 2.18's oneDNN Conv3D filter gradient in bfloat16 returns wrong or
    non-finite values (at random) when a spatial extent of the input is smaller
    than the window, e.g. a block of 2 rows under a 3x3x3 kernel: 60 of 240
    shapes in a probe, every one with such an extent, none without; float16,
    float32, 2-D and GPUs are not affected. A spatial split makes such thin
    blocks (a U-Net's deepest level at 4 ranks), so there the gradient is
    computed in float32 and cast back."""
    if t.dtype == tf.bfloat16 and t.shape.rank == 5 and not _gpu_visible() and any(
            d is not None and d < w for d, w in zip(t.shape[1:-1], windows)):
        t32, k32, dy32 = (tf.cast(v, tf.float32) for v in (t, k, dy))
        with tf.GradientTape() as tape:
            tape.watch(k32)
            yb = conv(t32, k32, "same")
        return tf.cast(tape.gradient(yb, k32, output_gradients=dy32), k.dtype)
    with tf.GradientTape() as tape:
        tape.watch(k)
        yb = conv(t, k, "same")
    return tape.gradient(yb, k, output_gradients=dy)


def _piece_grads(conv, rows, axes, k, dy, full):
    """The gradients of one received piece's thin ``valid`` convolution:
    ``(input gradient of the whole piece, of shape full, kernel gradient)``,
    from ``dy`` at the piece's output rows; ``rows`` and ``axes`` as in
    :func:`_used_rows` and :func:`_corrections`."""
    dyo = _region(dy, [a[2][0] for a in axes], [a[2][1] for a in axes])
    # framed again here, after dy exists: a copy that lives only in
    # this backward (the dependency keeps Grappler from merging it
    # with the forward's frame, which would then live from forward on)
    with tf.control_dependencies([dyo]):
        thin = _thin_input(tf.identity(rows), axes)
    with tf.GradientTape() as tape:
        tape.watch([thin, k])
        yo = conv(thin, k, "valid")
    d_thin, dko = tape.gradient(yo, [thin, k], output_gradients=dyo)
    d_used = _region(d_thin, [a[1][0] for a in axes], [a[0][1] for a in axes])
    pads = [[0, 0]] + [[a[0][0], f - a[0][0] - a[0][1]]
                       for a, f in zip(axes, full[1:-1])] + [[0, 0]]
    return tf.pad(d_used, pads), dko


def block_conv(x, plans, groups, conv, kernel, name):
    """A convolution of this rank's block ``x`` with its halo, keeping no
    halo-extended copy of the block in the forward or the backward pass.

    ``conv(t, kernel, padding)`` is the layer's convolution (``"same"`` or
    ``"valid"``). By linearity, the convolution of the extended input (the
    block, its halo and global-border zeros) is ``conv(x, "same")`` (the block
    with zeros around: :func:`block_conv_possible` checks that ``same`` pads it
    by exactly those rows) plus, for each received halo piece, a ``valid``
    convolution of the thin piece with zeros around it, added in place at the
    output rows it reaches. The backward does the same: the kernel gradient is
    the block's plus the pieces', the input gradient the block's ``same``
    input gradient plus, added in place at their rows, the gradients of the
    rows we sent (returned by the neighbours). Only the block (the previous
    layer's output) and the thin pieces are kept for the backward pass.

    Values equal those of the extended-input convolution up to float32
    rounding (sums of the same products in another order).

    Returns None (nothing run) when the halo would travel by the per-axis
    method (``halo_method() == "axis"`` or groups not from a grid axis): use
    :func:`windowed` then.
    """
    from tfhybrid.comm import halo

    if not any(lo or hi for p in plans for lo, hi in [p.geometry.exchange()]):
        return conv(x, kernel, "same")
    grid = _block_grid(plans, groups)
    if grid is None:     # the per-axis halo method: the caller runs core.windowed
        return None
    mine, shape, method, every = grid
    plan = halo.block_halo_plan(x, mine, shape, [p.geometry.exchange() for p in plans],
                                name=name, method=method, all_groups=every)
    regions = _corrections(plans, plan)
    used = [o for o, _ in plan.receive_from if regions[o] is not None]
    kernel = tf.convert_to_tensor(kernel)

    def piece_shape(o, like):
        dims = halo.piece_dims(o, plan.widths, plan.sizes, False)
        return [like.shape[0]] + dims + [like.shape[-1]]

    @tf.custom_gradient
    def run(t, k):
        got, anchors = halo.block_halo_pieces(t, plan)
        # only the rows read are kept for the backward, not their zero frame
        rows = {o: _used_rows(tf.ensure_shape(got[o], piece_shape(o, t)), regions[o])
                for o in used}
        thin_out = {o: conv(_thin_input(rows[o], regions[o]), k, "valid") for o in used}
        if used:    # every alltoall must feed the output (see halo._swap); anchored
            # on a thin output, not on the kept rows (the anchor copies its tensor)
            thin_out[used[0]] = halo._anchored(thin_out[used[0]], anchors)
        y = halo.add_all_at(conv(t, k, "same"), [
            (thin_out[o], [a[2][0] for a in regions[o]] + [0]) for o in used])
        if not used:
            y = halo._anchored(y, anchors)

        def grad(dy):
            dk = _same_kernel_grad(conv, t, k, dy, [p.geometry.window for p in plans])
            grads = {}
            for o, _ in plan.receive_from:
                full = piece_shape(o, dy)
                if regions[o] is None:
                    grads[o] = tf.zeros([tf.shape(dy)[0]] + full[1:], dy.dtype)
                    continue
                grads[o], dko = _piece_grads(conv, rows[o], regions[o], k, dy, full)
                dk = dk + dko
            # pieces carry the input's channels (a thin gradient, else the block)
            like = next(iter(grads.values())) if grads else t
            back, anchors_b = halo.block_halo_return(grads, plan, like)
            sent = [o for o, _ in plan.send_to]
            if sent:
                back[sent[0]] = halo._anchored(back[sent[0]], anchors_b)
            # the input's gradient after the kernel's (and the thin pieces')
            with tf.control_dependencies([dk]):
                with tf.GradientTape() as tape:
                    tape.watch(t)
                    yb = conv(t, k, "same")
                dx = tape.gradient(yb, t, output_gradients=dy)
            # in place at the rows we sent: no block-sized temporaries
            dx = halo.add_all_at(dx, [(back[o], halo.sent_rows_begin(o, plan) + [0])
                                      for o in sent])
            if not sent:
                dx = halo._anchored(dx, anchors_b)
            return dx, dk
        return y, grad

    return run(x, kernel)


# -- the shared layer machinery ---------------------------------------------------

# config keys the Keras counterpart lacks
SPATIAL_KEYS = ("split", "group", "overlap", "border_padding")


class SpatialMixin(NoXLA):
    """Split/group handling shared by every spatial layer.

    Subclasses set ``_ndim`` (2 or 3) and call :meth:`_init_spatial` from
    ``__init__``; :meth:`_spatial_groups` resolves and registers the block
    grid's sub-groups (collective; call it from ``build`` on every rank in
    the same order).
    """

    _ndim = 2
    _eager_overlap = False
    border_padding = None     # see _init_border_padding
    _keras_class = None          # the Keras layer a subclass parallelises
    _default_split = "height"
    # Layers with weights define it (a staticmethod: Keras layer -> an input shape
    # that builds its weights); from_layer/to_layer then copy the weights.
    _weights_input_shape = None
    _takes_overlap = False       # sliding-window layers (convolution, pooling) also save `overlap`

    @classmethod
    def from_layer(cls, layer, split=None, group="model", **spatial_options):
        """A spatial copy of the Keras layer it parallelises: same arguments and
        name, and, for layers with weights (convolutions: they define
        ``_weights_input_shape``), a copy of its weights, built.

        Args:
            layer: An instance of the class's Keras counterpart (e.g.
                ``keras.layers.MaxPooling2D`` for ``SpatialMaxPooling2D``).
            split: Spatial axis name or block-grid tuple (default: the class's).
            group: Group the blocks are split over (a name or a Group).
            **spatial_options: e.g. ``overlap`` for the sliding-window layers.

        Raises:
            TypeError: if ``layer`` is not an instance of the Keras counterpart.
            ValueError: if a layer with weights is not built (or its arguments are
                ones the spatial layer refuses, e.g. a transposed convolution's
                output_padding).

        Example:
            >>> SpatialMaxPooling2D.from_layer(keras.layers.MaxPooling2D(2), split="width")
        """
        base = cls._keras_class
        if base is None or not isinstance(layer, base):
            expected = f"keras.layers.{base.__name__}" if base else "its Keras counterpart"
            raise TypeError(f"{cls.__name__}.from_layer: Received layer={layer!r}; expected a "
                            f"{expected}.")
        weighted = cls._weights_input_shape is not None
        if weighted and not layer.built:
            raise ValueError(f"{cls.__name__}.from_layer: layer '{layer.name}' is not built; "
                             "call it on an input (or build it) first so its weights exist.")
        config = {k: v for k, v in layer.get_config().items() if k not in SPATIAL_KEYS}
        config.update(split=cls._default_split if split is None else split, group=group,
                      **spatial_options)
        spatial = cls.from_config(config)
        if weighted:
            spatial.build(cls._weights_input_shape(layer))
            spatial.set_weights(layer.get_weights())
        return spatial

    def to_layer(self):
        """The plain Keras layer with this layer's arguments (and weights, if any).

        Raises:
            ValueError: if this layer has weights and is not built.
        """
        weighted = self._weights_input_shape is not None
        if weighted and not self.built:
            raise ValueError(f"{self._label()}.to_layer: the layer is not built.")
        config = {k: v for k, v in self.get_config().items() if k not in SPATIAL_KEYS}
        plain = self._keras_class.from_config(config)
        if weighted:
            plain.build(self._weights_input_shape(self))
            plain.set_weights(self.get_weights())
        return plain

    def get_config(self):
        config = super().get_config()
        config.update({"split": self.split, "group": serialize_group(self.group)})
        if self._takes_overlap:
            config["overlap"] = self.overlap
        if self.border_padding is not None:
            config["border_padding"] = [list(rows) for rows in self.border_padding]
        return config

    def _init_border_padding(self, border_padding):
        """Zero rows ``((before, after), ...)`` per spatial axis that a folded
        ``ZeroPadding2D/3D`` adds at the global border before this ``valid``
        window layer (None: the layer's own ``padding``). The blocks are those
        of the unpadded input; the zeros are added at the global border only."""
        if border_padding is None:    # the class default: the layer's own padding
            return
        rows = tuple(tuple(r) if isinstance(r, (tuple, list)) else (r, r)
                     for r in border_padding)
        if len(rows) != self._ndim or any(
                len(r) != 2 or any(not isinstance(v, int) or isinstance(v, bool) or v < 0
                                   for v in r) for r in rows):
            raise ValueError(f"{self._label()}: Received border_padding={border_padding!r}; "
                             f"expected {self._ndim} pairs (before, after) of non-negative "
                             "ints, one per spatial axis.")
        if str(self.padding).lower() != "valid":
            raise ValueError(f"{self._label()}: border_padding needs padding='valid' (the "
                             f"zeros replace a ZeroPadding before a valid layer); received "
                             f"padding={self.padding!r}.")
        self.border_padding = rows

    def _plan_padding(self):
        """The padding the window plans use: ``border_padding`` per axis, else ``padding``."""
        return self.border_padding if self.border_padding is not None else self.padding

    def _init_spatial(self, split, group, overlap=None):
        split = sp.normalize_split(split)
        sp.check_split(split, self._ndim, self._label())
        group = deserialize_group(group)
        if not isinstance(group, (str, Group)):
            raise TypeError(f"{self._label()}: Received an invalid `group`: {group!r}; "
                            "expected a group name ('model', 'data' or 'world') or a "
                            "tfhybrid.process_grid.Group (as every parallel layer accepts).")
        if not (overlap is None or isinstance(overlap, bool)):
            raise TypeError(f"{self._label()}: Received an invalid `overlap`: {overlap!r}; "
                            "expected None (automatic), True or False.")
        self.split, self.group, self.overlap = split, group, overlap
        self._groups, self._plans = None, _Cache()

    def _overlap_now(self):
        """Overlap in graphs only: eagerly, ops run one at a time and it cannot help.

        ``overlap=None`` overlaps when a GPU is visible. ``_eager_overlap``
        (tests) forces the overlapped decomposition eagerly.
        """
        if tf.executing_eagerly() and not self._eager_overlap:
            return False
        return _gpu_visible() if self.overlap is None else self.overlap

    def _label(self):
        return f"{type(self).__name__} '{self.name}'"

    def _spatial_groups(self):
        """One sub-Group per spatial axis (registering them on first use)."""
        if self._groups is None:
            grid = runtime.current_grid()
            axis = self._axis_name(grid)
            mine = grid.group(axis)
            shape = sp.grid_shape(self.split, self._ndim, mine.size, self._label())
            names = [f"{axis}.{n}" for n in sp.SPATIAL_AXES[self._ndim]]
            every = sp.all_factored(_all_groups(grid, axis), shape)
            multi = [r for r in every if len(r) > 1]
            if multi:
                comm.register_groups(multi)
            self._groups = sp.factor_group(mine, shape, names)
        return self._groups

    def _axis_name(self, grid):
        """The grid axis of ``group`` (a name, or this rank's Group of that axis).

        The block sub-groups are registered collectively by every rank, so the
        group must be one of the grid's axes ('model', 'data', 'world').
        """
        if isinstance(self.group, str):
            return self.group
        name = self.group.name
        if name in ("model", "data", "world") and grid.group(name).ranks == self.group.ranks:
            return name
        raise ValueError(
            f"{self._label()}: Received group={self.group!r}; spatial layers split over a "
            "whole axis of the process grid (their block sub-groups are registered by every "
            "rank), so pass 'model', 'data' or 'world' (or tfhybrid.grid().group(name)).")

    def _grid_shape(self):
        return tuple(g.size for g in self._spatial_groups())

    def _global_shape(self, local_shape):
        shape = list(local_shape)
        for d, k in enumerate(self._grid_shape()):
            if shape[d + 1] is not None:
                shape[d + 1] *= k
        return tuple(shape)

    def _static_spatial(self, local_shape):
        dims = tuple(local_shape[1:1 + self._ndim])
        if len(local_shape) != self._ndim + 2 or any(v is None for v in dims):
            raise ValueError(
                f"{self._label()}: spatial layers need an input of rank {self._ndim + 2} "
                f"(batch, {', '.join(sp.SPATIAL_AXES[self._ndim])}, channels) with known "
                f"spatial sizes; received a block of shape {tuple(local_shape)}.")
        return dims


def _gpu_visible():
    if "gpu" not in _GPU:
        _GPU["gpu"] = bool(tf.config.list_logical_devices("GPU"))
    return _GPU["gpu"]


_GPU = {}


class _Cache:
    """Per-shape plans (not a dict, so Keras' attribute tracking leaves it alone)."""

    def __init__(self):
        self._items = {}

    def __contains__(self, key):
        return key in self._items

    def __getitem__(self, key):
        return self._items[key]

    def __setitem__(self, key, value):
        self._items[key] = value


def _all_groups(grid, name):
    """Every group of kind ``name`` in the world, same order on every rank."""
    if name == "model":
        return [grid.model_group_ranks(d) for d in range(grid.data_size)]
    if name == "data":
        return [grid.data_group_ranks(m) for m in range(grid.model_size)]
    if name == "world":
        return [tuple(range(grid.size))]
    grid.group(name)  # raises the grid's ValueError for unknown names
    return []


def window_plans(layer, local_shape, windows, strides, padding):
    """One validated :class:`AxisPlan` per spatial axis (cached per shape).

    Raises:
        ValueError: if an axis does not split evenly, its output does not,
            or its blocks are smaller than the halo (with the nearest valid
            global sizes).
    """
    key = (tuple(local_shape[1:1 + layer._ndim]), tuple(windows), tuple(strides), padding)
    if key not in layer._plans:
        dims = layer._static_spatial(local_shape)
        groups = layer._spatial_groups()
        shape = layer._grid_shape()
        plans = []
        for d, (n, g) in enumerate(zip(dims, groups)):
            rows = padding[d] if isinstance(padding, tuple) else padding   # per axis
            geom = sp.AxisGeometry(n * g.size, g.size, windows[d], strides[d], rows)
            if geom.problem():
                raise ValueError(sp.axis_problem_message(
                    layer._label(), layer._global_shape(local_shape), shape,
                    sp.SPATIAL_AXES[layer._ndim][d], geom))
            plans.append(sp.AxisPlan(geom, g.index))
        layer._plans[key] = tuple(plans)
    return layer._plans[key]


def output_block_shape(layer, local_shape, windows, strides, padding, channels):
    """This rank's output block shape (None for unknown spatial sizes)."""
    local_shape = tuple(local_shape)
    if any(v is None for v in local_shape[1:1 + layer._ndim]):
        return (local_shape[0],) + (None,) * layer._ndim + (channels,)
    plans = window_plans(layer, local_shape, windows, strides, padding)
    return (local_shape[0],) + tuple(p.geometry.out_block for p in plans) + (channels,)
