"""Stanza's layer separation ``ls`` (Stanza §3.2, §4.1, §4.2).

Ranks ``0..n_c-1`` are CONV workers: they run the convolutional part (every
layer up to the last convolution or pooling before the first Dense) data
parallel. Ranks ``n_c..n_c+n_f-1`` are FC workers: FC worker ``j`` serves the
``g = n_c / n_f`` CONV workers ``j*g..(j+1)*g-1`` (its *group*). One step:

1. each CONV worker runs the CONV part on its rows; the group's activations
   reach the FC worker (one alltoall on the group's process set in which
   each CONV worker sends all its rows to the FC worker and none to the
   others: many-to-one);
2. the FC worker runs the FC part and the loss on the group's rows (it feeds
   the same rows' labels: ``tfhybrid.data.shard`` gives it the group's block)
   and sends each CONV worker the error of its own rows and its predictions
   (one alltoall each, zero rows to everyone else: one-to-many);
3. the FC workers average their FC gradients (allreduce over the FC workers)
   while the CONV workers all-reduce theirs (sum over the CONV workers / n_f),
   on disjoint process sets, i.e. overlapped;
4. each rank's optimizer applies its part only.

Gradient scale: FC worker j's loss is the mean over its group's B/n_f rows,
so averaging FC gradients over n_f gives the single-process gradient of the
mean over B; a CONV worker's gradient is its rows' part of its FC worker's
gradient, so the sum over CONV workers divided by n_f is the single-process
gradient.

BatchNormalization normalizes with the moments of the whole global batch, as
one process does: in the CONV part it is a SyncBatchNormalization over the
CONV workers, in the FC part one over the FC workers (see
:func:`synced_norms`); the moving statistics are then equal on the workers of
a part, and the moments' backward all-reduce keeps the gradient scale above.

Every rank holds the whole model (the part it does not run is frozen there
and refreshed by :func:`tfhybrid.gather` and at checkpoints, Stanza §5.3);
CONV workers update the loss tracker and compiled metrics on their own rows
(with the predictions sent back), so rank 0's progress bar shows the loss of
its rows as in ``d``, and ``evaluate`` sums the metric states over the CONV
workers (global metrics on every rank).

Example:
    >>> tfhybrid.init()                                   # horovodrun -np 4
    >>> model = tfhybrid.transform(vgg, strategy="ls", fc_workers=1)   # 3 CONV + 1 FC
    >>> model.compile(tfhybrid.DistributedOptimizer(keras.optimizers.SGD(0.01)), "mse")
    >>> model.fit(tfhybrid.data.shard(ds, model=model), epochs=1)
    >>> full = tfhybrid.gather(model)
"""
from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf

from tfhybrid import batch_losses
from tfhybrid.comm import backend
from tfhybrid.transformer.graph import weighted_leaves
from tfhybrid.transformer.parts import PartModel
from tfhybrid.transformer.source import finalize_states
from tfhybrid.comm.p2p import anchored
from tfhybrid.optimizer import clipping

CUT_LAYERS = ("Conv1D", "Conv2D", "Conv3D", "DepthwiseConv2D", "SeparableConv2D",
              "MaxPooling1D", "MaxPooling2D", "MaxPooling3D", "AveragePooling1D",
              "AveragePooling2D", "AveragePooling3D", "GlobalAveragePooling1D",
              "GlobalAveragePooling2D", "GlobalAveragePooling3D", "GlobalMaxPooling1D",
              "GlobalMaxPooling2D", "GlobalMaxPooling3D")
INFO_ATTR = "_tfhybrid_ls"


# -- pure helpers (no collectives) ---------------------------------------------------------

def roles(n_c, n_f):
    """``(conv_ranks, fc_ranks, groups)``: groups[j] = FC worker j's CONV workers + itself.

    Example:
        >>> roles(3, 1)
        ((0, 1, 2), (3,), ((0, 1, 2, 3),))
        >>> roles(2, 2)[2]
        ((0, 2), (1, 3))
    """
    g = n_c // n_f
    conv = tuple(range(n_c))
    fc = tuple(range(n_c, n_c + n_f))
    groups = tuple(tuple(range(j * g, (j + 1) * g)) + (n_c + j,) for j in range(n_f))
    return conv, fc, groups


