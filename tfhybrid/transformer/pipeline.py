"""The pipeline ``p`` (ParaDL §3.4; GPipe's fill-drain schedule).

The layers are cut into S contiguous stages, one per rank of a model group
(``tfhybrid.init(model_parallel=S)``); the model groups are data-parallel
replicas of the pipeline (``p`` x ``d``). One training step on a pipeline:

1. every rank of the pipeline reads the same local batch
   (``tfhybrid.data.shard`` splits the global batch over the data groups);
   stage 0 cuts it into M micro-batches;
2. stage s receives micro-batch m from stage s-1 (one alltoall on the pair's
   process set, :mod:`tfhybrid.comm.p2p`), runs its layers, sends the result
   to stage s+1; TensorFlow's executor runs stage s on micro-batch m while
   stage s+1 works on m-1;
3. the last stage concatenates the M outputs and computes the compiled loss
   on the whole local batch, so every backward starts after the M forwards
   (fill-drain); it sends each micro-batch's error back; stage s back-propagates
   it through its layers and sends its input's error to stage s-1;
4. each stage averages its gradients over its data group (the ranks that
   hold the same stage) and applies them: the loss is the mean over the
   pipeline's local batch, so the average is the single-process gradient of
   the mean over the global batch;
5. the last stage broadcasts its predictions (no gradient) to the pipeline,
   so every rank updates the same loss tracker and compiled metrics: rank 0's
   progress bar shows its pipeline's true loss, as in ``d``.

Cut: only where a single tensor crosses (never inside a residual block),
balanced by forward+backward FLOPs per layer, or by the calibrated
``layer_times`` of a machine file (:func:`plan_stages`).

Per-rank parameters are its stage's only: each rank builds a fresh copy of
its stage's layers with global rank 0's weights.

BatchNormalization: a stage that holds one runs its M micro-batches as one
batch in training (its moments must be those of the whole batch, as in single
process), synchronized over the data group; other stages keep micro-batching.

Example:
    >>> tfhybrid.init(model_parallel=2)                       # horovodrun -np 4
    >>> model = tfhybrid.transform(cnn, strategy="p", stages=2, micro_batches=4)
    >>> model.compile(tfhybrid.DistributedOptimizer(keras.optimizers.SGD(0.1)), "mse")
    >>> model.fit(tfhybrid.data.shard(ds, model=model), epochs=1)
    >>> full = tfhybrid.gather(model)
"""
from __future__ import annotations

import dataclasses
from typing import Tuple

import keras
import numpy as np
import tensorflow as tf

from tfhybrid import batch_losses
from tfhybrid.comm import backend
from tfhybrid.optimizer import clipping
from tfhybrid.comm.p2p import anchored, receive_rows, send_rows
from tfhybrid.transformer.graph import find_nested_layer, set_trainable_flags
from tfhybrid.transformer.parts import PartModel
from tfhybrid.transformer.source import finalize_states


# -- pure: where to cut ------------------------------------------------------------------

def cut_positions(graph):
    """Positions k (1..n-1) in ``graph``'s topological order where the model can be cut
    between ``nodes[:k]`` and ``nodes[k:]``: exactly one tensor, produced by a layer,
    crosses (so never inside a residual block).

    Example:
        >>> cut_positions(describe_graph(residual_cnn))   # after the stem, after the add, ...
    """
    nodes = graph.nodes
    n = len(nodes)
    produced = {t: -1 for t in graph.inputs}
    last_use = {}
    for i, node in enumerate(nodes):
        produced[node.output] = i
        for t in node.inputs:
            last_use[t] = max(last_use.get(t, -1), i)
    for t in graph.outputs:
        last_use[t] = n
    out = []
    for k in range(1, n):
        crossing = [t for t, p in produced.items() if p < k <= last_use.get(t, -1)]
        if len(crossing) == 1 and produced[crossing[0]] >= 0:
            out.append(k)
    return tuple(out)


