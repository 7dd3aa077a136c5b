"""Elastic training: survive lost workers (``horovodrun --min-np/--max-np``).

Horovod's elastic mode restarts the training function on the surviving
workers after a worker is lost. tfhybrid adds what its sharded state needs:
the committed state is the *full* model (gathered weights and optimizer
slots, iteration count, epoch and batch position), held in memory on every
rank, since a lost rank's shards are gone with it. After a failure the
survivors re-initialise Horovod, re-form the process grid for the new world
size, rebuild and re-transform the model from the committed state and
continue from the committed batch. When the host discovery script's list
changes, the next commit interrupts every worker (Horovod's
``HostsUpdatedInterrupt``): workers on hosts no longer listed end, new ones
start on hosts listed since, receive the commit from rank 0, and all go on
from that commit on the new grid. A worker that joins runs ``tfhybrid.init``
before it receives the commit, while the running ones re-form their grid
after the reset (the same collectives), so a script must issue no
collective between ``tfhybrid.init`` and its :func:`run` function. Across
hosts (lost hosts, ssh keep-alives, the Gloo timeout against a new worker's
start-up): ``python -m tfhybrid.docs multinode``, "Elastic across hosts".

Every strategy whose collectives run on the grid's model and data groups
works (d, f, c, s, df, ds, gmp; not ``p`` and ``ls``): in an elastic run
(``HOROVOD_ELASTIC=1``) :mod:`tfhybrid.comm` registers no Horovod process
sets and runs a group's collective as a world alltoall (Horovod 0.28.1
aborts the survivors of a lost worker while process sets exist; see
``tfhybrid/comm/backend.py``). The grid on the new world size keeps
``model_parallel`` when it divides the new size, else takes its largest
divisor below it (``df`` 2x2 on 4 workers -> 1x2 on 2, -> 3x1 on 3, i.e.
data parallel).

Example (``horovodrun -np 3 --min-np 2 --host-discovery-script discover.sh
python train.py``)::

    tfhybrid.init()
    state = tfhybrid.elastic.State(make_model, compile_fn=compile_model, strategy="d")

    @tfhybrid.elastic.run
    def train(state):
        data = tfhybrid.data.shard(global_batches.skip(state.batch), model=state.model)
        state.model.fit(data, epochs=1, callbacks=[state.callback(every_n_steps=1)])

    train(state)
"""
from __future__ import annotations

import functools

import keras

from tfhybrid import runtime


def _model_parallel_for(size, wanted):
    """``wanted`` if it divides ``size``, else the largest divisor of ``size`` below it."""
    return max(d for d in range(1, min(wanted, size) + 1) if size % d == 0)