def check_workers(world, fc_workers):
    """``(n_c, n_f)`` for ``fc_workers`` FC workers among ``world`` ranks.

    Raises:
        ValueError: fewer than 2 ranks, fc_workers not in 1..world-1, or not dividing
            the number of CONV workers (the message names the value and the fix).

    Example:
        >>> check_workers(4, 1)
        (3, 1)
    """
    if world < 2:
        raise ValueError(f"strategy='ls' needs at least 2 ranks (one CONV and one FC worker); "
                         f"this job has {world}. Launch with horovodrun -np 2 or more, or use "
                         "strategy='d'.")
    if isinstance(fc_workers, bool) or not isinstance(fc_workers, (int, np.integer)) \
            or not 1 <= fc_workers < world:
        raise ValueError(f"Received an invalid value for `fc_workers`: fc_workers={fc_workers!r}; "
                         f"expected an integer in 1..{world - 1} (the FC workers; the other "
                         "ranks are CONV workers).")
    n_f = int(fc_workers)
    n_c = world - n_f
    if n_c % n_f:
        good = [f for f in range(1, world) if (world - f) % f == 0]
        raise ValueError(f"Received fc_workers={n_f} with {world} ranks: the {n_c} CONV workers "
                         f"cannot be split evenly among {n_f} FC workers (each FC worker serves "
                         f"n_c/n_f CONV workers, Stanza §3.2). Use fc_workers in {good}.")
    return n_c, n_f


def _class(layer):
    return type(layer).__name__


def find_cut(model):
    """The tensor where ``model`` is cut: the output of the last convolution or
    pooling before the first Dense (Stanza §3.2).

    Returns:
        ``(cut_tensor, cut_layer_name)`` (a KerasTensor of ``model``'s graph).

    Raises:
        ValueError: no Dense layer, no convolution/pooling before the first Dense,
            several inputs/outputs, or a graph where more than the cut tensor
            crosses from the CONV part to the FC part.
    """
    if len(model.inputs) != 1 or len(model.outputs) != 1:
        raise ValueError(f"strategy='ls' needs a model with one input and one output; model "
                         f"{model.name!r} has {len(model.inputs)} and {len(model.outputs)}. "
                         "Use strategy='d' for it.")
    if any(len(getattr(l, "_inbound_nodes", ())) > 1 for l in model.layers):
        # Layers shared with another model (e.g. as_functional of a Sequential):
        # layer.output would be the other graph's tensor. Analyse a clone.
        model = keras.models.clone_model(model)
    layers = [op for op in model.layers if not isinstance(op, keras.layers.InputLayer)]
    first_dense = next((i for i, l in enumerate(layers) if isinstance(l, keras.layers.Dense)),
                       None)
    if first_dense is None:
        raise ValueError(f"strategy='ls' cuts before the first Dense layer, but model "
                         f"{model.name!r} has no Dense layer. Use strategy='d' for it.")
    cuts = [l for l in layers[:first_dense] if _class(l) in CUT_LAYERS]
    if not cuts:
        raise ValueError(f"strategy='ls' received model {model.name!r} with no convolution or "
                         f"pooling before its first Dense layer {layers[first_dense].name!r}: "
                         "there is no CONV part for the CONV workers (Stanza §3.2). Use "
                         "strategy='d' (or 'f'/'c' for the Dense layers).")
    cut_layer = cuts[-1]
    cut = cut_layer.output
    conv_part = keras.Model(model.inputs, cut)
    conv_names = {l.name for l in conv_part.layers}
    fc_part = keras.Model(cut, model.outputs)
    for l in fc_part.layers:
        if l.name in conv_names and not isinstance(l, keras.layers.InputLayer):
            raise ValueError(f"strategy='ls': layer {l.name!r} of model {model.name!r} is needed "
                             f"on both sides of the cut after {cut_layer.name!r} (a residual "
                             "connection crosses it). Put a pooling layer before the first Dense "
                             "that all paths go through, or use strategy='d'.")
    return cut, cut_layer.name


