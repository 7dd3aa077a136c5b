"""User script: train, checkpoint with tfhybrid.save, resume with tfhybrid.load.

    python resume.py --phase train  --strategy df --mp 2 --steps 3 --ckpt /tmp/x.keras
    python resume.py --phase resume --strategy d  --mp 1 --steps 3 --ckpt /tmp/x.keras

The resume phase compares the gathered weights and the Adam slots with one
uninterrupted single-process run of both phases' steps (computed in-process
with plain Keras on the same global batches) and prints ``RESULT {json}``.
"""
import argparse
import json
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import keras
import numpy as np
import tensorflow as tf

import tfhybrid

GLOBAL_BATCH = 16


def make_model():
    inputs = keras.Input((8, 8, 2))
    x = keras.layers.Conv2D(4, 3, padding="same", activation="relu", name="conv1")(inputs)
    x = keras.layers.Conv2D(4, 3, padding="same", activation="relu", name="conv2")(x)
    x = keras.layers.Flatten(name="flat")(x)
    x = keras.layers.Dense(8, activation="relu", name="fc1")(x)
    return keras.Model(inputs, keras.layers.Dense(4, name="fc2")(x))


def data(steps):
    x = np.random.default_rng(7).standard_normal((GLOBAL_BATCH * steps, 8, 8, 2)).astype("float32")
    y = np.random.default_rng(8).integers(0, 4, GLOBAL_BATCH * steps)
    return x, y


def loss():
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def optimizer(name):
    if name == "adam":
        return keras.optimizers.Adam(0.01)
    return keras.optimizers.SGD(0.05, momentum=0.9)


def reference(total_steps, opt_name, epochs=1):
    """Plain Keras in one process: ``epochs`` passes over ``total_steps`` batches, in order."""
    keras.utils.set_random_seed(0)
    model = make_model()
    opt = optimizer(opt_name)
    model.compile(optimizer=opt, loss=loss())
    x, y = data(total_steps)
    for s in list(range(total_steps)) * epochs:
        sl = slice(s * GLOBAL_BATCH, (s + 1) * GLOBAL_BATCH)
        model.train_on_batch(x[sl], y[sl])
    return model, opt


def compared(model, total_steps, opt_name, epochs=1):
    """Gathered weights and optimizer slots of transformed ``model`` against
    :func:`reference`: worst relative differences, iteration counts, slot names."""
    state = tfhybrid.checkpoint.gather_optimizer_state(model)
    full = tfhybrid.gather(model)
    ref, opt = reference(total_steps, opt_name, epochs)
    ref_slots = tfhybrid.checkpoint.slots_of(opt, ref.trainable_variables)

    def rel(a, b):
        return float(np.max(np.abs(a - b)) / (np.max(np.abs(b)) + 1e-12))

    worst_s = 0.0
    for name, values in state["slots"].items():
        for value, per_var in zip(values, ref_slots):
            if value is not None and name in per_var:
                worst_s = max(worst_s, rel(value, per_var[name].numpy()))
    return {"weights_rel": max(rel(a.numpy(), b.numpy()) for a, b in
                               zip(full.trainable_variables, ref.trainable_variables)),
            "slots_rel": worst_s, "iterations": state["iterations"],
            "ref_iterations": int(opt.iterations.numpy()), "slot_names": sorted(state["slots"])}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--phase", choices=["train", "resume", "rng"], required=True)
    ap.add_argument("--strategy", required=True)
    ap.add_argument("--model-parallel", type=int, default=1)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--before", type=int, default=0, help="steps trained before (resume)")
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--optimizer", choices=["adam", "sgd"], default="adam")
    ap.add_argument("--via-callback", action="store_true",
                    help="train phase: save with tfhybrid.callbacks.Checkpoint(every_n_steps)")
    ap.add_argument("--sharded", action="store_true", help="per-rank checkpoint directory")
    ap.add_argument("--redundant", action="store_true", help="sharded: neighbour keeps a copy")
    args = ap.parse_args()
    tfhybrid.init(model_parallel=args.model_parallel)
    x, y = data(args.before + args.steps)
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH, drop_remainder=True)
    if args.phase == "rng":      # dropout streams survive save -> load on every rank
        inputs = keras.Input((8, 8, 2))
        x = keras.layers.Flatten(name="flat")(inputs)
        x = keras.layers.Dropout(0.5, name="drop")(keras.layers.Dense(8, name="fc1")(x))
        model = tfhybrid.transform(keras.Model(inputs, keras.layers.Dense(4, name="fc2")(x)), "d")
        model.compile(optimizer=tfhybrid.DistributedOptimizer(optimizer(args.optimizer)),
                      loss=loss())
        model.fit(tfhybrid.data.shard(ds, model=model), epochs=1, verbose=0)
        before = [v.numpy().tolist() for v in tfhybrid.checkpoint._seed_variables(model)]
        tfhybrid.save(model, args.ckpt, epoch=1)
        loaded = tfhybrid.load(args.ckpt)
        after = [v.numpy().tolist() for v in tfhybrid.checkpoint._seed_variables(loaded)]
        print("RESULT " + json.dumps({"rank": tfhybrid.grid().rank, "before": before,
                                      "after": after,
                                      "global_seed": tfhybrid.checkpoint.read_meta(
                                          args.ckpt).get("global_seed")}))
        return
    if args.phase == "train":
        keras.utils.set_random_seed(0)
        model = tfhybrid.transform(make_model(), strategy=args.strategy)
        model.compile(optimizer=tfhybrid.DistributedOptimizer(optimizer(args.optimizer)),
                      loss=loss())
        callbacks = tfhybrid.callbacks.standard()
        if args.via_callback:
            callbacks.append(tfhybrid.callbacks.Checkpoint(
                args.ckpt, every_n_steps=args.steps, every_epoch=False, sharded=args.sharded,
                redundant=args.redundant))
        model.fit(tfhybrid.data.shard(ds, model=model), epochs=1, verbose=0, callbacks=callbacks)
        if not args.via_callback:
            tfhybrid.save(model, args.ckpt, epoch=1, sharded=args.sharded,
                          redundant=args.redundant)
        print("RESULT " + json.dumps({"rank": tfhybrid.grid().rank, "saved": True}))
        return
    model = tfhybrid.load(args.ckpt, strategy=args.strategy)
    meta = tfhybrid.checkpoint.read_meta(args.ckpt)
    # Saved mid-epoch (Checkpoint every_n_steps): fit skips the `step` batches
    # itself; saved with epoch=1 after the first batches: they were "epoch 0".
    batches = ds if meta.get("step") else ds.skip(args.before)
    model.fit(tfhybrid.data.shard(batches, model=model), epochs=meta["epoch"] + 1,
              initial_epoch=meta["epoch"], verbose=0, callbacks=tfhybrid.callbacks.standard())
    print("RESULT " + json.dumps({"rank": tfhybrid.grid().rank,
                                  **compared(model, args.before + args.steps, args.optimizer)}))


if __name__ == "__main__":
    main()
