"""The ``tfhybrid calibrate`` job: compute timings and the machine JSON it writes.

See :mod:`tfhybrid.oracle.calibration.fit` for what is measured and the fits. This
module runs TensorFlow/Keras (and Horovod through :mod:`tfhybrid.comm`);
only ``tfhybrid calibrate`` imports it.

Example:
    >>> # horovodrun -np 2 --gloo .venv/bin/tfhybrid calibrate -o machine.json --quick
"""
from __future__ import annotations

import json
import math
import os
import resource
import time

from tfhybrid.oracle.calibration import fit as cal
from tfhybrid.oracle.machine import Machine


def _tf():
    import tensorflow as tf  # noqa: WPS433
    return tf


def measure_flop_rate(n=512, reps=5) -> float:
    """FLOP/s of a Dense(n) forward+backward on a (n, n) batch (this rank)."""
    tf = _tf()
    x = tf.random.normal([n, n])
    w = tf.Variable(tf.random.normal([n, n]))

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            y = tf.reduce_sum(tf.matmul(x, w))
        # return the forward too: with the gradient alone Grappler prunes the
        # forward matmul and the rate came out 3x too high (595 "GFLOP/s" on one core)
        return y, tape.gradient(y, w)

    sec = cal._best_time(lambda: [t.numpy() for t in step()], reps)
    return 2 * 2 * n ** 3 / sec     # forward x w and the weight gradient x^T dy


def measure_layer_times(model, batches, reps=7):
    """Per-layer forward/backward seconds per sample and the fixed part.

    The model's forward and forward+backward are timed as a whole (minimum of
    ``reps``, the sizes interleaved) at each batch size of ``batches`` (a
    sequence of ints), and a
    line ``t(b) = fixed + b * slope`` is fitted (least squares, both parts
    >= 0; with one batch size the fixed part is 0). The intercept is the
    batch-independent cost (op dispatch); the slope is what training pays
    per sample, and it is split over the layers in proportion to each
    layer's own forward / backward time at the largest batch
    (:func:`layer_shares`). Memory-bound layers (pooling, activations,
    normalisation, bias) cost far more than their FLOPs say, and strategies
    that keep them replicated (f, c, s) pay for them in full, so a FLOP
    split would under-charge those strategies. When a layer cannot be timed
    alone, the split falls back to FLOPs.

    Returns:
        ``({layer: (forward_s, backward_s)} per sample, fixed_s,
        {batch: forward+backward seconds measured})``.
    """
    from tfhybrid.oracle.profile import profile  # noqa: WPS433
    tf = _tf()
    fwd = tf.function(lambda a: model(a, training=True))
    fwd_bwd = _fwd_bwd(model)
    sizes = sorted(set(batches))
    calls = []
    for b in sizes:
        x = _inputs(model, b)
        calls += [lambda x=x: fwd(x).numpy(), lambda x=x: fwd_bwd(x)]
    # every size in turn, round after round: a burst of outside load then hits
    # all sizes alike instead of tilting the line (timed one size after the
    # other, a loaded node can give an intercept many times the quiet one)
    best = cal.times_interleaved(calls, reps)
    t_f, t_fb = best[0::2], best[1::2]
    (f0, f1), (fb0, fb1) = cal.fit_line(sizes, t_f), cal.fit_line(sizes, t_fb)
    b1 = max(fb1 - f1, 0.0)
    rows = profile(model).rows
    shares = layer_shares(model, [r.name for r in rows], sizes[-1], reps)
    if shares is None:
        shares = {r.name: (r.fwd_flops, r.bwd_flops) for r in rows}
    f_tot = sum(v[0] for v in shares.values()) or 1.0
    b_tot = sum(v[1] for v in shares.values()) or 1.0
    times = {name: (f1 * f / f_tot, b1 * bw / b_tot) for name, (f, bw) in shares.items()}
    return times, max(fb0, f0, 0.0), dict(zip(sizes, t_fb))