def balance(costs, positions, stages):
    """The ``stages - 1`` cut positions (from ``positions``) that minimise the most
    expensive stage (ties: the smallest sum of squared stage costs).

    Args:
        costs: Cost of each node, in topological order.
        positions: Allowed cut positions (see :func:`cut_positions`).
        stages: Number of stages S (``S - 1 <= len(positions)``).

    Returns:
        Sorted tuple of S-1 positions.

    Example:
        >>> balance([1, 1, 1, 1], (1, 2, 3), 2)
        (2,)
    """
    n = len(costs)
    prefix = np.concatenate([[0.0], np.cumsum(np.asarray(costs, dtype=float))])
    bounds = (0,) + tuple(positions) + (n,)
    last = len(bounds) - 1
    # best[j][i]: (max cost, sum of squares, previous bound index) of j stages ending at bounds[i]
    best = [{0: (0.0, 0.0, None)}]
    for j in range(1, stages + 1):
        row = {}
        for i in range(1, last + 1):
            if (j == stages) != (i == last):
                continue
            cand = None
            for prev, (mx, sq, _) in best[j - 1].items():
                if prev >= i:
                    continue
                c = prefix[bounds[i]] - prefix[bounds[prev]]
                key = (max(mx, c), sq + c * c, prev)
                if cand is None or key[:2] < cand[:2]:
                    cand = key
            if cand is not None:
                row[i] = cand
        best.append(row)
    cuts, i = [], last
    for j in range(stages, 0, -1):
        i = best[j][i][2]
        if j > 1:
            cuts.append(bounds[i])
    return tuple(sorted(cuts))


@dataclasses.dataclass(frozen=True)
class StagePlan:
    """Where ``p`` cuts a model.

    Attributes:
        stages: Layer names of each stage, in topological order (its
            ``keras.ops`` operations, which hold nothing, are not listed).
        cuts: Name of the layer (or operation) after which each cut is (S-1 names).
        costs: Cost of each stage (FLOPs per sample, or seconds per sample when
            ``by == "layer_times"``).
        by: ``"flops"`` or ``"layer_times"``.
        positions: Number of places the model could be cut.
    """

    stages: Tuple[Tuple[str, ...], ...]
    cuts: Tuple[str, ...]
    costs: Tuple[float, ...]
    by: str
    positions: int


def _layer_costs(model, graph, machine):
    from tfhybrid.oracle.profile import profile
    rows = {r.name: r for r in profile(model).rows}
    times = None
    if machine is not None:
        from tfhybrid.oracle.machine import as_machine
        m = as_machine(machine)
        times = m.layer_times
        rate = m.flop_rate
    costs, by = [], "flops"
    for node in graph.nodes:
        row = rows.get(node.name)
        flops = float(row.fwd_flops + row.bwd_flops) if row is not None else 0.0
        if times and node.name in times:
            costs.append(float(sum(times[node.name])))
            by = "layer_times"
        elif times:
            costs.append(flops / rate if rate else 0.0)
        else:
            costs.append(flops)
    # A cost-free layer (Flatten, a pooling on paper) still counts a little, so a
    # stage is never made of nothing but free layers when there is a choice.
    tiny = max(max(costs, default=0.0), 1.0) * 1e-9
    return [c + tiny for c in costs], by


def plan_stages(model, stages, machine=None):
    """The :class:`StagePlan` of ``model`` (a Functional model) for ``stages`` stages.

    Raises:
        ValueError: several inputs/outputs, stages < 1, or more stages than the
            model has cut points + 1 (the message names the value and the fix).
    """
    from tfhybrid.transformer.graph import describe_graph
    if len(model.inputs) != 1 or len(model.outputs) != 1:
        raise ValueError(f"strategy='p' needs a model with one input and one output; model "
                         f"{model.name!r} has {len(model.inputs)} and {len(model.outputs)}. "
                         "Use strategy='d' for it.")
    graph = describe_graph(model)
    positions = cut_positions(graph)
    if stages - 1 > len(positions):
        raise ValueError(
            f"Received stages={stages} for model {model.name!r}, which can be cut at only "
            f"{len(positions)} places (between layers where a single tensor crosses; never "
            f"inside a residual block), i.e. into at most {len(positions) + 1} stages. Use "
            f"stages <= {len(positions) + 1} (tfhybrid.init(model_parallel=...)), or "
            "strategy='d'.")
    costs, by = _layer_costs(model, graph, machine)
    cuts = balance(costs, positions, stages)
    bounds = (0,) + cuts + (len(graph.nodes),)
    # a stage's layers (keras.ops operations such as x / 255.0 have no weights or flags)
    names = tuple(tuple(n.name for n in graph.nodes[a:b] if not n.attr("operation"))
                  for a, b in zip(bounds, bounds[1:]))
    stage_costs = tuple(float(sum(costs[a:b])) for a, b in zip(bounds, bounds[1:]))
    return StagePlan(names, tuple(graph.nodes[k - 1].name for k in cuts), stage_costs, by,
                     len(positions))


