"""Where a training step's time goes, measured on the running job, beside the oracle.

:class:`Profile` is a Keras callback. For ``steps`` steps of ``model.fit``
(after ``start`` warm-up steps) it records each step's wall time; then every
rank runs, on a synthetic local batch of the same shape:

- the traced forward pass, and the traced forward+backward pass (what the
  compiled train step runs before the optimizer), every rank starting each
  repetition together as in a step (so ranks that share cores are timed
  sharing them);
- every collective that forward+backward issues (recorded while it is
  traced, :func:`tfhybrid.comm.backend.recording_collectives`), replayed
  alone on zeros of the same shapes and groups, and sorted into the oracle's
  phases by what it is: halo exchanges (``halo``), allgathers and their
  adjoint reduce-scatters (``FB-allgather``), allreduces of activations or
  their gradients (``FB-allreduce``), layer-separation transfers (``p2p``);
- the traced gradient reduction of the :class:`tfhybrid.DistributedOptimizer`
  (``GE-allreduce``).

The measured compute is the traced forward+backward less the collectives
inside it; the rest of the step (``update+rest``) is the optimizer update,
input wait and Keras' per-step work. The oracle's prediction for the same
model, strategy, model-group size, global batch and machine file is printed
beside it, with ``accuracy = min(m, p) / max(m, p)`` per phase (1 is exact).
The model's state is restored after the measurement (BatchNormalization
statistics, RNG seeds); its weights are not touched.

Example:
    >>> profile = tfhybrid.callbacks.Profile(steps=10, batch_size=64)
    >>> model.fit(ds, epochs=1, callbacks=tfhybrid.callbacks.standard() + [profile])
    >>> profile.result["accuracy"]["total"]
"""
from __future__ import annotations

import statistics
import time

import keras
import numpy as np
import tensorflow as tf

from tfhybrid import runtime
from tfhybrid.comm import backend

PHASES = ("compute", "FB-allgather", "FB-allreduce", "halo", "p2p", "GE-allreduce",
          "update+rest", "total")
_COMM = PHASES[1:6]


def phase_of(op: str, name: str) -> str:
    """The oracle phase of one collective (its op and tfhybrid's name for it).

    Example:
        >>> phase_of("alltoall", "tfh.conv1.halo"), phase_of("allgather", "tfh.fc.fwd")
        ('halo', 'FB-allgather')
        >>> phase_of("alltoall", "p.fwd.0.1"), phase_of("alltoall", "ls.bwd")
        ('p2p', 'p2p')
    """
    if "halo" in name:
        return "halo"
    if ".ls." in f".{name}." or name.startswith("tfh.ls"):
        return "p2p"
    if name.split(".")[:1] == ["p"] and name.split(".")[1:2] in (
            ["fwd"], ["bwd"], ["call"], ["eval"], ["fit"]):   # the pipeline's transfers
        return "p2p"
    if op in ("allgather", "alltoall", "broadcast"):   # reduce-scatter and rooted reduce:
        return "FB-allgather"                          # alltoalls; broadcast: gmp's "B"
    if op == "grouped_allreduce":
        return "GE-allreduce"
    return "FB-allreduce"


def _check(value, name, minimum):
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"Received an invalid value for `{name}`: {value!r}; expected an "
                         f"integer >= {minimum}.")
    return value


def _synthetic_batch(model, local_batch):
    rng = np.random.default_rng(0)
    out = []
    for tensor in model.inputs:
        shape = (local_batch,) + tuple(tensor.shape[1:])
        dtype = tf.as_dtype(tensor.dtype)
        if dtype.is_floating:
            out.append(tf.constant(rng.standard_normal(shape).astype(dtype.as_numpy_dtype)))
        else:
            out.append(tf.zeros(shape, dtype))
    return out[0] if len(out) == 1 else out


def _timed(fn, reps, sync=None, pick=min):
    """``pick`` (one of calibration's statistics, :func:`_stat`) of ``reps``
    timings of ``fn``, each after ``sync``."""
    times = []
    for _ in range(reps):
        if sync is not None:
            sync()
        start = time.perf_counter()
        for t in tf.nest.flatten(fn()):
            if hasattr(t, "numpy"):
                t.numpy()
        times.append(time.perf_counter() - start)
    return pick(times)


def _stat(stat):
    """Calibration's statistic named ``stat`` (best, median or mean)."""
    from tfhybrid.oracle.calibration.fit import stat_function  # noqa: WPS433
    return stat_function(stat)


