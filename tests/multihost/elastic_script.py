"""Elastic training across the test hosts (tests/multihost/test_elastic_hosts.py):
the model, optimizer and global batches of tests/user_scripts/elastic_train.py
(12 rows a batch), one epoch of STEPS batches, a commit after every batch.

    python elastic_script.py OUT STRATEGY MP STEPS          # one plain Keras process
    horovodrun --gloo -np 2 --min-np 1 --max-np 2 --network-interface eth0 \\
        --host-discovery-script OUT/discover.sh \\
        python elastic_script.py OUT STRATEGY MP STEPS GATES

The plain process trains batch after batch (``train_on_batch``) and writes
the loss of every batch and the final weights to ``OUT/plain.npz``.

Under ``horovodrun`` every rank, at the end of global batch ``k`` of GATES
(comma-separated), after that batch's commit, waits until ``OUT/go_k``
exists: the test changes the hosts meanwhile (no rank waits in a collective),
then lets the job go on. Rank 0 prints

- ``HOSTS UPDATED r`` when Horovod's driver tells it that hosts were removed
  (r=1) or added (r=2);
- ``FIT k size mp n`` when a ``fit`` starts at global batch ``k`` (after a
  re-formation: at the committed batch), with the world size, the model
  group size and the number of weights rank 0 holds (fewer than the model's
  when its layers are split);
- ``STEP k size loss`` after global batch ``k`` (before its commit): the world
  size and the fit's running mean loss (rank 0's rows; all rows at size 1);
- ``GATE k size`` when it reaches gate ``k``;
- ``HISTORY k loss`` when the last ``fit`` (from batch ``k``) ends: its
  History's loss, the mean over all rows of its batches;

and writes the gathered weights to ``OUT/weights.npz``. Every rank prints
``RESULT {json}`` (rank, size, host, resets) at the end.
"""
import json
import os
import socket
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "user_scripts"))

import keras
import numpy as np
import tensorflow as tf

from elastic_train import B, compile_model, data, make_model

DIST = "HOROVOD_RANK" in os.environ          # under horovodrun; else plain Keras
if DIST:
    import tfhybrid
    import tfhybrid.elastic


def plain(out, steps):
    x, y = data(steps)
    model = make_model()
    model.compile(optimizer=keras.optimizers.Adam(0.01),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    losses = [float(model.train_on_batch(x[s * B:(s + 1) * B], y[s * B:(s + 1) * B]))
              for s in range(steps)]
    np.savez(os.path.join(out, "plain.npz"), losses=np.array(losses),
             **{"w:" + w.path: w.numpy() for w in model.weights})


def distributed(out, strategy, mp, steps, gates):
    tfhybrid.init()          # State re-forms the grid with model groups of MP
    x, y = data(steps)
    batches = tf.data.Dataset.from_tensor_slices((x, y)).batch(B, drop_remainder=True)
    root = lambda: tfhybrid.is_root()     # noqa: E731  (the rank changes at re-formations)

    class State(tfhybrid.elastic.State):
        def on_hosts_updated(self, timestamp, update_res):
            print(f"HOSTS UPDATED {int(update_res)}", flush=True)
            super().on_hosts_updated(timestamp, update_res)

    state = State(make_model, compile_model, strategy=strategy, model_parallel=mp,
                  **({"fallback": "replicate"} if strategy != "d" else {}))

    class Log(keras.callbacks.Callback):
        """Where each fit starts and each batch ends (before the commit)."""

        def on_train_begin(self, logs=None):
            self.start = state.batch
            if root():
                grid = tfhybrid.grid()
                held = sum(int(np.prod(w.shape)) for w in self.model.trainable_weights)
                print(f"FIT {self.start} {grid.size} {grid.model_size} {held}", flush=True)

        def on_train_batch_end(self, batch, logs=None):
            if root():
                print(f"STEP {self.start + batch + 1} {tfhybrid.grid().size} "
                      f"{float(logs['loss']):.9g}", flush=True)

    class Gate(keras.callbacks.Callback):
        """Waits at the gates (after the commit)."""

        def on_train_begin(self, logs=None):
            self.start = state.batch

        def on_train_batch_end(self, batch, logs=None):
            done = self.start + batch + 1
            go = os.path.join(out, f"go_{done}")
            if done in gates and not os.path.exists(go):
                if root():
                    print(f"GATE {done} {tfhybrid.grid().size}", flush=True)
                while not os.path.exists(go):
                    time.sleep(0.05)

    @tfhybrid.elastic.run
    def train(state):
        ds = tfhybrid.data.shard(batches.skip(state.batch), model=state.model)
        start = state.batch
        history = state.model.fit(ds, epochs=1, verbose=0,
                                  callbacks=[Log(), state.callback(every_n_steps=1), Gate()])
        if root():
            print(f"HISTORY {start} {history.history['loss'][-1]:.9g}", flush=True)

    train(state)
    full = tfhybrid.gather(state.model)
    if root():
        np.savez(os.path.join(out, "weights.npz"), **{"w:" + w.path: w.numpy()
                                                       for w in full.weights})
    grid = tfhybrid.grid()
    print("RESULT " + json.dumps({"rank": grid.rank, "size": grid.size, "resets": state.resets,
                                  "host": socket.gethostname()}), flush=True)


def main():
    out, strategy, mp, steps = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    if not DIST:
        plain(out, steps)
        return
    gates = {int(g) for g in sys.argv[5].split(",")} if len(sys.argv) > 5 else set()
    distributed(out, strategy, mp, steps, gates)


if __name__ == "__main__":
    main()