def check_micro_batches(micro_batches, local_batch=None):
    """Validate ``micro_batches`` (and that it divides ``local_batch`` when known).

    Raises:
        ValueError: not a positive integer, or not dividing the local batch.
    """
    if isinstance(micro_batches, bool) or not isinstance(micro_batches, (int, np.integer)) \
            or micro_batches < 1:
        raise ValueError(f"Received an invalid value for `micro_batches`: micro_batches="
                         f"{micro_batches!r}; expected a positive integer (GPipe's number of "
                         "micro-batches per local batch).")
    if local_batch is not None and local_batch % micro_batches:
        good = [m for m in range(1, local_batch + 1) if local_batch % m == 0]
        raise ValueError(f"Received micro_batches={micro_batches}, which does not divide the "
                         f"local batch of {local_batch} rows (each pipeline feeds the global "
                         "batch / data groups rows). Use micro_batches in "
                         f"{good}, or a batch size that is a multiple of {micro_batches}.")
    return int(micro_batches)


def check_stages(stages, model_size):
    """``stages`` checked against the model-group size of ``tfhybrid.init``.

    Raises:
        ValueError: stages not equal to the model-group size, or fewer than 2 stages.
    """
    if stages is None:
        stages = model_size
    if isinstance(stages, bool) or not isinstance(stages, (int, np.integer)) or stages < 1:
        raise ValueError(f"Received an invalid value for `stages`: stages={stages!r}; expected "
                         "a positive integer (the model-group size of "
                         "tfhybrid.init(model_parallel=...)).")
    if stages != model_size:
        raise ValueError(f"Received stages={stages}, but the model groups of this grid have "
                         f"{model_size} ranks: the pipeline runs one stage per rank of a model "
                         f"group. Call tfhybrid.init(model_parallel={stages}) (the world size "
                         f"must be a multiple of {stages}), or pass stages={model_size}.")
    if stages < 2:
        raise ValueError("strategy='p' needs at least 2 stages; this grid's model groups have "
                         "1 rank. Call tfhybrid.init(model_parallel=S) with S >= 2 (S divides "
                         "the world size), or use strategy='d'.")
    return int(stages)


# -- the model ---------------------------------------------------------------------------

class _Spec:
    """Plain (untracked by Keras) facts of a pipeline."""

    def __init__(self, **kw):
        self.__dict__.update(kw)


