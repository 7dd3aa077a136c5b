"""Training that the fault tests disturb (tests/multihost/test_faults.py):
strategy ``df`` with model groups of 2 on the small CNN of
strategies_script.py, EPOCHS epochs of STEPS steps.

    python fault_script.py OUT EPOCHS STEPS       # one plain Keras process
    horovodrun --gloo -np 2 -H h1:1,h2:1 --network-interface eth0 \\
        python fault_script.py OUT EPOCHS STEPS [PAUSES]

Rank 0 (or the plain process) prints ``EPOCH e SECONDS`` when epoch ``e``
ends and writes the gathered weights to ``OUT/weights.npz``. After each epoch
of PAUSES (comma-separated) rank 0 waits until the file ``OUT/resume_e``
exists: the test injects its fault, then lets it go on, so the fault hits
the next epoch's collectives however fast the epochs are (the other rank
waits in its next collective meanwhile).
"""
import os
import sys
import time

import keras
import numpy as np

from strategies_script import BATCH, DIST, data, make_model

if DIST:
    import tfhybrid


class Epochs(keras.callbacks.Callback):
    def __init__(self, out, pauses):
        super().__init__()
        self.out, self.pauses = out, pauses

    def on_epoch_begin(self, epoch, logs=None):
        self.start = time.monotonic()

    def on_epoch_end(self, epoch, logs=None):
        if not DIST or tfhybrid.is_root():
            print(f"EPOCH {epoch + 1} {time.monotonic() - self.start:.2f}", flush=True)
            resume = os.path.join(self.out, f"resume_{epoch + 1}")
            while epoch + 1 in self.pauses and not os.path.exists(resume):
                time.sleep(0.05)


def main():
    out, epochs, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    pauses = {int(e) for e in sys.argv[4].split(",")} if len(sys.argv) > 4 else set()
    if DIST:
        tfhybrid.init(model_parallel=2)
    model = make_model()
    optimizer = keras.optimizers.SGD(0.05, momentum=0.9)
    train = data(steps * BATCH)
    if DIST:
        model = tfhybrid.transform(model, strategy="df")
        optimizer = tfhybrid.DistributedOptimizer(optimizer)
        train = tfhybrid.data.shard(train, model=model)
    model.compile(optimizer=optimizer,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    callbacks = [Epochs(out, pauses)] + (tfhybrid.callbacks.standard() if DIST else [])
    model.fit(train, epochs=epochs, verbose=0, shuffle=False, callbacks=callbacks)
    full = tfhybrid.gather(model) if DIST else model
    if not DIST or tfhybrid.is_root():
        np.savez(os.path.join(out, "weights.npz"), **{w.path: w.numpy() for w in full.weights})
        print("DONE", flush=True)


if __name__ == "__main__":
    main()