def layer_shares(model, names, batch, reps=7):
    """``{layer: (forward_s, backward_s)}`` of each layer of ``names`` timed alone
    (traced, on random inputs of its own input shape at ``batch``), less the
    time of an empty traced call; None when a layer cannot be timed alone
    (several inputs of unknown shape, a layer called twice, ...).

    Only the ratios are used (:func:`measure_layer_times` scales them to the
    whole model's measured time), so a per-call overhead common to every
    layer cancels to first order.

    The backward is what training runs: the input gradient only where the
    input depends on trainable weights (:func:`_inputs_needing_grad`). The
    first convolution of an image model never computes its input gradient
    in training, and for 3 input channels that gradient can cost several
    times its weight gradient on a CPU; timing it would give the first layer
    most of the backward and starve the others (f, s, p and c would then
    split the wrong share of the step).
    """
    tf = _tf()
    empty = tf.function(lambda a: a)
    probe = tf.zeros([1])
    needs_grad = _inputs_needing_grad(model)
    calls = [lambda: empty(probe).numpy()]
    for name in names:
        try:
            layer = model.get_layer(name)
            shapes = layer.input if isinstance(layer.input, list) else [layer.input]
            xs = [tf.random.uniform([batch, *t.shape[1:]], dtype=t.dtype) for t in shapes]
        except (ValueError, AttributeError, TypeError):
            return None
        arg = xs if isinstance(layer.input, list) else xs[0]
        fwd = tf.function(lambda a, layer=layer: layer(a, training=True))
        fwd_bwd = _traced_fwd_bwd(layer, needs_grad.get(name, True))
        calls += [lambda fwd=fwd, a=arg: _run(fwd, a), lambda fb=fwd_bwd, a=arg: _run(fb, a)]
    # every layer in turn, round after round (a burst of outside load hits all alike)
    best = cal.times_interleaved(calls, reps)
    base, out = best[0], {}
    for k, name in enumerate(names):
        t_f = max(best[1 + 2 * k] - base, 0.0)
        t_fb = max(best[2 + 2 * k] - base, 0.0)
        out[name] = (t_f, max(t_fb - t_f, 0.0))
    return out


def _traced_fwd_bwd(layer, watch):
    """``layer`` alone, traced: forward and the gradient of its output's sum
    with respect to its weights, and to its input when ``watch`` (what
    back-propagation computes there: :func:`_inputs_needing_grad`)."""
    tf = _tf()

    @tf.function
    def fwd_bwd(a):
        with tf.GradientTape() as tape:
            if watch:
                tape.watch(a)
            s = tf.reduce_sum(layer(a, training=True))
        return tape.gradient(s, [a, layer.trainable_weights] if watch
                             else layer.trainable_weights)
    return fwd_bwd


def _run(fn, a):
    """``fn(a)`` run to completion (every output fetched)."""
    return [t.numpy() for t in _tf().nest.flatten(fn(a)) if t is not None]