class PipelineModel(PartModel):
    """This rank's stage of a GPipe pipeline (see the module docstring).

    Build it with ``tfhybrid.transform(model, "p", stages=S, micro_batches=M)``.
    ``fit``/``evaluate``/``predict`` and calling it are collective over the
    world's pipelines; every rank returns its pipeline's predictions.
    """

    tfhybrid_strategy = "p"

    def __init__(self, stage, spec, **kwargs):
        super().__init__(name=kwargs.pop("name", f"{spec.model_name}_p"))
        self.stage = stage
        object.__setattr__(self, "spec", spec)
        self.built = True

    # -- facts
    def get_layer(self, name=None, index=None):
        """A layer of the original model by ``name``, from this rank's stage (the
        stage model itself is ``"p_stage_<s>"``). A layer of another stage does
        not exist on this rank: ValueError naming the stage that runs it."""
        if name is None or index is not None:
            return super().get_layer(name, index)
        if name == self.stage.name:
            return self.stage
        try:
            return self.stage.get_layer(name)
        except ValueError:
            pass
        owner = next((s for s, names in enumerate(self.spec.plan.stages) if name in names),
                     None)
        if owner is None:
            raise ValueError(f"No such layer: {name!r} in the pipelined model "
                             f"{self.name!r} (its stages hold "
                             f"{[n for names in self.spec.plan.stages for n in names]}).")
        raise ValueError(
            f"Layer {name!r} runs on pipeline stage {owner} (ranks "
            f"{self.spec.pipeline[owner]} of this pipeline); this rank runs stage "
            f"{self.stage_index}, whose layers are {list(self.spec.plan.stages[self.stage_index])}"
            ". A p model holds each layer on its stage's ranks only: change the layer before "
            "tfhybrid.transform (e.g. trainable), act where it lives (`if name in "
            "model.local_layer_names:`), or read it from tfhybrid.gather(model) (on every "
            "rank).")

    def row_relations(self):
        """(0, [(first stage, other stage)] of every pipeline): the stages of a
        pipeline feed the same rows (the guards compare, tfhybrid.guards.PartRows)."""
        from tfhybrid import runtime
        grid = runtime.current_grid()
        pipelines = [grid.model_group_ranks(d) for d in range(grid.data_size)]
        return 0, [(ranks[0], (r,)) for ranks in pipelines for r in ranks[1:]]

    @property
    def local_layer_names(self):
        """The names of the original model's layers this rank's stage runs."""
        return tuple(self.spec.plan.stages[self.stage_index])

    @property
    def stage_index(self):
        return self.spec.stage

    @property
    def stages(self):
        return len(self.spec.plan.stages)

    @property
    def micro_batches(self):
        return self.spec.micro_batches

    @property
    def is_last(self):
        return self.spec.stage == self.stages - 1

    def _pair(self, s):
        """Ranks of stages s and s+1 of this pipeline."""
        return (self.spec.pipeline[s], self.spec.pipeline[s + 1])

    # -- pieces of a step
    def _split(self, t):
        m = self.micro_batches
        if m == 1:
            return [t]
        rows = tf.shape(t, out_type=tf.int32)[0]
        sizes = rows // m + tf.cast(tf.range(m) < rows % m, tf.int32)
        return tf.split(t, sizes, num=m)

    def _run(self, ins, training):
        if training and self.spec.joins and len(ins) > 1:
            # BatchNormalization: the moments of the whole batch, as in single process.
            sizes = tf.stack([tf.shape(a, out_type=tf.int32)[0] for a in ins])
            out = self.stage(tf.concat(ins, 0), training=True)
            return tf.split(out, sizes, num=len(ins))
        return [self.stage(a, training=training) for a in ins]

    def _stage_inputs(self, x0, tag):
        s = self.spec.stage
        if s == 0:
            return self._split(x0)
        shape, dtype = self.spec.boundaries[s]
        return self._receive_chain(x0, s - 1, shape, dtype, f"p.{tag}")

    def _receive_chain(self, first, s, shape, dtype, tag):
        """The M micro-batches sent on the pair (s, s+1) under ``tag``, received in order
        (each receive anchored on the previous one: distinct ops, see p2p.receive_rows)."""
        out, anchor = [], first
        for m in range(self.micro_batches):
            anchor = receive_rows(anchor, self._pair(s), shape, dtype, f"{tag}.{s}.{m}")
            out.append(anchor)
        return out

    def _send_outputs(self, outs, tag):
        s = self.spec.stage
        return [send_rows(o, self._pair(s), self.spec.pipeline[s + 1], f"p.{tag}.{s}.{m}")
                for m, o in enumerate(outs)]

    def _share_predictions(self, y_pred, x0, anchors, tag):
        """The last stage's predictions on every rank of the pipeline (no gradient)."""
        shape, dtype = self.spec.boundaries[-1]
        if self.is_last:
            value = tf.stop_gradient(y_pred)
        else:
            rows = tf.shape(x0, out_type=tf.int32)[0:1]
            value = tf.zeros(tf.concat([rows, tf.constant(shape, tf.int32)], 0), dtype)
            value = anchored(value, [x0] + list(anchors))
        out = backend.broadcast(value, self.spec.pipeline[-1], self.spec.pipeline, f"p.{tag}.pred")
        out.set_shape(tf.TensorShape([None]).concatenate(shape))
        return out

    def _forward(self, x, training=False, tag="eval"):
        """Pipelined forward pass: this pipeline's predictions on every rank of it."""
        x0 = tf.nest.flatten(x)[0]
        outs = self._run(self._stage_inputs(x0, tag), training)
        if self.is_last:
            return self._share_predictions(tf.concat(outs, 0), x0, [], tag)
        return self._share_predictions(None, x0, self._send_outputs(outs, tag), tag)

    def call(self, inputs, training=False):
        return self._forward(inputs, training=training, tag="call")

    def _regularization(self):
        losses = self.stage.losses
        return tf.add_n([tf.cast(v, tf.float32) for v in losses]) if losses else None

    def _inner_optimizer(self):
        return getattr(self.optimizer, "inner_optimizer", self.optimizer)

    def _check_rows(self, x0):
        rows = x0.shape[0]
        if rows is not None:
            check_micro_batches(self.micro_batches, int(rows))

    def row_blocks(self):
        """(row blocks of the global batch, the ranks holding the other blocks): the
        pipelines, each computing its loss on its local batch (see batch_losses)."""
        return len(self.spec.data_group), tuple(self.spec.data_group)

    def train_step(self, data):
        batch_losses.wrap(self)          # reduction="sum" etc. over the pipelines
        batch_losses.wrap_metrics(self)  # batch-level metric functions: the whole batch
        x, y, sw = keras.utils.unpack_x_y_sample_weight(data)
        x0 = tf.nest.flatten(x)[0]
        self._check_rows(x0)
        s, last = self.spec.stage, self.is_last
        variables = list(self.stage.trainable_variables)
        with tf.GradientTape() as tape:
            ins = self._stage_inputs(x0, "fwd")
            if s > 0:
                for a in ins:
                    tape.watch(a)
            outs = self._run(ins, True)
            if last:
                y_pred = tf.concat(outs, 0)
                objective = self.compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=sw,
                                              training=True)
            else:
                objective = self._regularization()
        sources = variables + (ins if s > 0 else [])
        moved = []
        if last:
            grads = tape.gradient(objective, sources)
        else:
            sent = self._send_outputs(outs, "fwd")
            received = self._receive_chain(outs[-1], s, self.spec.boundaries[s + 1][0],
                                           outs[-1].dtype, "p.bwd")
            douts = [tf.reshape(d, tf.shape(o)) for d, o in zip(received, outs)]
            moved += sent + douts
            targets, seeds = list(outs), list(douts)
            if objective is not None:
                targets.append(objective)
                seeds.append(tf.ones_like(objective))
            grads = tape.gradient(targets, sources, output_gradients=seeds)
        grads = [tf.zeros_like(v) if g is None else g for g, v in zip(grads, sources)]
        if s > 0:
            dins = grads[len(variables):]
            moved += [send_rows(d, self._pair(s - 1), self.spec.pipeline[s - 1],
                                f"p.bwd.{s - 1}.{m}") for m, d in enumerate(dins)]
        grads = grads[:len(variables)]
        y_log = self._share_predictions(y_pred if last else None, x0, moved, "fit")
        if len(self.spec.data_group) > 1 and grads:
            grads = backend.grouped_allreduce(grads, self.spec.data_group, "p.grads",
                                              average=True)
        # the loss of the weights this step started from, as Keras logs it (the
        # penalties read after the update were 0.4 % off with L2 0.05)
        loss = self._logged_loss(x, y, y_log, sw, x0, "fit")
        with tf.control_dependencies([loss]):
            # every stage joins a global_clipnorm's norm, with or without weights
            clipping.apply_whole(self._inner_optimizer(), grads, variables,
                                 self.spec.pipeline, 1, "p.clip")
        loss = anchored(loss, moved)
        return self._log(x, y, y_log, sw, loss)

    def _logged_loss(self, x, y, y_pred, sw, x0, tag):
        """The single-process loss: compiled loss + every stage's regularization."""
        loss = self.compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=sw, training=False)
        if self.spec.regularized:
            own = self._regularization()     # included by compute_loss on this rank
            own = tf.zeros([], loss.dtype) if own is None else tf.cast(own, loss.dtype)
            # Never a constant input to a collective: Grappler would fold (run) it alone.
            mine = anchored(tf.reshape(own, [1]), [x0])
            total = backend.allreduce(mine, self.spec.pipeline, f"p.{tag}.reg")[0]
            loss = loss - own + total
        return loss

    def _log(self, x, y, y_pred, sw, loss):
        self._loss_tracker.update_state(loss, sample_weight=tf.shape(y_pred)[0])
        return self.compute_metrics(x, y, y_pred, sample_weight=sw)

    def test_step(self, data):
        batch_losses.wrap(self)
        batch_losses.wrap_metrics(self)
        x, y, sw = keras.utils.unpack_x_y_sample_weight(data)
        y_pred = self._forward(x, False, "eval")
        loss = self._logged_loss(x, y, y_pred, sw, tf.nest.flatten(x)[0], "eval")
        return self._log(x, y, y_pred, sw, loss)

    def predict_step(self, data):
        x, _, _ = keras.utils.unpack_x_y_sample_weight(data)
        return self._forward(x, False, "predict")

    def fit(self, x=None, y=None, batch_size=None, *args, **kwargs):
        """Keras ``fit`` (collective); refuses a batch that ``micro_batches`` does not divide."""
        if batch_size is not None:
            check_micro_batches(self.micro_batches, int(batch_size))
        elif isinstance(x, tf.data.Dataset):
            for spec in tf.nest.flatten(x.element_spec):
                if isinstance(spec, tf.TensorSpec) and spec.shape.rank and spec.shape[0]:
                    check_micro_batches(self.micro_batches, int(spec.shape[0]))
                    break
        return super().fit(x, y, batch_size, *args, **kwargs)

    def evaluate(self, *args, **kwargs):
        """Collective: metrics of the global data set on every rank (metric states summed
        over the pipelines)."""
        from tfhybrid.transformer.parts import evaluate_global
        return evaluate_global(self, super().evaluate, args, kwargs)

    def _get_metrics_result_or_logs(self, logs):
        """Keras calls this eagerly, on every rank, at the end of ``evaluate`` and of each
        ``fit`` epoch: the metric states become the global batch's first (summed over
        the pipelines), so History, callbacks and ``evaluate`` see every data group's
        rows, not only their own pipeline's."""
        if tf.executing_eagerly():
            self.sum_metric_states()
        return super()._get_metrics_result_or_logs(logs)

    def sum_metric_states(self):
        """Sum the metric states over the pipelines (collective; every stage of a
        pipeline holds the same states: the predictions are shared)."""
        variables = list(self.metrics_variables)
        if variables and len(self.spec.data_group) > 1:
            from tfhybrid.comm.variables import sum_variables
            sum_variables(variables, tuple(range(backend.size())), "p.metric_states",
                          contribute=self.spec.stage == 0)

    # -- gather / checkpoint -----------------------------------------------------------------

    def _stage_values(self, plain, s, values_of):
        """Arrays of stage ``s``'s weights broadcast from its owner in pipeline 0 (collective)."""
        world = tuple(range(backend.size())) if backend.is_initialized() else (0,)
        owner = s   # pipeline 0's stage s is global rank s
        layers = [find_nested_layer(plain, n) for n in self.spec.plan.stages[s]]
        targets = [w for layer in layers for w in layer.weights]
        if self.spec.stage == s and self.spec.pipeline[0] == 0:
            mine = [values_of(self.stage.get_layer(layer.name)) for layer in layers]
            local = [np.asarray(v) for vs in mine for v in vs]
        else:
            local = [np.zeros(tuple(w.shape), np.dtype(w.dtype)) for w in targets]
        if len(world) == 1:
            return targets, local
        out = []
        for i, value in enumerate(local):
            out.append(backend.broadcast(tf.constant(value), owner, world,
                                         f"p.gather.{s}.{i}").numpy())
        return targets, out

    def _plain(self):
        """The original architecture rebuilt, each layer ``trainable`` as its stage's
        owner in pipeline 0 holds it now (collective: one broadcast per stage): the
        source recorded the flags of transform time, before any unfreezing."""
        from tfhybrid.transformer.source import rebuild
        plain = rebuild(self.source, self.objects)
        world = tuple(range(backend.size())) if backend.is_initialized() else (0,)
        every = {}
        for s, names in enumerate(self.spec.plan.stages):
            if self.spec.stage == s and self.spec.pipeline[0] == 0:
                flags = [int(self.stage.get_layer(n).trainable) for n in names]
            else:
                flags = [0] * len(names)
            if len(world) > 1:
                flags = backend.broadcast(tf.constant(flags, tf.int32), s, world,
                                          f"p.trainable.{s}").numpy().tolist()
            every.update(zip(names, flags))
        set_trainable_flags(plain, {n: f for n, f in every.items()
                                    if find_nested_layer(plain, n).weights})
        return plain

    def gathered(self):
        """The plain original architecture with the trained weights (collective)."""
        plain = self._plain()
        for s in range(self.stages):
            targets, values = self._stage_values(plain, s, lambda l: l.get_weights())
            for w, v in zip(targets, values):
                w.assign(v)
        finalize_states(plain)
        if backend.is_initialized():
            backend.barrier()
        return plain

    def optimizer_state(self):
        """The optimizer state at full shapes for ``tfhybrid.save`` (collective): each
        stage's slots from its owner in pipeline 0. Returns ``{"iterations",
        "slots": {name: [array per trainable weight of the plain model]}}``, or None."""
        from tfhybrid.optimizer.slots import inner as _inner, slot_names as _slot_names, slots_of, step_count
        optimizer = getattr(self, "optimizer", None)
        if optimizer is None or not _inner(optimizer).built:
            return None
        mine = list(self.stage.trainable_variables)
        slots = slots_of(optimizer, mine)
        names = sorted(_slot_names(slots))
        by_path = {v.path: s for v, s in zip(mine, slots)}
        names = backend_names(names)
        plain = self._plain()
        out = {name: [] for name in names}
        for name in names:
            def values_of(layer, name=name):
                return [np.asarray(by_path[w.path][name].numpy())
                        if w.path in by_path and by_path[w.path].get(name) is not None
                        else np.zeros(tuple(w.shape), np.dtype(w.dtype))
                        for w in layer.weights]
            for s in range(self.stages):
                targets, values = self._stage_values(plain, s, values_of)
                trainable = {id(w) for w in plain.trainable_weights}
                out[name] += [(w, v) for w, v in zip(targets, values) if id(w) in trainable]
        order = {id(w): i for i, w in enumerate(plain.trainable_weights)}
        slots_out = {name: [v for _, v in sorted(pairs, key=lambda p: order[id(p[0])])]
                     for name, pairs in out.items()}
        world = tuple(range(backend.size()))
        iterations = step_count(optimizer)
        if len(world) > 1:
            iterations = int(backend.broadcast(tf.constant(iterations), 0, world,
                                               "p.iterations").numpy())
        return {"iterations": iterations, "slots": slots_out}

    def bytes_moved(self, local_batch):
        """Bytes this rank sends per training step, by kind (see :func:`step_bytes`)."""
        return step_bytes(self.spec, local_batch)[self.spec.stage]

    def describe_parts(self, batch_size, description_cls):
        return describe_p(self, batch_size, None, description_cls)