def assign_workers(model, world, machine=None, batch_size=None):
    """n_f from Stanza's performance model (Eq. 5, the oracle's ``ls``) for ``model``
    on ``machine`` (default: the calibrated development box) and global batch
    ``batch_size`` (default 32 per rank): the fastest feasible n_f dividing n_c.

    Example:
        >>> assign_workers(vgg, 4)      # -> 1 (3 CONV workers, 1 FC worker)
    """
    from tfhybrid import oracle
    if machine is None:
        machine = oracle.default_machine_path()
    best = None
    for n_f in range(1, world):
        if (world - n_f) % n_f:
            continue
        pred = oracle.predict(model, "ls", world, batch_size or 32 * world, machine, n_f=n_f)
        if pred.feasible and (best is None or pred.total_s < best[0]):
            best = (pred.total_s, n_f)
    return best[1] if best else 1


# -- the model -----------------------------------------------------------------------------

class LayerSeparatedModel(PartModel):
    """This rank's role of Stanza's layer separation (see the module docstring).

    Holds the whole model (``self.full``); the CONV part trains on CONV
    workers, the FC part on FC workers. Build it with
    ``tfhybrid.transform(model, "ls", fc_workers=n_f)``.
    """

    tfhybrid_strategy = "ls"

    def __init__(self, full, cut_layer, n_c, n_f, **kwargs):
        super().__init__(name=kwargs.pop("name", f"{full.name}_ls"))
        self.full = full
        cut = full.get_layer(cut_layer).output
        self.conv_part = keras.Model(full.inputs, cut, name="ls_conv_part")
        self.fc_part = keras.Model(cut, full.outputs, name="ls_fc_part")
        self.n_c, self.n_f = n_c, n_f
        self.cut_layer = cut_layer
        self.conv_ranks, self.fc_ranks, self.groups = roles(n_c, n_f)
        me = backend.rank() if backend.is_initialized() else 0
        self.is_fc = me >= n_c
        j = me - n_c if self.is_fc else me // (n_c // n_f)
        self.group = self.groups[j]
        self.cut_shape = tuple(cut.shape[1:])
        self.out_shape = tuple(full.outputs[0].shape[1:])
        self.trainable_paths = frozenset(w.path for w in full.trainable_weights)
        # Weight penalties of the weights that train in one process (kernel_regularizer...).
        self.regularized = any(getattr(w, "regularizer", None) is not None
                               for w in full.trainable_weights)
        # The part this rank does not run is frozen here (its optimizer sees only its part).
        (self.conv_part if self.is_fc else self.fc_part).trainable = False

    # The Functional graph of the whole model answers shape questions.
    def get_layer(self, name=None, index=None):
        """A layer of the original model by ``name`` (every rank holds both parts;
        the part a rank does not run is frozen, and stays frozen whatever its
        layers' ``trainable`` says)."""
        if name is None or index is not None:
            return super().get_layer(name, index)
        for part in (self, self.full):
            try:
                return keras.Model.get_layer(part, name)
            except ValueError:
                pass
        return super().get_layer(name, index)      # Keras' "No such layer" message

    def call(self, inputs, training=False):
        return self.full(inputs, training=training)

    @property
    def role(self):
        return "FC" if self.is_fc else "CONV"

    def _unpack(self, data):
        x, y, sw = keras.utils.unpack_x_y_sample_weight(data)
        return x, y, sw

    def _exchange_forward(self, x, training):
        """CONV: returns (h, gathered); FC: returns (None, gathered rows of its group)."""
        if self.is_fc:
            # Not a constant: TensorFlow's shape inference would evaluate a constant
            # subgraph (running the alltoall while tracing, alone: a hang).
            dtype = self.conv_part.outputs[0].dtype
            zero = tf.zeros((0,) + self.cut_shape, dtype) + tf.cast(
                tf.reduce_sum(tf.nest.flatten(x)[0][:0]), dtype)
            none = tf.zeros([len(self.group)], tf.int32)
            return None, backend.alltoall(zero, none, self.group, "ls.fwd")
        h = self.conv_part(x, training=training)
        # All rows to the FC worker (last member), none to the other CONV workers.
        k = len(self.group)
        to_fc = tf.one_hot(k - 1, k, on_value=tf.shape(h)[0], off_value=0, dtype=tf.int32)
        return h, backend.alltoall(h, to_fc, self.group, "ls.fwd")

    def _splits(self, rows):
        g = len(self.group) - 1
        per = rows // g
        return tf.concat([tf.fill([g], per), tf.zeros([1], tf.int32)], 0)

    def _send_back(self, t, rows, name):
        """FC: rows of ``t`` -> their CONV workers (zero rows come back here)."""
        return backend.alltoall(t, self._splits(rows), self.group, name)

    def _receive(self, anchor, shape, dtype, name):
        """CONV: this worker's rows from its FC worker (sends zero rows, anchored)."""
        empty = tf.zeros((0,) + tuple(shape), dtype) + tf.reduce_sum(anchor[:0])
        return backend.alltoall(empty, tf.zeros([len(self.group)], tf.int32), self.group, name)

    @staticmethod
    def _anchor(value, tensors):
        for t in tensors:
            value = value + tf.cast(tf.reduce_sum(t[:0]), value.dtype)
        return value

    def _penalty(self, part):
        """The weight penalties of ``part`` (those that train in one process), or None."""
        terms = [tf.reduce_sum(tf.cast(w.regularizer(w), tf.float32)) for w in part.weights
                 if getattr(w, "regularizer", None) is not None
                 and w.path in self.trainable_paths]
        return tf.add_n(terms) if terms else None

    def _with_penalties(self, loss, x, name):
        """``loss`` (compute_loss: this rank's part's penalties only, as the other part
        is frozen here) with both parts' penalties, as one process logs it: one scalar
        allreduce over the world (each CONV worker sends its part's penalty / n_c,
        each FC worker its part's / n_f)."""
        if not self.regularized:
            return loss
        own = self._penalty(self.fc_part if self.is_fc else self.conv_part)
        own = tf.zeros([], loss.dtype) if own is None else tf.cast(own, loss.dtype)
        share = own / (self.n_f if self.is_fc else self.n_c)
        # never a constant input to a collective (Grappler would run it alone)
        share = anchored(tf.reshape(tf.stop_gradient(share), [1]), [tf.nest.flatten(x)[0]])
        world = tuple(sorted(set(self.conv_ranks) | set(self.fc_ranks)))
        total = backend.allreduce(share, world, name)[0]
        return loss - tf.stop_gradient(own) + total

    def _inner_optimizer(self):
        return getattr(self.optimizer, "inner_optimizer", self.optimizer)

    def _apply(self, grads, variables, holders):
        """This rank's part's update (identical on its ``holders`` ranks); a
        ``global_clipnorm`` takes the norm over both parts."""
        world = tuple(sorted(set(self.conv_ranks) | set(self.fc_ranks)))
        clipping.apply_whole(self._inner_optimizer(), grads, variables, world, holders,
                             "ls.clip")

    def row_relations(self):
        """(this rank's block position in its FC worker's batch, [(FC worker, its CONV
        workers)]): an FC worker feeds its CONV workers' rows joined in order (the
        guards compare, tfhybrid.guards.PartRows)."""
        me = backend.rank() if backend.is_initialized() else 0
        position = 0 if self.is_fc else self.group.index(me)
        return position, [(group[-1], group[:-1]) for group in self.groups]

    def row_blocks(self):
        """(row blocks, the ranks holding the others) for this rank's loss: an FC
        worker's loss is over its group's rows (n_f blocks), a CONV worker's logged
        loss over its own (n_c blocks). See batch_losses."""
        if self.is_fc:
            return self.n_f, tuple(self.fc_ranks)
        return self.n_c, tuple(self.conv_ranks)

    def train_step(self, data):
        batch_losses.wrap(self)          # reduction="sum" etc. over the workers
        batch_losses.wrap_metrics(self)  # batch-level metric functions: the whole batch
        x, y, sw = self._unpack(data)
        if self.is_fc:
            _, gathered = self._exchange_forward(x, True)
            rows = tf.shape(gathered)[0]
            variables = list(self.fc_part.trainable_variables)
            with tf.GradientTape() as tape:
                tape.watch(gathered)
                y_pred = self.fc_part(gathered, training=True)
                loss = self.compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=sw, training=True)
            grads = tape.gradient(loss, variables + [gathered])
            dh = grads[-1]
            back = self._send_back(dh, rows, "ls.bwd")
            preds = self._send_back(tf.stop_gradient(y_pred), rows, "ls.pred")
            grads = list(grads[:-1])
            if self.n_f > 1:
                grads = backend.grouped_allreduce(grads, self.fc_ranks, "ls.fc_grads",
                                                  average=True)
            loss = self._with_penalties(self._anchor(loss, [back, preds]), x, "ls.fit.penalties")
            with tf.control_dependencies([loss]):
                self._apply(grads, variables, self.n_f)
            return self._log(x, y, y_pred, sw, loss)
        variables = list(self.conv_part.trainable_variables)
        with tf.GradientTape() as tape:
            h, gathered = self._exchange_forward(x, True)
            penalty = self._penalty(self.conv_part)
        dh = self._receive(gathered, self.cut_shape, h.dtype, "ls.bwd")
        y_pred = self._receive(dh, self.out_shape, self.full.outputs[0].dtype, "ls.pred")
        targets, seeds = [h], [tf.reshape(dh, tf.shape(h))]
        if penalty is not None:
            # the penalties' gradient once in all: the CONV gradients are summed over
            # the n_c workers, then / n_f
            targets.append(penalty)
            seeds.append(tf.constant(self.n_f / self.n_c, penalty.dtype))
        grads = tape.gradient(targets, variables, output_gradients=seeds)
        grads = [tf.zeros_like(v) if g is None else g for g, v in zip(grads, variables)]
        if self.n_c > 1:
            grads = backend.grouped_allreduce(list(grads), self.conv_ranks, "ls.conv_grads",
                                              postscale=1.0 / self.n_f)
        elif self.n_f > 1:
            grads = [g / self.n_f for g in grads]
        # the loss of the weights this step started from, as Keras logs it
        loss = self.compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=sw, training=False)
        loss = self._with_penalties(loss, x, "ls.fit.penalties")
        with tf.control_dependencies([loss]):
            self._apply(grads, variables, self.n_c)
        return self._log(x, y, y_pred, sw, loss)

    def _log(self, x, y, y_pred, sw, loss):
        rows = tf.shape(y_pred)[0]
        self._loss_tracker.update_state(loss, sample_weight=rows)
        return self.compute_metrics(x, y, y_pred, sample_weight=sw)

    def _forward(self, x):
        if self.is_fc:
            _, gathered = self._exchange_forward(x, False)
            y_pred = self.fc_part(gathered, training=False)
            back = self._send_back(y_pred, tf.shape(gathered)[0], "ls.pred")
            return self._anchor_rows(y_pred, back)
        h, gathered = self._exchange_forward(x, False)
        return self._receive(gathered, self.out_shape, h.dtype, "ls.pred")

    @staticmethod
    def _anchor_rows(y, t):
        return y + tf.cast(tf.reduce_sum(t[:0]), y.dtype)

    def test_step(self, data):
        batch_losses.wrap(self)
        batch_losses.wrap_metrics(self)
        x, y, sw = self._unpack(data)
        y_pred = self._forward(x)
        # FC workers log their group's rows (evaluate counts the CONV workers' states
        # only); using y_pred also keeps this rank's collectives in the graph.
        loss = self.compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=sw, training=False)
        loss = self._with_penalties(loss, x, "ls.eval.penalties")
        return self._log(x, y, y_pred, sw, loss)

    def predict_step(self, data):
        x, _, _ = self._unpack(data)
        return self._forward(x)

    def evaluate(self, *args, **kwargs):
        """Collective: metrics of the global data set on every rank (summed over CONV workers)."""
        from tfhybrid.transformer.parts import evaluate_global
        return evaluate_global(self, super().evaluate, args, kwargs)

    def _get_metrics_result_or_logs(self, logs):
        """Keras calls this eagerly, on every rank, at the end of ``evaluate`` and of each
        ``fit`` epoch: the metric states become the global batch's first (summed over
        the CONV workers), so History and callbacks see every worker's rows (before,
        each CONV worker logged its own in ``fit``)."""
        if tf.executing_eagerly():
            self._sum_metrics()
        return super()._get_metrics_result_or_logs(logs)

    def _sum_metrics(self):
        variables = [v for v in self.metrics_variables]
        if not variables:
            return
        from tfhybrid.comm.variables import sum_variables

        sum_variables(variables, tuple(range(backend.size())), "ls.metric_states",
                      contribute=not self.is_fc)

    # -- gather / checkpoint -----------------------------------------------------------------

    def sync_weights(self):
        """Every rank gets the CONV part from rank 0 and the FC part from FC worker 0
        (collective over the world; Stanza §5.3's redundant copy of the FC parameters)."""
        self._broadcast_parts(0, self.n_c, "ls.sync")

    def _broadcast_parts(self, conv_root, fc_root, name):
        """The CONV part from ``conv_root``, the FC part from ``fc_root``, to every rank."""
        world = tuple(range(backend.size()))
        for part, root in ((self.conv_part, conv_root), (self.fc_part, fc_root)):
            for i, w in enumerate(part.weights):
                w.assign(backend.broadcast(tf.convert_to_tensor(w.value), root, world,
                                           f"{name}.{part.name}.{i}"))
            finalize_states(part)

    def broadcast_state(self, root_rank=0):
        """What ``BroadcastGlobalVariablesCallback`` (``callbacks.standard()``) does for
        ``ls`` (collective): each part's weights from a rank that trains it (the CONV
        part from ``root_rank`` when it is a CONV worker, else rank 0; the FC part from
        the first FC worker, or ``root_rank`` when it is one), and the optimizer
        state, which covers a role's part only, within each role from the same rank.

        Keras' broadcast of every variable from ``root_rank`` failed here
        ("Mismatched BROADCAST tensor shapes": CONV and FC workers hold other
        optimizer slots), and a part a rank does not train is a stale copy there,
        which must never overwrite the trained one."""
        from tfhybrid.optimizer.slots import tracking_slots
        conv_root = root_rank if root_rank in self.conv_ranks else self.conv_ranks[0]
        fc_root = root_rank if root_rank in self.fc_ranks else self.fc_ranks[0]
        self._broadcast_parts(conv_root, fc_root, "ls.state")
        optimizer = self._inner_optimizer() if getattr(self, "optimizer", None) else None
        if optimizer is None:
            return
        mine = self.fc_part if self.is_fc else self.conv_part
        if not optimizer.built:
            with tracking_slots(optimizer):
                optimizer.build(mine.trainable_variables)
        role = self.fc_ranks if self.is_fc else self.conv_ranks
        root = fc_root if self.is_fc else conv_root
        if len(role) > 1:
            for i, v in enumerate(optimizer.variables):
                v.assign(backend.broadcast(tf.convert_to_tensor(v), root, role,
                                           f"ls.state.{self.role}.optimizer.{i}"))

    def check_trainable_unchanged(self):
        """Raise when the script froze or unfroze layers after ``transform``: ``ls``
        freezes the part a rank does not run (Keras then resets that part's
        flags) and records which weights train at transform, for the weight
        penalties, ``gather`` and the checkpoint's optimizer slots. Collective
        (one allgather): each rank sees its own part's changes, every rank raises."""
        mine = self.fc_part if self.is_fc else self.conv_part
        other = self.conv_part if self.is_fc else self.fc_part
        now = {w.path for w in mine.trainable_weights}
        then = {w.path for w in mine.weights if w.path in self.trainable_paths}
        # the other part: frozen here, so only a layer frozen at transform and thawed
        # since then shows (setting trainable=True on a layer that trained is no change)
        thawed = [l.name for l in other._flatten_layers(include_self=False) if l.trainable
                  and any(w.path not in self.trainable_paths for w in l.trainable_weights)]
        changed = sorted({path.split("/")[0] for path in now ^ then}) or thawed
        world = tuple(range(backend.size())) if backend.is_initialized() else (0,)
        if len(world) > 1:
            votes = backend.allgather(tf.constant([[float(bool(changed))]], tf.float32), world,
                                      "ls.trainable_check").numpy()[:, 0]
            if votes.any() and not changed:
                changed = f"(on rank(s) {[int(r) for r in np.flatnonzero(votes)]})"
        if changed:
            raise ValueError(
                f"Layers {changed} of ls model {self.name!r} were frozen or unfrozen after "
                "tfhybrid.transform. Under ls the part a rank does not run is frozen and "
                "which weights train is fixed at transform (penalties, gather, checkpoint "
                "slots). Set trainable before transform: full = tfhybrid.gather(model) on "
                "every rank, change full's layers, then tfhybrid.transform(full, 'ls') and "
                "compile again (or use p, d, f: they follow later changes).")

    def fit(self, *args, **kwargs):
        self.check_trainable_unchanged()
        return super().fit(*args, **kwargs)

    def gathered(self):
        """The plain original architecture with the trained weights (collective)."""
        from tfhybrid.transformer.source import rebuild
        self.check_trainable_unchanged()
        self.sync_weights()
        plain = rebuild(self.source, self.objects)
        for layer in weighted_leaves(plain):      # inside nested models too
            layer.set_weights(self.full.get_layer(layer.name).get_weights())
        finalize_states(plain)
        backend.barrier()
        return plain

    def part_weights(self, part):
        """The weights of ``part`` the original model trains (also where it is frozen)."""
        return [w for w in part.weights if w.path in self.trainable_paths]

    def optimizer_state(self):
        """The optimizer state at full shapes for ``tfhybrid.save`` (collective):
        CONV slots from rank 0, FC slots from FC worker 0 (Stanza §5.3: every
        rank, CONV workers included, then holds the FC part's state too).

        Returns ``{"iterations", "slots": {name: [array per trainable weight of
        the plain model]}}`` like ``checkpoint.gather_optimizer_state``, or None.
        """
        from tfhybrid.optimizer.slots import inner as _inner, slot_names as _slot_names, slots_of, step_count
        self.check_trainable_unchanged()
        optimizer = getattr(self, "optimizer", None)
        if optimizer is None or not _inner(optimizer).built:   # ls applies the inner one
            return None
        mine = list(self.trainable_variables)
        slots = slots_of(optimizer, mine)
        names = _slot_names(slots)
        by_var = {id(v): s for v, s in zip(mine, slots)}
        world = tuple(range(backend.size()))
        out = {}
        for name in names:
            values = []
            for part, root in ((self.conv_part, 0), (self.fc_part, self.n_c)):
                for i, w in enumerate(self.part_weights(part)):
                    have = by_var.get(id(w), {}).get(name)
                    value = (np.asarray(have.numpy()) if have is not None
                             else np.zeros(w.shape, w.dtype))
                    values.append(backend.broadcast(tf.constant(value), root, world,
                                                    f"ls.slot.{name}.{part.name}.{i}").numpy())
            out[name] = values
        iterations = int(backend.broadcast(tf.constant(step_count(optimizer)),
                                           0, world, "ls.iterations").numpy())
        return {"iterations": iterations, "slots": out}

    def bytes_moved(self, local_batch):
        """Bytes this rank sends per training step, by kind (see :func:`step_bytes`)."""
        return step_bytes(self, self.n_c, self.n_f, local_batch)[self.role]

    def describe_parts(self, batch_size, description_cls):
        return describe_ls(self, batch_size, None, description_cls)