def _split_variants(layer, k):
    """``{"f<k>": (layer, input shape), "c<k>": ...}`` of a plain Conv/Dense layer
    (channels last): ``f`` keeps the input and 1/k of the output units (what a
    filter-parallel rank computes), ``c`` takes 1/k of the input channels into
    every output unit, without bias or activation (a channel-parallel rank's
    partial sums). Layers of other kinds, or whose units or channels k does
    not divide, have no variants."""
    cls, cfg = type(layer), layer.get_config()
    units = "filters" if "filters" in cfg else ("units" if cls.__name__ == "Dense" else None)
    try:
        shape = tuple(layer.input.shape)
    except (AttributeError, ValueError):
        return {}
    if units is None or cfg.get("data_format", "channels_last") != "channels_last" \
            or int(cfg.get("groups", 1) or 1) != 1 or "Transpose" in cls.__name__ \
            or shape[-1] is None:
        return {}
    out = {}
    if cfg[units] % k == 0:
        out[f"f{k}"] = (cls.from_config({**cfg, "name": None, units: cfg[units] // k}), shape)
    if shape[-1] % k == 0:
        part = {**cfg, "name": None, "activation": "linear", "use_bias": False}
        out[f"c{k}"] = (cls.from_config(part), shape[:-1] + (shape[-1] // k,))
    return out


def _block_rows(layer, axis, extent_out, parts, extent_in):
    """Input rows along ``axis`` of one block of ``parts``: what a rank computes
    ``ceil(extent_out / parts)`` output rows from. A ``valid`` window (kernel or
    pool) needs its halo as well; a ``same`` one pads by itself."""
    cfg = layer.get_config()
    window = cfg.get("kernel_size", cfg.get("pool_size"))
    out = -(-extent_out // parts)
    if window is None or str(cfg.get("padding", "valid")).lower() == "same":
        return -(-extent_in // parts)
    def at(v):
        return v[axis] if isinstance(v, (list, tuple)) else v
    stride = at(cfg.get("strides") or window)
    dilation = at(cfg.get("dilation_rate", 1) or 1)
    return (out - 1) * stride + (at(window) - 1) * dilation + 1


def _spatial_variants(layer, k):
    """``{"s<ph>x<pw>": (layer, input shape)}`` of a single-input layer with
    spatial axes (channels last): the layer itself on one block of each 2-D
    block grid of ``k`` ranks (``k`` ways along the only axis of a 1-D
    layer), the input rows one block's output needs per split axis
    (:func:`_block_rows`). Grids with more parts than output rows, and
    blocks the layer refuses, have no variant."""
    from tfhybrid.oracle.machine import spatial_key  # noqa: WPS433
    from tfhybrid.oracle.record import divisors  # noqa: WPS433
    try:
        shape, out_shape = tuple(layer.input.shape), tuple(layer.output.shape)
    except (AttributeError, ValueError):
        return {}
    spatial, spatial_out = shape[1:-1], out_shape[1:-1]
    if not spatial or len(spatial_out) != len(spatial) \
            or any(e is None for e in spatial + spatial_out) \
            or layer.get_config().get("data_format", "channels_last") != "channels_last":
        return {}
    grids = [(k,)] if len(spatial) == 1 else [(a, k // a) for a in divisors(k)]
    out = {}
    for grid in grids:
        if any(parts > e for parts, e in zip(grid, spatial_out)):
            continue
        rows = [_block_rows(layer, a, spatial_out[a], grid[a], e) if a < len(grid) and
                grid[a] > 1 else e for a, e in enumerate(spatial)]
        block = (shape[0], *rows, shape[-1])
        try:
            if any(d is not None and d <= 0 for d in layer.compute_output_shape(block)):
                continue
        except Exception:  # noqa: BLE001 - a block this layer cannot take: not timed
            continue
        out[spatial_key(grid)] = (layer, block)
    return out


def measure_split_scales(model, names, batch, ks, reps=7, spatial_names=()) -> dict:
    """``{layer: {"f<k>": share, "c<k>": share, "s<ph>x<pw>": share}}``: each
    Conv/Dense layer of ``names`` timed alone (traced forward+backward at
    ``batch``, as :func:`layer_shares` times it) whole and split ``k`` ways by
    output units and by input channels for each k of ``ks``, and each layer
    of ``spatial_names`` (the spatial region) whole and on one block of each
    block grid of k ranks, less an empty traced call; ``share`` = split /
    whole, kept in [1/k, 1]. A k-way split of a small layer does not run k
    times faster (per-op overheads do not shrink with the split: a small
    convolution split 4 ways by filters can keep well over half its whole
    time, not 0.25), and the strategies that
    split it (f, c, df, gmp; s, ds) are priced with the measured share
    (:meth:`tfhybrid.oracle.machine.Machine.split_share`, ``spatial_share``)."""
    tf = _tf()
    empty = tf.function(lambda a: a)
    probe = tf.zeros([1])
    needs_grad = _inputs_needing_grad(model)
    calls, keys = [lambda: empty(probe).numpy()], []

    def timed(layer, shape, watch):
        fwd_bwd, x = _traced_fwd_bwd(layer, watch), tf.random.uniform([batch, *shape[1:]])
        return lambda: _run(fwd_bwd, x)

    for name in list(names) + [n for n in spatial_names if n not in names]:
        try:
            layer = model.get_layer(name)
        except ValueError:
            continue
        watch = needs_grad.get(name, True)
        variants = {}
        for k in ks:
            if name in names:
                variants.update(_split_variants(layer, k))
            if name in spatial_names:
                variants.update(_spatial_variants(layer, k))
        if not variants:
            continue
        calls.append(timed(layer, tuple(layer.input.shape), watch))
        keys.append((name, None))
        for key, (part, shape) in variants.items():
            calls.append(timed(part, shape, watch))
            keys.append((name, key))
    if not keys:
        return {}
    logger = tf.get_logger()
    level = logger.level
    logger.setLevel("ERROR")     # one traced function per variant: no retracing advice
    try:
        best = cal.times_interleaved(calls, reps)
    finally:
        logger.setLevel(level)
    base, whole, out = best[0], {}, {}
    for (name, key), t in zip(keys, best[1:]):
        t = max(t - base, 0.0)
        if key is None:
            whole[name] = t
        elif whole.get(name):
            k = math.prod(int(g) for g in key[1:].split("x"))
            out.setdefault(name, {})[key] = min(max(t / whole[name], 1.0 / k), 1.0)
    return out


def _inputs_needing_grad(model) -> dict:
    """``{layer name: True}`` when back-propagation computes the gradient of that
    layer's input, i.e. some layer upstream of it has trainable weights (the
    model's inputs need none). Layers not found (nested, shared) are absent."""
    needs, out = {}, {}
    for layer in model.layers:
        try:
            ins = layer.input if isinstance(layer.input, list) else [layer.input]
            outs = layer.output if isinstance(layer.output, list) else [layer.output]
        except (ValueError, AttributeError):
            continue
        upstream = any(needs.get(id(t), False) for t in ins)
        out[layer.name] = upstream
        for t in outs:
            needs[id(t)] = upstream or bool(layer.trainable_weights)
    return out


def _train_batch(model, batch):
    """Random inputs and zero targets (numpy) for ``train_on_batch`` of ``model``."""
    import numpy as np  # noqa: WPS433
    return (np.random.rand(batch, *model.input_shape[1:]).astype("float32"),
            np.zeros((batch,) + tuple(model.output_shape[1:]), "float32"))


def _inputs(model, batch):
    import numpy as np  # noqa: WPS433
    return _tf().constant(np.random.rand(batch, *model.input_shape[1:]).astype("float32"))


def _fwd_bwd(model):
    """A callable running one traced forward+backward of ``model`` to completion."""
    tf = _tf()

    @tf.function
    def fwd_bwd(a):
        with tf.GradientTape() as tape:
            s = tf.reduce_sum(model(a, training=True))
        return tape.gradient(s, model.trainable_weights)

    return lambda a: [g.numpy() for g in fwd_bwd(a)]


def measure_contention(model, batch, reps=20, block=8, active=None):
    """Compute slowdown when every rank (or the first ``active`` ranks) computes
    at once (collective).

    Rank 0 times blocks of ``block`` back-to-back forward+backward
    passes of ``model`` at ``batch`` alone (the others wait), and every rank
    runs the same blocks at once, each block closed by a 1-item world
    allreduce (so the time is the slowest rank's), less that allreduce
    alone; the two kinds of block alternate. Per pass, best block of ``max(reps // 2, 3)`` each: blocks
    of several passes let the OS scheduler share the cores over a longer
    window than one pass, which makes the ratio far steadier on an
    oversubscribed node than single-pass minima. With ``active`` = k only
    ranks 0..k-1 compute in the "together" blocks while the others wait in
    the closing allreduce: the slowdown of k ranks sharing the node, which a
    pipeline or layer separation sees (their stages take turns).

    Returns:
        ``(factor, alone_s, together_s)`` per pass on rank 0 (factor >= 1);
        ``(None, None, None)`` on the other ranks.
    """
    from tfhybrid.comm import backend  # noqa: WPS433
    run, x = _fwd_bwd(model), _inputs(model, batch)
    world = tuple(range(backend.size()))
    one = _tf().zeros([1])
    blocks = max(reps // 2, 3)

    def sync():
        backend.allreduce(one, world, "calib.contention").numpy()

    def passes():
        for _ in range(block):
            run(x)

    busy = backend.size() if active is None else active

    def together():
        if backend.rank() < busy:
            passes()
        sync()

    t_sync = cal._best_time(sync, reps)
    # alone and together take turns, block after block, so outside load that
    # comes and goes hits both alike (their ratio is the result)
    passes()
    best_alone = best_all = float("inf")
    for _ in range(blocks):
        sync()
        if backend.rank() == 0:
            t0 = time.perf_counter()
            passes()
            best_alone = min(best_alone, time.perf_counter() - t0)
        sync()
        t0 = time.perf_counter()
        together()
        best_all = min(best_all, time.perf_counter() - t0)
    if backend.rank():
        return None, None, None
    alone = best_alone / block
    t_all = max((best_all - t_sync) / block, alone)
    return t_all / alone, alone, t_all


def measure_overlap(model, batch, reps=20):
    """How much of the gradient allreduce hides behind back-propagation (collective).

    Every rank times, in traced steps at ``batch``: the forward pass alone
    (``f``), forward+backward (``c``), the allreduce of every weight gradient
    alone (``r``, one allreduce per gradient, as Horovod issues them), and
    forward+backward with those allreduces issued as gradients appear
    (``s``). The hidden share is ``(c + r - s) / min(r, c - f)``, clipped to
    [0, 1]: 0 when the step costs compute plus communication, 1 when the
    communication vanishes behind the backward pass.

    Returns:
        ``(overlap, forward_s, compute_s, reduce_s, step_s)`` (rank 0's timings).
    """
    from tfhybrid.comm import backend  # noqa: WPS433
    tf = _tf()
    world = tuple(range(backend.size()))
    weights = model.trainable_weights
    x = _inputs(model, batch)

    def grads(a):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(model(a, training=True))
        return tape.gradient(loss, weights)

    def reduced(gs):
        return [backend.allreduce(g, world, f"calib.overlap.{i}") for i, g in enumerate(gs)]

    forward = tf.function(lambda a: tf.reduce_sum(model(a, training=True)))
    compute = tf.function(grads)
    reduce = tf.function(reduced)
    step = tf.function(lambda a: reduced(grads(a)))
    local = compute(x)

    def timed(fn, arg):
        cal.sync(backend)
        return cal._best_time(lambda: tf.nest.map_structure(lambda t: t.numpy(), fn(arg)), reps)

    f, c, r, s = timed(forward, x), timed(compute, x), timed(reduce, local), timed(step, x)
    backward = max(c - f, 0.0)
    room = min(r, backward)
    share = 0.0 if room <= 0 else min(max((c + r - s) / room, 0.0), 1.0)
    return share, f, c, r, s


def measure_step_overhead(reps=20) -> float:
    """Seconds of one ``train_on_batch`` of a 1-unit Dense model on one sample."""
    import keras  # noqa: WPS433
    import numpy as np  # noqa: WPS433
    m = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1)])
    m.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse")
    x, y = np.ones((1, 1), "float32"), np.ones((1, 1), "float32")
    return cal._best_time(lambda: m.train_on_batch(x, y), reps)


def _rss_bytes():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def measure_gamma(model, batch, naive_bytes, steps=2):
    """(gamma, measured bytes): peak-RSS growth of training ``model`` / naive estimate.

    The peak resident size only grows: in a process that already peaked higher
    (an earlier, larger model) training ``model`` moves nothing and the factor
    cannot be measured; gamma then stays 1 (the naive estimate), measured 0.
    """
    import keras  # noqa: WPS433
    before = _rss_bytes()
    model.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse")
    x, y = _train_batch(model, batch)
    for _ in range(steps):
        model.train_on_batch(x, y)
    grown = _rss_bytes() - before
    if grown <= 0:
        return 1.0, 0.0
    return cal.estimate_gamma(grown, naive_bytes), grown


def _sizes(max_bytes, count):
    lo, out = 4096, []
    for i in range(count):
        out.append(int(lo * (max_bytes / lo) ** (i / max(count - 1, 1))))
    return out


def _group_sizes(world):
    gs, g = [], 2
    while g < world:
        gs.append(g)
        g *= 2
    return gs + [world] if world > 1 else []


def _model_part(model_name, batches, log, reps=5, split_ks=()):
    from tfhybrid.oracle.models import build_model  # noqa: WPS433
    from tfhybrid.oracle.profile import profile  # noqa: WPS433
    from tfhybrid.oracle.api import predict  # noqa: WPS433
    model = build_model(model_name)
    naive = predict(model, "serial", 1, batches[0],
                    {"alpha": 0, "beta": 0, "flop_rate": 1.0}).memory_bytes
    gamma, grown = measure_gamma(model, batches[0], naive)   # first: peak RSS is monotone
    if grown > 0:
        log(f"  gamma = {gamma:.3g} (RSS grew {grown / 1e6:.1f} MB, naive {naive / 1e6:.1f} MB)")
    else:
        log("  gamma = 1 (not measured: this process's peak RSS was already above "
            "what training this model needs; calibrate in a fresh process to measure it)")
    log(f"  timing {model.name} forward/backward at batches {list(batches)}")
    times, fixed, fwd_bwd_s = measure_layer_times(model, batches, reps=4 * reps)
    log(f"  fixed forward+backward cost {fixed * 1e3:.3g} ms per iteration")
    scales = {}
    if split_ks:
        rows = profile(model).rows
        names = [r.name for r in rows if r.kind in ("conv", "dense")]
        region = []            # the spatial region: leading rows that keep spatial axes
        for r in rows:
            if r.kind == "dense" or not r.spatial_out:
                break
            if r.kind in ("conv", "pool", "norm", "elementwise"):
                region.append(r.name)
        try:
            scales = measure_split_scales(model, names, batches[-1], split_ks,
                                          reps=4 * reps, spatial_names=region)
        except Exception as err:  # noqa: BLE001 - rank 0 alone: never leave the others waiting
            log(f"  split layers not timed ({type(err).__name__}: {err}); split "
                "strategies keep 1/k per layer")
            scales = {}
        shown = ", ".join(f"{n} {' '.join(f'{k} {v:.2f}' for k, v in sorted(s.items()))}"
                          for n, s in scales.items())
        log(f"  split layers' share of their whole time at batch {batches[-1]}: "
            f"{shown or 'none (no plain Conv/Dense layer)'}")
    batch = batches[1] if len(batches) > 1 else batches[0]
    update = measure_update_overhead(model, batch, fwd_bwd_s[batch], reps=4 * reps)
    log(f"  train_on_batch beyond forward+backward (loss, update, Keras): "
        f"{update * 1e3:.3g} ms")
    return times, gamma, fixed, update, scales


def measure_update_overhead(model, batch, fwd_bwd_s, reps=20) -> float:
    """Seconds one ``train_on_batch`` of ``model`` (compiled) costs beyond its
    traced forward+backward at ``batch`` (``fwd_bwd_s``, as
    :func:`measure_layer_times` timed it): loss, weight update and Keras'
    step machinery, which grow with the number of variables (a 1-unit
    model's step, :func:`measure_step_overhead`, is the floor)."""
    x, y = _train_batch(model, batch)
    t_train = cal._best_time(lambda: model.train_on_batch(x, y), reps)
    return max(t_train - fwd_bwd_s, 0.0)


def run(out, max_bytes=4 << 20, n_sizes=6, reps=5, model=None, batch=8, log=print,
        collective_stat="best") -> dict:
    """Run the whole calibration on every rank; rank 0 writes ``out``. Returns the spec.

    ``collective_stat``: ``"best"`` (each collective's fastest repetition),
    ``"median"`` or ``"mean"`` (its typical one, or its trimmed mean: across
    nodes, where a step pays the network's spread,
    :func:`tfhybrid.oracle.calibration.fit.times_interleaved`)."""
    from tfhybrid.comm import backend  # noqa: WPS433
    world, rank, _ = backend.init()
    say = log if rank == 0 else (lambda *_: None)
    t0 = time.time()
    say(f"calibrating on {world} ranks: collectives up to {max_bytes} bytes "
        f"({collective_stat} of {reps})")
    samples = cal.time_collectives(_sizes(max_bytes, n_sizes), _group_sizes(world), reps, say,
                                   stat=collective_stat)
    cal.sync(backend)
    slots = cal.compute_slots()
    rate, overhead, times, gamma, fixed, scales = None, 0.0, None, 1.0, 0.0, None
    # compute alone (others wait; a failure raises on every rank): prediction
    # scales by compute_slots
    with backend.together("calibrate's compute timing on rank 0"):
        if rank == 0:
            rate = measure_flop_rate()
            say(f"  flop rate {rate / 1e9:.3g} GFLOP/s on one rank ({slots} compute slots)")
            overhead = measure_step_overhead(reps=3 * reps)
            say(f"  step overhead {overhead * 1e3:.3g} ms")
            if model:   # from half the local batch up to the global one (what serial runs):
                # four sizes, so one noisy timing cannot tilt the fixed/per-sample split
                sizes = sorted({max(1, batch // 2), batch, 2 * batch, batch * max(world, 2)})
                times, gamma, fixed, update, scales = _model_part(
                    model, sizes, say, reps, split_ks=_group_sizes(world))
                overhead = max(overhead, update)
    contention = None
    if model and world > 1:   # every rank computes at once: the measured slowdown
        from tfhybrid.oracle.models import build_model  # noqa: WPS433
        # the ratio of two noisy minima: the median of five estimates
        net = build_model(model)
        contention = {}
        # every count of ranks computing at once up to the node's (a pipeline's or
        # layer separation's stages take turns: fewer ranks than the node holds)
        for k in _group_sizes(backend.local_size()):
            runs = sorted((measure_contention(net, batch, 4 * reps, active=k)
                           for _ in range(5)), key=lambda r: r[0] or 0.0)
            factor, alone, together = runs[2]
            if rank == 0:
                contention[str(k)] = factor
                say(f"  {k} ranks computing at once: {together * 1e3:.3g} ms for the "
                    f"slowest vs {alone * 1e3:.3g} ms alone (x{factor:.2f}; {slots} compute "
                    f"slots would say x{max(1.0, k / slots):.2f})")
        contention = contention or None
    overlap = 0.0
    if model and world > 1:   # the median of three estimates, as for contention
        from tfhybrid.oracle.models import build_model  # noqa: WPS433
        net = build_model(model)
        runs = sorted((measure_overlap(net, batch, 4 * reps) for _ in range(3)),
                      key=lambda r: r[0])
        overlap, f, c, r, s = runs[1]
        say(f"  gradient allreduce hidden behind backward: {overlap:.2f} (forward "
            f"{f * 1e3:.3g} ms, forward+backward {c * 1e3:.3g} ms, allreduce {r * 1e3:.3g} ms, "
            f"both {s * 1e3:.3g} ms)")
    # Rank 0 alone built Keras objects: reset the auto-name counters on every
    # rank so later models get the same layer (and so collective) names everywhere.
    import keras  # noqa: WPS433
    keras.utils.clear_session()
    cal.sync(backend)
    spec = _spec(samples, rate, times, gamma, overhead, slots, world, backend.local_size())
    spec["compute_fixed_s"] = fixed
    spec["split_scales"] = scales or None
    spec["compute_contention"] = contention
    spec["overlap"] = overlap
    if rank == 0:
        Machine.from_dict(spec)
        with open(out, "w", encoding="utf-8") as fh:
            json.dump(spec, fh, indent=1)
        say(f"wrote {out} in {time.time() - t0:.1f} s")
    cal.sync(backend)
    return spec


def _spec(samples, rate, times, gamma, overhead, slots, world, local):
    tiers = cal.fit_tiers(samples) if samples else []
    top = tiers[-1] if tiers else None
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / max(1, local)
    return {
        "comment": "tfhybrid calibrate: latency/alpha/beta per group size (tiers) and per "
                   "collective kind, fitted to traced chains of Horovod allreduce/allgather/"
                   "alltoall; flop_rate per compute slot.",
        "alpha": top.alpha if top else 0.0, "beta": top.beta if top else 0.0,
        "latency": top.latency if top else 0.0,
        "collectives": top.collectives if top else None,
        "tiers": [{"max_ranks": t.max_ranks, "alpha": t.alpha, "beta": t.beta,
                   "latency": t.latency, "collectives": t.collectives} for t in tiers],
        "flop_rate": rate, "layer_times": {k: list(v) for k, v in times.items()} if times else None,
        "memory_bytes": mem, "phi": 1.0, "gamma": gamma, "bytes_per_item": 4,
        "step_overhead_s": overhead, "compute_slots": slots, "ranks_per_node": local,
        "source": f"tfhybrid calibrate on {world} ranks at {time.strftime('%Y-%m-%d %H:%M')}",
        "fits": [list(s) for s in samples],
    }