def backend_names(names):
    """The slot names every rank agrees on (a stage without weights has none)."""
    import json
    if not backend.is_initialized() or backend.size() == 1:
        return list(names)
    text = json.dumps(sorted(names)).encode()
    buf = np.zeros(1024, np.uint8)
    buf[:len(text)] = np.frombuffer(text, np.uint8)
    got = backend.allgather(tf.constant(buf[None]), tuple(range(backend.size())),
                            "p.slot_names").numpy()
    union = set()
    for row in got:
        union |= set(json.loads(bytes(row[row > 0]).decode()))
    return sorted(union)


def _items(shape):
    return int(np.prod([int(d) for d in shape])) if shape else 1


def step_bytes(spec, local_batch, itemsize=4):
    """Bytes each stage's rank sends per ``p`` training step (pure, from the shapes).

    ``local_batch``: rows per pipeline. Per stage: ``activations`` (forward, to
    s+1), ``errors`` (backward, to s-1), ``predictions`` (the last stage's
    broadcast of its outputs for the metrics), ``gradients`` (ring allreduce
    over the data group: 2 (p_d - 1) / p_d x stage parameter bytes).

    Returns:
        A list with one dict per stage (each with ``total``).
    """
    S = len(spec.plan.stages)
    p_d = len(spec.data_group)
    out = []
    for s in range(S):
        d = {"activations": local_batch * _items(spec.boundaries[s + 1][0]) * itemsize
             if s < S - 1 else 0,
             "errors": local_batch * _items(spec.boundaries[s][0]) * itemsize if s > 0 else 0,
             "predictions": local_batch * _items(spec.boundaries[-1][0]) * itemsize
             if s == S - 1 else 0,
             "gradients": 2 * (p_d - 1) / p_d * spec.stage_params[s] * itemsize}
        d["total"] = sum(d.values())
        out.append(d)
    return out


