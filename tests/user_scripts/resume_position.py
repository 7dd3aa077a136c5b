"""User script: a checkpoint saved mid-epoch resumes at its data position by itself.

    python resume_position.py --phase train  --strategy f --model-parallel 2 --ckpt /tmp/x.keras
    python resume_position.py --phase resume --strategy d --ckpt /tmp/x.keras

The train phase fits one epoch of 4 global batches with
``tfhybrid.callbacks.Checkpoint(every_n_steps=3)``: the checkpoint holds
epoch 0, step 3. The resume phase loads it and calls ``fit`` on the *whole*
dataset for 2 epochs, as if nothing had happened: tfhybrid must train batch
3 of epoch 0 and then epoch 1 whole (8 steps in all), which it compares with
one uninterrupted single-process run of 2 epochs (plain Keras, same batches),
and its own Checkpoint(every_n_steps=2) must name the steps by their position
in the epoch. Prints ``RESULT {json}`` per rank.
"""
import argparse
import json
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import keras
import tensorflow as tf

import tfhybrid
from resume import GLOBAL_BATCH, compared, data, loss, make_model, optimizer

STEPS_PER_EPOCH, EPOCHS = 4, 2


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--phase", choices=["train", "resume"], required=True)
    ap.add_argument("--strategy", required=True)
    ap.add_argument("--model-parallel", type=int, default=1)
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--optimizer", choices=["adam", "sgd"], default="adam")
    args = ap.parse_args()
    tfhybrid.init(model_parallel=args.model_parallel)
    x, y = data(STEPS_PER_EPOCH)
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH, drop_remainder=True)
    if args.phase == "train":
        keras.utils.set_random_seed(0)
        model = tfhybrid.transform(make_model(), strategy=args.strategy)
        model.compile(optimizer=tfhybrid.DistributedOptimizer(optimizer(args.optimizer)),
                      loss=loss())
        saver = tfhybrid.callbacks.Checkpoint(args.ckpt, every_n_steps=3, every_epoch=False)
        model.fit(tfhybrid.data.shard(ds, model=model), epochs=1, verbose=0,
                  callbacks=tfhybrid.callbacks.standard() + [saver])
        print("RESULT " + json.dumps({"rank": tfhybrid.grid().rank,
                                      "meta": tfhybrid.checkpoint.read_meta(args.ckpt)}))
        return
    model = tfhybrid.load(args.ckpt, strategy=args.strategy)
    directory = os.path.dirname(os.path.abspath(args.ckpt))
    saver = tfhybrid.callbacks.Checkpoint(os.path.join(directory, "r-e{epoch}-s{step}.keras"),
                                          every_n_steps=2, every_epoch=False)
    history = model.fit(tfhybrid.data.shard(ds, model=model), epochs=EPOCHS, verbose=0,
                        callbacks=tfhybrid.callbacks.standard() + [saver])
    print("RESULT " + json.dumps({
        "rank": tfhybrid.grid().rank, **compared(model, STEPS_PER_EPOCH, args.optimizer, EPOCHS),
        "history_epochs": history.epoch, "losses": len(history.history["loss"]),
        "saved": sorted(f for f in os.listdir(directory) if f.startswith("r-e")
                        and f.endswith(".keras"))}))


if __name__ == "__main__":
    main()
