"""Scripts that end (or go on) right after group collectives.

    horovodrun -np 4 --gloo python safe_gather_exit.py [end|raise|exit]

``init(model_parallel=2)``, ``transform(model, "df")``, ``fit``, ``gather``;
right after ``gather`` a second model is built, transformed and trained,
and the script ends right after ``evaluate`` (whose forward collectives run
in the model groups only). No barrier anywhere: ranks of the group that
finishes first must not take Horovod's process sets away from the other
group.

``raise``/``exit``: rank 1 fails right after the first ``gather`` (an
uncaught exception / ``sys.exit(3)``) while the others go on; the job must
end promptly with a non-zero status instead of hanging at exit.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import keras

import tfhybrid
from safe_common import data, dataset, loss, make_model, max_rel, reference_fit, report

GLOBAL_BATCH, SEED = 16, 5


def train(name, x, y):
    pmodel = tfhybrid.transform(make_model(SEED, name), strategy="df")
    pmodel.compile(optimizer=tfhybrid.DistributedOptimizer(keras.optimizers.SGD(0.1)),
                   loss=loss())
    pmodel.fit(tfhybrid.data.shard(dataset(x, y, GLOBAL_BATCH)), epochs=1,
               callbacks=tfhybrid.callbacks.standard(), verbose=0)
    return pmodel


def main(mode):
    grid = tfhybrid.init(model_parallel=2)
    x, y = data(2)
    ref = reference_fit(SEED, keras.optimizers.SGD(0.1), x, y, GLOBAL_BATCH, [1], "first")
    full = tfhybrid.gather(train("first", x, y))
    report(check="gather_exit", rank=grid.rank, mode=mode,
           weights_max_rel=max_rel(full.get_weights(), ref.get_weights()))
    if grid.rank == 1 and mode == "raise":
        raise RuntimeError("user error on rank 1 after gather")
    if grid.rank == 1 and mode == "exit":
        sys.exit(3)
    second = train("second", x, y)                      # right after gather
    second.evaluate(tfhybrid.data.shard(dataset(x, y, GLOBAL_BATCH)), verbose=0)
    print(f"rank {grid.rank} done", flush=True)          # the script ends here


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "end")
