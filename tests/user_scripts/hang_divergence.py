"""User-style scripts whose ranks diverge: the watchdog must end them.

    horovodrun -np 2 --gloo python tests/user_scripts/hang_divergence.py CASE [options]

CASE (the fault happens at train step ``--fault-step`` on one rank):

- ``extra_collective``: rank 0 calls ``tfhybrid.callbacks.average_logs`` alone;
- ``stop_one_rank``: the last rank sets ``model.stop_training = True``;
- ``terminate_nan``: the last rank's loss is NaN at one step and Keras'
  ``TerminateOnNaN`` stops that rank only (data parallel);
- ``layer_names``: the last rank builds a throwaway layer before the model, so
  the auto-generated layer names, and the collective names, differ (the
  fault time is the first train step);
- ``save_on_root``: after ``fit``, rank 0 alone calls ``tfhybrid.save`` (a
  collective) under ``if tfhybrid.is_root():``, as Horovod scripts save on
  rank 0; the others end their scripts;
- ``evaluate_on_root``: likewise with ``model.evaluate``;
- ``call_on_root``: likewise rank 0 alone calls the model, ``model(x[:4])``
  (split layers exchange activations);
- ``slow_rank``: the last rank pauses ``--pause`` seconds inside one step (a
  healthy job that must finish);
- ``none``: no fault.

The faulting rank prints ``FAULT <unix time>`` at the fault; ranks that finish
print ``RESULT {json}``.
"""
import argparse
import json
import os
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import numpy as np
import tensorflow as tf

import tfhybrid

CASES = ("extra_collective", "stop_one_rank", "terminate_nan", "layer_names", "save_on_root",
         "evaluate_on_root", "call_on_root", "slow_rank", "none")


def fault(text):
    print(f"FAULT {time.time():.3f} rank {tfhybrid.grid().rank}: {text}", flush=True)


class Fault(keras.callbacks.Callback):
    """Injects the case's fault at global train step ``step`` (1-based)."""

    def __init__(self, case, step, pause):
        super().__init__()
        self.case, self.step, self.pause = case, step, pause
        self.seen = 0
        grid = tfhybrid.grid()
        self.rank, self.last = grid.rank, grid.size - 1

    def on_train_batch_begin(self, batch, logs=None):
        self.seen += 1
        if self.case == "layer_names" and self.seen == 1 and self.rank == self.last:
            fault("first train step with drifted layer names")
        if self.case == "slow_rank" and self.seen == self.step and self.rank == self.last:
            print(f"PAUSE {time.time():.3f} {self.pause} s", flush=True)
            time.sleep(self.pause)
            print(f"PAUSE END {time.time():.3f}", flush=True)

    def on_train_batch_end(self, batch, logs=None):
        if self.seen != self.step:
            return
        if self.case == "extra_collective" and self.rank == 0:
            fault("average_logs on rank 0 only")
            tfhybrid.callbacks.average_logs({"loss": float(logs.get("loss", 0.0))})
        elif self.case == "stop_one_rank" and self.rank == self.last:
            fault("model.stop_training = True on one rank")
            self.model.stop_training = True
        elif self.case == "terminate_nan" and self.rank == self.last and self.model.stop_training:
            fault(f"TerminateOnNaN stopped this rank (loss {logs.get('loss')})")


class NanLoss(keras.callbacks.Callback):
    """The last rank's loss of train step ``step`` becomes NaN (as a bad batch
    on one data-parallel rank would make it; Keras' cross-entropy sanitises
    NaN logits, so the loss is set in the logs the later callbacks read)."""

    def __init__(self, step):
        super().__init__()
        self.step, self.seen = step, 0

    def on_train_batch_end(self, batch, logs=None):
        self.seen += 1
        grid = tfhybrid.grid()
        if self.seen == self.step and grid.rank == grid.size - 1 and logs is not None:
            logs["loss"] = float("nan")


def make_model():
    """Auto-named layers (no ``name=``): their names come from Keras' counters."""
    inputs = keras.Input((16,))
    x = keras.layers.Dense(64, activation="relu")(inputs)
    x = keras.layers.Dense(32, activation="relu")(x)
    return keras.Model(inputs, keras.layers.Dense(10)(x))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("case", choices=CASES)
    ap.add_argument("--strategy", help="default: d for terminate_nan, else df")
    ap.add_argument("--model-parallel", type=int, help="default: 1 for d, else 2")
    ap.add_argument("--fault-step", type=int, default=5)
    ap.add_argument("--pause", type=float, default=75.0)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--steps", type=int, default=20, help="train steps per epoch")
    ap.add_argument("--watchdog-seconds", type=float, help="Config(watchdog_seconds=...)")
    ap.add_argument("--no-guards", action="store_true",
                    help="Config(guards=False): without the structure guard, drifted names hang")
    ap.add_argument("--no-watchdog-callback", action="store_true",
                    help="do not list tfhybrid.watchdog.callback() (rely on tfhybrid's fit hook)")
    args = ap.parse_args()
    strategy = args.strategy or ("d" if args.case == "terminate_nan" else "df")
    mp = args.model_parallel or (1 if strategy == "d" else 2)

    config = tfhybrid.Config(watchdog_seconds=args.watchdog_seconds, guards=not args.no_guards)
    grid = tfhybrid.init(model_parallel=mp, config=config)
    keras.utils.set_random_seed(0)
    if args.case == "layer_names" and grid.rank == grid.size - 1:
        keras.layers.Dense(4)(keras.Input((3,)))      # a throwaway layer: shifts the auto-names
        if not args.no_guards:                        # the guard stops fit before any step
            fault("built a throwaway layer: auto-names drift")
    model = tfhybrid.transform(make_model(), strategy=strategy)
    model.compile(optimizer=tfhybrid.DistributedOptimizer(keras.optimizers.SGD(0.01)),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))

    batch = 32
    rng = np.random.default_rng(0)
    x = rng.standard_normal((batch * args.steps, 16)).astype("float32")
    y = rng.integers(0, 10, batch * args.steps).astype("int64")
    data = tfhybrid.data.shard(
        tf.data.Dataset.from_tensor_slices((x, y)).batch(batch, drop_remainder=True), model=model)

    callbacks = tfhybrid.callbacks.standard()
    if not args.no_watchdog_callback:
        callbacks.append(tfhybrid.watchdog.callback())
    if args.case == "terminate_nan":
        callbacks.append(NanLoss(args.fault_step))
        callbacks.append(keras.callbacks.TerminateOnNaN())
    callbacks.append(Fault(args.case, args.fault_step, args.pause))
    start = time.time()
    history = model.fit(data, epochs=args.epochs, callbacks=callbacks, verbose=0, shuffle=False)
    if args.case == "save_on_root" and tfhybrid.is_root():
        fault("tfhybrid.save on rank 0 only")
        tfhybrid.save(model, os.path.join(tempfile.mkdtemp(), "model.keras"))
    if args.case == "evaluate_on_root" and tfhybrid.is_root():
        fault("model.evaluate on rank 0 only")
        model.evaluate(data, verbose=0)
    if args.case == "call_on_root" and tfhybrid.is_root():
        fault("model(x) on rank 0 only")
        model(x[:4])
    print("RESULT " + json.dumps({"rank": grid.rank, "case": args.case,
                                  "epochs_run": len(history.epoch),
                                  "fit_seconds": round(time.time() - start, 1)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