def describe_ls(model, batch_size, print_fn, description_cls):
    """``tfhybrid.describe`` of an ``ls`` model: worker roles, the cut, bytes per step."""
    k = (batch_size // model.n_c) if batch_size else 1
    b = step_bytes(model, model.n_c, model.n_f, k)
    lines = [f"strategy ls (Stanza layer separation): {model.n_c} CONV workers "
             f"{list(model.conv_ranks)}, {model.n_f} FC workers {list(model.fc_ranks)}; "
             f"cut after {model.cut_layer!r}",
             "FC worker groups (CONV workers..., FC worker): "
             + ", ".join(str(list(g)) for g in model.groups),
             f"parameters: CONV part {b['params']['conv']}, FC part {b['params']['fc']}; "
             f"this rank: {model.role} worker",
             f"bytes sent per step per rank (K={k} rows per CONV worker):"]
    for role in ("CONV", "FC"):
        lines.append(f"  {role:4s} " + ", ".join(f"{key} {int(v)}" for key, v in b[role].items()))
    text = "\n".join(lines)
    if print_fn is not None:
        print_fn(text)
    mine = model.conv_part if model.role == "CONV" else model.fc_part
    return description_cls("ls", (), _count(mine.trainable_weights) * 4,
                           int(b[model.role]["total"]), text)


def _count(weights):
    return sum(int(np.prod(w.shape)) for w in weights)


def step_bytes(model, n_c, n_f, local_batch, itemsize=4):
    """Bytes one CONV worker and one FC worker send per ``ls`` training step.

    Pure (no collectives): read from the shapes of the tensors ``ls`` moves,
    as :class:`LayerSeparatedModel` issues them. ``local_batch`` is K, the
    rows per CONV worker. The gradient all-reduces are Horovod rings
    (2 (n-1)/n x gradient bytes per rank).

    Returns:
        ``{"CONV": {...}, "FC": {...}}``, each with ``activations``/``errors``
        (Stanza's FC data), ``predictions`` (sent back for the metrics; not in
        Stanza's model), ``gradients`` and ``total``.

    Example:
        >>> step_bytes(vgg, 3, 1, 32)["CONV"]["activations"]   # 32 x 512 x 4
        65536
    """
    if isinstance(model, LayerSeparatedModel):
        conv_part, fc_part = model.conv_part, model.fc_part
        p_c, p_f = _count(model.part_weights(conv_part)), _count(model.part_weights(fc_part))
    else:
        cut, _ = find_cut(model)
        conv_part, fc_part = keras.Model(model.inputs, cut), keras.Model(cut, model.outputs)
        p_c, p_f = _count(conv_part.trainable_weights), _count(fc_part.trainable_weights)
    a = int(np.prod(conv_part.outputs[0].shape[1:]))
    out = int(np.prod(fc_part.outputs[0].shape[1:]))
    g = n_c // n_f
    conv = {"activations": local_batch * a * itemsize, "errors": 0, "predictions": 0,
            "gradients": 2 * (n_c - 1) / n_c * p_c * itemsize}
    fc = {"activations": 0, "errors": g * local_batch * a * itemsize,
          "predictions": g * local_batch * out * itemsize,
          "gradients": 2 * (n_f - 1) / n_f * p_f * itemsize}
    for d in (conv, fc):
        d["total"] = sum(d.values())
    return {"CONV": conv, "FC": fc, "params": {"conv": p_c, "fc": p_f, "cut_items": a}}


def synced_norms(full, cut_name, conv_ranks, fc_ranks, rank):
    """``full`` with each BatchNormalization synchronised over the ranks that run
    its part: a SyncBatchNormalization over the CONV workers in the CONV part,
    over the FC workers in the FC part (each FC worker holds its group's rows
    only), so training normalizes with the moments of the whole global batch,
    as one process does. A part run by one rank keeps plain BatchNormalization.

    On the ranks that do not run a part, that part is frozen: its
    BatchNormalization uses the moving statistics and issues no collective.
    """
    from tfhybrid.layers.sync_bn import SyncBatchNormalization
    from tfhybrid.process_grid import Group

    conv_names = {l.name for l in keras.Model(full.inputs,
                                              full.get_layer(cut_name).output).layers}
    sets = {}
    for layer in full.layers:
        if isinstance(layer, keras.layers.BatchNormalization) \
                and not isinstance(layer, SyncBatchNormalization):
            name, ranks = ("ls_conv", conv_ranks) if layer.name in conv_names \
                else ("ls_fc", fc_ranks)
            if len(ranks) > 1:
                sets[layer.name] = Group(name, tuple(ranks),
                                         ranks.index(rank) if rank in ranks else -1)
    if not sets:
        return full

    def clone(layer):
        if layer.name in sets:
            return SyncBatchNormalization.from_layer(layer, groups=(sets[layer.name],))
        return layer.__class__.from_config(layer.get_config())

    synced = keras.models.clone_model(full, clone_function=clone)
    synced.set_weights(full.get_weights())
    return synced


def build(model, grid, fc_workers=None, machine=None, batch_size=None):
    """The ``ls`` model of ``model`` for this rank (collective: registers the groups)."""
    from tfhybrid.transformer.graph import as_functional
    from tfhybrid.transformer.root_weights import root_weights
    from tfhybrid.transformer.source import record as record_source
    world = grid.size
    if fc_workers is None:
        fc_workers = assign_workers(model, world, machine, batch_size)
    n_c, n_f = check_workers(world, fc_workers)
    functional = as_functional(model, flatten=True)  # nested models inlined
    full = keras.models.clone_model(functional)      # own layers: one node each
    _, cut_name = find_cut(full)                     # raises before any collective
    conv, fc, groups = roles(n_c, n_f)
    backend.register_groups([conv, fc] + list(groups))
    full = synced_norms(full, cut_name, conv, fc, grid.rank)
    with root_weights(model):
        full.set_weights(functional.get_weights())
    finalize_states(full)       # an adapted Normalization's mean/variance
    new = LayerSeparatedModel(full, cut_name, n_c, n_f)
    new.source, new.objects = record_source(model)
    object.__setattr__(new, "_tfhybrid_batch_blocks",
                       (n_f, grid.rank - n_c) if grid.rank >= n_c else (n_c, grid.rank))
    return new