def _replay_fn(op, ranks, inputs, splits):
    """A traced function issuing one recorded collective alone, on zeros."""
    zeros = [tf.zeros([d if d is not None else 1 for d in t.shape], t.dtype) for t in inputs]
    fixed = None if splits is None else tf.get_static_value(splits)
    if op == "alltoall" and fixed is None:     # rows decided at run time: split evenly
        rows, k = zeros[0].shape[0], len(ranks)
        fixed = [rows // k + (i < rows % k) for i in range(k)]
    calls = {"allgather": lambda: backend.allgather(zeros[0], ranks, "profile.replay"),
             "allreduce": lambda: backend.allreduce(zeros[0], ranks, "profile.replay"),
             "grouped_allreduce": lambda: backend.grouped_allreduce(zeros, ranks,
                                                                    "profile.replay"),
             "alltoall": lambda: backend.alltoall(zeros[0], list(fixed), ranks,
                                                  "profile.replay"),
             "broadcast": lambda: backend.broadcast(zeros[0], ranks[0], ranks,
                                                    "profile.replay")}
    return tf.function(calls[op])


def replay_collectives(calls, reps: int = 3, stat: str = "best") -> dict:
    """Seconds per oracle phase of the recorded collectives, each replayed alone
    (traced, on zeros of the recorded shapes; the ``stat`` of ``reps``: best,
    median or mean, as ``tfhybrid calibrate --collective-stat``). Collective:
    every rank replays the calls of its own groups in the recorded order."""
    pick = _stat(stat)
    out = {phase: 0.0 for phase in _COMM}
    me = backend.rank()
    for op, name, ranks, inputs, splits in calls:
        if me not in ranks or len(ranks) < 2 or op not in ("allgather", "allreduce",
                                                           "grouped_allreduce", "alltoall",
                                                           "broadcast"):
            continue
        fn = _replay_fn(op, ranks, inputs, splits)
        fn()
        # the group's ranks start each replay together: without it a rank's time
        # holds its partners' late arrival (several times calibration's time for
        # the same collective on an oversubscribed node), and the compute left
        # over (forward+backward less the replays) comes out 0
        sync = _group_sync(ranks)
        out[phase_of(op, name)] += _timed(fn, reps, sync, pick)
    return out


def _group_sync(ranks):
    one = tf.zeros([1])
    return lambda: backend.allreduce(one, ranks, "profile.sync").numpy()


def _needed_ops(graph):
    """Names of the ops of a traced function's graph that a call runs: those its
    outputs and control outputs depend on. TensorFlow prunes the rest (Horovod's
    ops are not stateful), e.g. the halo return of a convolution of the model's
    input, whose gradient nobody asks for."""
    seen, todo = set(), [t.op for t in graph.outputs] + list(graph.control_outputs)
    while todo:
        op = todo.pop()
        if op.name in seen:
            continue
        seen.add(op.name)
        todo.extend(t.op for t in op.inputs)
        todo.extend(op.control_inputs)
    return seen


def executed_collectives(calls, graph):
    """The recorded ``calls`` (:func:`tfhybrid.comm.backend.recording_collectives`)
    that running ``graph`` (the traced function they were recorded in) executes:
    a traced collective whose result nothing needs is pruned and never runs, so
    it must not be replayed. Calls recorded eagerly or in another graph (a
    nested function's body) are kept.

    Example:
        >>> both = tf.function(grads)
        >>> with backend.recording_collectives() as calls:
        ...     both()
        >>> executed_collectives(calls, both.get_concrete_function().graph)
    """
    needed = _needed_ops(graph)
    out = []
    for call in calls:
        inputs = call[3]
        ops = [c for t in inputs[:1] if getattr(t, "graph", None) is graph
               for c in t.consumers() if c.type.startswith("Horovod")]
        ops = [op for op in ops if call[1] in op.name] or ops
        if not ops or any(op.name in needed for op in ops):
            out.append(call)
    return out


def measure_phases(model, local_batch: int, reps: int = 3, stat: str = "best") -> dict:
    """Seconds of each phase of one step of ``model`` at ``local_batch`` (collective).

    Returns a dict with ``forward``, ``forward_backward`` (the traced passes
    the train step runs), and one entry per communication phase: the
    collectives the traced forward+backward issues, replayed alone, and
    ``GE-allreduce``, the DistributedOptimizer's traced gradient reduction
    (0 without one). The model's non-trainable state is restored.

    ``stat``: each phase's best repetition (default), or its median or
    trimmed mean (compare with a machine file calibrated with the same
    ``--collective-stat``).
    """
    pick = _stat(stat)          # before any collective: every rank refuses alike
    x = _synthetic_batch(model, local_batch)
    weights = model.trainable_weights
    saved = [(v, v.numpy()) for v in model.non_trainable_variables]

    def grads():
        with tf.GradientTape() as tape:
            loss = tf.add_n([tf.reduce_sum(tf.cast(o, tf.float32))
                             for o in tf.nest.flatten(model(x, training=True))])
        # the loss is returned as a train step returns it: the forward's
        # collectives are then not pruned (a sum's gradient needs no value)
        return loss, tape.gradient(loss, weights)

    try:
        forward = tf.function(lambda: model(x, training=True))
        both = tf.function(grads)
        forward()
        with backend.recording_collectives() as calls:
            _, local = both()         # traced here: records the step's collectives
        calls = executed_collectives(calls, both.get_concrete_function().graph)
        # every rank starts each repetition together, as a training step runs them:
        # without it the best of a few repetitions is one that ran while the other
        # ranks did not compute, faster than a step where every rank computes at
        # once (what calibration's compute_contention times)
        world = _group_sync(tuple(range(backend.size()))) if backend.size() > 1 else None
        out = {"forward": _timed(forward, reps, world, pick),
               "forward_backward": _timed(both, reps, world, pick)}
        backend.barrier()
        out.update(replay_collectives(calls, reps, stat))
        optimizer = getattr(model, "optimizer", None)
        reduce = getattr(optimizer, "reduce_gradients", None)
        if reduce is not None and runtime.current_grid().size > 1:
            step = tf.function(lambda: reduce(local, weights))
            step()
            backend.barrier()
            out["GE-allreduce"] = _timed(step, reps, world, pick)   # ranks start together
    finally:
        for v, value in saved:
            v.assign(value)
    return out


def _strategy_of(model):
    from tfhybrid.transformer.api import info_of  # noqa: WPS433 - TF-heavy, lazy

    try:
        info = info_of(model)
    except ValueError:
        return "d", model
    from tfhybrid.transformer.source import rebuild  # noqa: WPS433

    return info.plan.strategy, rebuild(info.source, info.objects)


def _options_as_built(strategy, model, grid):
    """The oracle options that price ``model`` as transform built it on ``grid``
    (None when the oracle has no such variant): the model groups; f/c/df price
    layers the group cannot split as replicated (a model that transform built
    has every other such layer split or replicated); p its micro-batches; ls
    its FC workers."""
    from tfhybrid.oracle.api import grid_options  # noqa: WPS433

    if strategy == "p":
        return {"segments": getattr(model, "micro_batches", None)} \
            if grid.model_size == grid.size else None
    if strategy == "ls":
        return {"n_f": getattr(model, "n_f", None)} if grid.model_size == 1 else None
    opts = grid_options(grid.size, grid.model_size).get(strategy)
    if opts is None:
        return None
    opts = dict(opts)
    if strategy in ("f", "c", "df"):
        opts["fallback"] = "replicate"
    return opts


def predicted_phases(model, global_batch: int, machine) -> dict:
    """The oracle's prediction for ``model`` as it runs (strategy, model groups)."""
    from tfhybrid import oracle  # noqa: WPS433

    strategy, original = _strategy_of(model)
    grid = runtime.current_grid()
    if strategy not in oracle.STRATEGY_NAMES:
        raise ValueError(f"tfhybrid.callbacks.Profile cannot predict strategy {strategy!r}; "
                         f"the oracle knows {oracle.STRATEGY_NAMES}.")
    opts = _options_as_built(strategy, model, grid)
    if opts is None:
        raise ValueError(f"The oracle has no {strategy!r} variant for model groups of "
                         f"{grid.model_size} at p={grid.size}.")
    pred = oracle.predict(original, strategy, grid.size, global_batch, machine, **opts)
    out = {phase: pred.comm_s.get(phase, 0.0) for phase in _COMM}
    out["compute"] = pred.compute_s
    out["update+rest"] = pred.overhead_s - pred.hidden_s
    out["total"] = pred.total_s
    return out


def _accuracy(measured, predicted):
    if measured <= 0 and predicted <= 0:
        return None
    return min(measured, predicted) / max(measured, predicted)


class Profile(keras.callbacks.Callback):
    """Measure forward, backward, each collective phase and the rest of a step,
    and print them beside the oracle's prediction (rank 0).

    Args:
        steps: Number of training steps timed (wall time per step, median).
        start: Steps skipped first (tracing, warm-up).
        batch_size: The global batch (needed for the local batch of the
            synthetic measurement and for the prediction).
        machine: Machine file/dict for the prediction (default: the machine
            shipped for the development CPU box, ``oracle.default_machine_path()``).
        print_fn: Where the table goes (rank 0; None: nowhere).
        png: Optional path of a stacked bar chart, measured vs predicted per
            phase (ParaDL Fig. 3 style; needs matplotlib).

    After the measurement ``result`` holds ``measured`` (rank 0),
    ``slowest`` (the maximum over ranks per phase), ``predicted`` and
    ``accuracy`` per phase.

    Raises:
        ValueError: invalid ``steps``/``start``/``batch_size`` (at
            construction), or a model the oracle cannot predict.

    Example:
        >>> model.fit(ds, callbacks=[tfhybrid.callbacks.Profile(steps=10, batch_size=64)])
    """

    def __init__(self, steps=10, start=2, batch_size=None, machine=None, print_fn=print,
                 png=None):
        super().__init__()
        self.steps = _check(steps, "steps", 1)
        self.start = _check(start, "start", 0)
        if batch_size is None:
            raise ValueError("tfhybrid.callbacks.Profile needs batch_size=<global batch> (the "
                             "batch your dataset yields over all ranks), e.g. "
                             "Profile(steps=10, batch_size=64).")
        self.batch_size = _check(batch_size, "batch_size", 1)
        self.machine, self.print_fn, self.png = machine, print_fn, png
        self._times, self._begin, self._seen = [], None, 0
        self.result = None

    def on_train_batch_begin(self, batch, logs=None):
        self._begin = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        self._seen += 1
        if self.result is not None or self._seen <= self.start:
            return
        self._times.append(time.perf_counter() - self._begin)
        if len(self._times) == self.steps:
            self.result = self.measure()
            if self.print_fn is not None and backend.rank() == 0:
                self.print_fn(self.table())
            if self.png and backend.rank() == 0:
                self.plot(self.png)

    def measure(self) -> dict:
        """Measure now (collective: every rank at the same step)."""
        from tfhybrid.data import local_batch_size  # noqa: WPS433
        from tfhybrid.oracle import default_machine_path  # noqa: WPS433

        local = local_batch_size(self.batch_size, self.model)
        phases = measure_phases(self.model, local)
        step = statistics.median(self._times)
        comm = {p: phases[p] for p in _COMM}
        fb_comm = sum(v for p, v in comm.items() if p != "GE-allreduce")
        measured = dict(comm)
        measured["compute"] = max(phases["forward_backward"] - fb_comm, 0.0)
        measured["update+rest"] = max(step - phases["forward_backward"]
                                      - comm["GE-allreduce"], 0.0)
        measured["total"] = step
        vector = tf.constant([[measured[p] for p in PHASES]], tf.float64)
        ranks = tuple(range(backend.size()))
        every = (backend.allgather(vector, ranks, "profile.phases").numpy()
                 if len(ranks) > 1 else vector.numpy())
        slowest = dict(zip(PHASES, every.max(axis=0).tolist()))
        predicted = predicted_phases(self.model, self.batch_size,
                                     self.machine or default_machine_path())
        return {"measured": measured, "slowest": slowest, "predicted": predicted,
                "accuracy": {p: _accuracy(slowest[p], predicted[p]) for p in PHASES},
                "forward_s": phases["forward"], "steps": len(self._times),
                "world_size": len(ranks)}

    def table(self) -> str:
        """The measured-vs-predicted table (milliseconds per step)."""
        r = self.result
        lines = [f"tfhybrid Profile: {r['steps']} steps on {r['world_size']} ranks "
                 f"(ms per step; forward alone {r['forward_s'] * 1e3:.2f} ms)",
                 f"{'phase':<14}{'rank 0':>10}{'slowest':>10}{'predicted':>11}{'accuracy':>10}"]
        for p in PHASES:
            acc = r["accuracy"][p]
            lines.append(f"{p:<14}{r['measured'][p] * 1e3:>10.2f}{r['slowest'][p] * 1e3:>10.2f}"
                         f"{r['predicted'][p] * 1e3:>11.2f}"
                         f"{'-' if acc is None else f'{acc:.2f}':>10}")
        lines.append("accuracy = min(slowest, predicted) / max(...); update+rest = step - "
                     "forward/backward - gradient reduction (optimizer, input, Keras)")
        return "\n".join(lines)

    def plot(self, path):
        """Stacked bars: measured (slowest rank) and predicted, one segment per phase."""
        import matplotlib  # noqa: WPS433

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: WPS433

        fig, ax = plt.subplots(figsize=(4.5, 4))
        for x, key in enumerate(("slowest", "predicted")):
            bottom = 0.0
            for p in PHASES[:-1]:
                value = self.result[key][p] * 1e3
                ax.bar(x, value, bottom=bottom, label=p if x == 0 else None,
                       color=f"C{PHASES.index(p)}")
                bottom += value
        ax.set_xticks([0, 1], ["measured", "predicted"])
        ax.set_ylabel("ms per step")
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