def describe_p(model, batch_size, print_fn, description_cls):
    """``tfhybrid.describe`` of a ``p`` model: stages, their layers, bytes per step."""
    spec = model.spec
    p_d = len(spec.data_group)
    b = (batch_size // p_d) if batch_size else 1
    per = step_bytes(spec, b)
    plan = spec.plan
    lines = [f"strategy p (pipeline, GPipe fill-drain): {len(plan.stages)} stages x {p_d} data "
             f"groups, {spec.micro_batches} micro-batches of {b // spec.micro_batches or b} "
             f"rows (local batch {b}); cut by {plan.by}",
             f"this rank: stage {spec.stage} of pipeline {list(spec.pipeline)}, data group "
             f"{list(spec.data_group)}"]
    for s, names in enumerate(plan.stages):
        shape_in, shape_out = spec.boundaries[s][0], spec.boundaries[s + 1][0]
        joined = " (BatchNormalization: micro-batches joined)" if s in spec.joined_stages else ""
        lines.append(f"  stage {s}: {spec.stage_params[s]} parameters, cost {plan.costs[s]:.3g}"
                     f" ({plan.by}/sample), in {tuple(shape_in)} -> out {tuple(shape_out)}"
                     f"{joined}: " + ", ".join(names))
    lines.append(f"bytes sent per step per rank (local batch {b}):")
    for s, d in enumerate(per):
        lines.append(f"  stage {s}: " + ", ".join(f"{k} {int(v)}" for k, v in d.items()))
    text = "\n".join(lines)
    if print_fn is not None:
        print_fn(text)
    return description_cls("p", (), spec.stage_params[spec.stage] * 4,
                           int(per[spec.stage]["total"]), text)


def _stage_model(full, plan, s):
    """A fresh Functional model of stage ``s`` of ``full`` with ``full``'s weights."""
    inp = full.inputs[0] if s == 0 else _output_of(full, plan.cuts[s - 1])
    out = full.outputs[0] if s == len(plan.stages) - 1 else _output_of(full, plan.cuts[s])
    return keras.Model(inp, out, name=f"p_stage_{s}")


def _data_synced_norms(layer):
    """clone_model's clone_function for a stage that joins its micro-batches:
    BatchNormalization synchronised over the stage's data group."""
    if isinstance(layer, keras.layers.BatchNormalization):
        from tfhybrid.layers.sync_bn import SyncBatchNormalization
        return SyncBatchNormalization.from_layer(layer, groups=("data",))
    return layer.__class__.from_config(layer.get_config())


def _output_of(full, name):
    """The output of layer (or ``keras.ops`` operation) ``name`` of ``full``."""
    from tfhybrid.transformer.rewrite import find_layer
    return find_layer(full, name).output


def build(model, grid, stages=None, micro_batches=None, machine=None, batch_norm="sync"):
    """The ``p`` model of ``model`` for this rank (collective: registers the stage pairs).

    ``batch_norm="local"``: BatchNormalization normalizes each micro-batch on its
    own (GPipe's behaviour; not equal to single process); ``"sync"`` (default):
    a stage with BatchNormalization joins its micro-batches in training and syncs
    the moments over its data group (equal to single process).
    """
    from tfhybrid.layout import VariableLayout, set_layout
    from tfhybrid.transformer.graph import as_functional
    from tfhybrid.transformer.root_weights import root_weights
    from tfhybrid.transformer.source import record as record_source
    S = check_stages(stages, grid.model_size)
    M = check_micro_batches(S if micro_batches is None else micro_batches)
    functional = as_functional(model, flatten=True)     # nested models inlined
    full = keras.models.clone_model(functional)     # own layers: one node each
    for layer in full.layers:
        if getattr(layer, "activity_regularizer", None) is not None:
            raise ValueError(f"strategy='p' received layer {layer.name!r} with an "
                             "activity_regularizer: its loss would be counted per micro-batch. "
                             "Remove it (weight regularizers are supported) or use "
                             "strategy='d'.")
    plan = plan_stages(full, S, machine)            # raises before any collective
    source, objects = record_source(model)
    pairs = [(g[s], g[s + 1]) for d in range(grid.data_size)
             for g in [grid.model_group_ranks(d)] for s in range(S - 1)]
    backend.register_groups(pairs)
    with root_weights(model):
        full.set_weights(functional.get_weights())
    finalize_states(full)       # an adapted Normalization's mean/variance
    s = grid.model_rank
    norms = {layer.name for layer in full.layers
             if isinstance(layer, keras.layers.BatchNormalization)}
    joined = tuple(i for i, names in enumerate(plan.stages) if norms.intersection(names)) \
        if batch_norm == "sync" else ()
    sub = _stage_model(full, plan, s)
    stage = keras.models.clone_model(
        sub, clone_function=_data_synced_norms if grid.data_size > 1 and s in joined else None)
    stage.set_weights(sub.get_weights())
    finalize_states(stage)
    boundaries = [(tuple(full.inputs[0].shape[1:]), full.inputs[0].dtype)]
    stage_params = []
    for i in range(S):
        part = _stage_model(full, plan, i)
        boundaries.append((tuple(part.outputs[0].shape[1:]), part.outputs[0].dtype))
        stage_params.append(int(sum(int(np.prod(w.shape)) for w in part.trainable_weights)))
    regularized = any(getattr(l, a, None) is not None for l in full.layers
                      for a in ("kernel_regularizer", "bias_regularizer", "gamma_regularizer",
                                "beta_regularizer", "depthwise_regularizer",
                                "pointwise_regularizer", "recurrent_regularizer",
                                "embeddings_regularizer"))
    del full, sub, functional
    spec = _Spec(model_name=model.name, plan=plan, stage=s, micro_batches=M,
                 pipeline=grid.model_group_ranks(grid.data_rank),
                 data_group=grid.data_group_ranks(s), boundaries=tuple(boundaries),
                 joins=s in joined, joined_stages=joined, stage_params=tuple(stage_params),
                 regularized=regularized)
    for w in stage.weights:   # a stage's weights live on its data group (callbacks broadcast)
        set_layout(w, VariableLayout("sharded", "model", axis=0))
    new = PipelineModel(stage, spec)
    new.source, new.objects = source, objects
    return new