class State:
    """The committed training state of one transformed model (elastic runs).

    Args:
        build_model: ``() -> keras.Model``: the plain (untransformed) model;
            called again at every re-formation (its weights are replaced).
        compile_fn: ``(model) -> None``: compiles a transformed model (with
            ``tfhybrid.DistributedOptimizer``).
        strategy: The ``transform`` strategy.
        model_parallel: Wanted model-group size; after a re-formation the
            largest divisor of the new world size not above it.
        **options: ``transform`` options.

    Attributes:
        model: The transformed, compiled model of the current grid.
        epoch, batch: The committed position (batches done in ``epoch``).
        resets: How many re-formations this process went through.
    """

    def __init__(self, build_model, compile_fn, strategy="d", model_parallel=1, **options):
        from tfhybrid.comm import backend

        self.build_model, self.compile_fn = build_model, compile_fn
        self.strategy, self.model_parallel, self.options = strategy, model_parallel, options
        self.model = None
        self.resets = 0
        self._stale = False     # a reset happened and the model is the old grid's
        self._inner = backend.elastic_object_state(snapshot=None, epoch=0, batch=0)
        if 1 < model_parallel < backend.size() and not backend.groups_over_world():
            import warnings
            warnings.warn(
                f"tfhybrid.elastic: model_parallel={model_parallel} on {backend.size()} workers "
                "outside an elastic run (HOROVOD_ELASTIC unset) registers Horovod process sets, "
                "and Horovod 0.28.1 aborts the survivors when a worker is lost while process "
                "sets exist. Launch with horovodrun --min-np/--max-np (or set "
                "TFHYBRID_GROUPS_OVER_WORLD=1 before tfhybrid.init).", stacklevel=2)

    # -- what Horovod's elastic loop calls ----------------------------------
    @property
    def epoch(self):
        return self._inner.epoch

    @property
    def batch(self):
        return self._inner.batch

    def on_hosts_updated(self, timestamp, update_res):
        self._inner.on_hosts_updated(timestamp, update_res)

    def on_reset(self):
        """Horovod started again on the new set of workers: re-form the grid
        (collective: a worker that joins now runs the same in its
        ``tfhybrid.init``, before the first :meth:`sync`)."""
        self.resets += 1
        self._stale = True
        self._inner.on_reset()
        self._regrid()

    def restore(self):
        self._inner.restore()

    def sync(self):
        """Agree on rank 0's committed state and rebuild the model for this grid."""
        self._inner.sync()
        self._rebuild(self._inner.snapshot)
        if self._inner.snapshot is None:
            self.commit(0, 0)

    def commit(self, epoch, batch):
        """Save the full state in memory on every rank (collective); raises
        Horovod's ``HostsUpdatedInterrupt`` when workers were added or removed."""
        from tfhybrid import checkpoint
        from tfhybrid.transformer.gather import gather

        full = gather(self.model)
        state = checkpoint.gather_optimizer_state(self.model)
        self._inner.snapshot = {
            "weights": [v.numpy() for v in full.variables],
            "slots": {name: dict(enumerate(values)) for name, values in
                      (state["slots"].items() if state else ())},
            "iterations": state["iterations"] if state else 0,
        }
        self._inner.epoch, self._inner.batch = epoch, batch
        self._inner.commit()

    def callback(self, every_n_steps=1):
        """A Keras callback committing every ``every_n_steps`` batches and at epoch ends."""
        return _CommitCallback(self, every_n_steps)

    # -- re-formation -------------------------------------------------------
    def _current(self):
        """Rebuild for the new world after a reset that skipped :meth:`sync`.

        When workers were only removed (a host left the discovery script's
        list), Horovod's loop runs the training function again without
        ``sync``: every survivor raised the interrupt in the same commit, so
        all hold the same committed state. The model is still the old
        grid's, though; rebuild it from that commit."""
        if self._stale:
            self._rebuild(self._inner.snapshot)

    def _regrid(self):
        """The grid of the current world (collective), keeping ``init``'s config."""
        from tfhybrid.comm import backend

        mp = _model_parallel_for(backend.size(), self.model_parallel)
        config = runtime.config_or_default()
        runtime.shutdown()
        runtime.init(model_parallel=mp, config=config)
        return mp

    def _rebuild(self, snapshot):
        from tfhybrid import checkpoint
        from tfhybrid.comm import backend
        from tfhybrid.compose import transform

        size = backend.size()
        mp = self._regrid()
        keras.utils.clear_session()      # the same layer names on old and new workers
        full = self.build_model()
        if snapshot is not None:
            for v, value in zip(full.variables, snapshot["weights"]):
                v.assign(value)
        self.model = transform(full, self.strategy, **self.options)
        self.compile_fn(self.model)
        self._stale = False
        if snapshot is not None:
            slots = {name: {i: v for i, v in by_index.items() if v is not None}
                     for name, by_index in snapshot["slots"].items()}
            checkpoint._restore_slots(self.model, full, slots, snapshot["iterations"],
                                      self.strategy, self.options)
        if runtime.is_root():
            print(f"tfhybrid.elastic: {size} workers, model_parallel={mp}, resuming at epoch "
                  f"{self.epoch} batch {self.batch}", flush=True)


class _CommitCallback(keras.callbacks.Callback):
    def __init__(self, state, every):
        super().__init__()
        self.state, self.every = state, every
        self._epoch = self._start_epoch = self._offset = 0

    def on_train_begin(self, logs=None):
        # fit resumes at the committed position: its first epoch's batch 0 is batch `offset`
        self._start_epoch, self._offset = self.state.epoch, self.state.batch

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        done = batch + 1 + (self._offset if self._epoch == self._start_epoch else 0)
        if self.every and done % self.every == 0:
            self.state.commit(self._epoch, done)

    def on_epoch_end(self, epoch, logs=None):
        self.state.commit(epoch + 1, 0)


def run(func):
    """Decorate ``func(state)``: on a lost worker it is run again on the
    survivors from the last commit (Horovod elastic's retry loop); when
    workers are added or removed (the host discovery script's list changed)
    it is run again on the new workers from the commit that noticed it."""
    from tfhybrid.comm import backend

    @functools.wraps(func)
    def on_current_grid(state, *args, **kwargs):
        if isinstance(state, State):
            state._current()
        return func(state, *args, **kwargs)

    return backend.elastic_run(on_current_grid)
