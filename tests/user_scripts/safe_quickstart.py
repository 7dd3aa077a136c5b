"""The README quick start, as a user writes it.

    horovodrun -np 4 --gloo python safe_quickstart.py [--hvd-init-first] [df gmp ...]

For each strategy: ``init(model_parallel=2)``, every rank builds the model
with its own random initial weights (an unseeded script), rank 0 alone
restores pretrained weights, ``transform``, compile with a
``DistributedOptimizer(Adam)``, ``fit`` with ``callbacks.standard()``,
``gather``. The next strategy builds a second model right after the first
``gather``, and the script ends right after the last ``gather``: no barrier
anywhere. Each rank prints the largest relative difference between its
gathered weights and single-process training from the pretrained weights.
``--hvd-init-first``: the script calls ``hvd.init()`` before ``tfhybrid.init``
(Horovod then had no dynamic process sets, and tfhybrid's first group failed
with Horovod's "Set HOROVOD_DYNAMIC_PROCESS_SETS=1 ...").
"""
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import keras

import tfhybrid
from safe_common import data, dataset, loss, make_model, max_rel, reference_fit, report

GLOBAL_BATCH, EPOCHS, PRETRAINED_SEED = 16, 2, 7
OPTIONS = {"gmp": {"ccr_threshold": 0}}


def main(strategies):
    if "--hvd-init-first" in strategies:      # a script migrating from Horovod keeps it
        strategies = [s for s in strategies if s != "--hvd-init-first"]
        import horovod.tensorflow as hvd
        hvd.init()
    grid = tfhybrid.init(model_parallel=2)
    x, y = data()
    # The single-process references first: the script must end right after gather.
    refs = {s: reference_fit(PRETRAINED_SEED, keras.optimizers.Adam(0.01), x, y, GLOBAL_BATCH,
                             [EPOCHS], name=f"mlp_{s}") for s in strategies}
    path = None
    if tfhybrid.is_root():
        path = os.path.join(tempfile.mkdtemp(), "pretrained.weights.h5")
    for s in strategies:
        name = f"mlp_{s}"
        if tfhybrid.is_root():
            make_model(PRETRAINED_SEED, name).save_weights(path)
        model = make_model(100 + grid.rank, name)        # each rank its own random init
        if tfhybrid.is_root():
            model.load_weights(path)                       # pretrained: rank 0 only
        pmodel = tfhybrid.transform(model, strategy=s, **OPTIONS.get(s, {}))
        pmodel.compile(optimizer=tfhybrid.DistributedOptimizer(keras.optimizers.Adam(0.01)),
                       loss=loss())
        pmodel.fit(tfhybrid.data.shard(dataset(x, y, GLOBAL_BATCH), model=pmodel),
                   epochs=EPOCHS, callbacks=tfhybrid.callbacks.standard(), verbose=0)
        full = tfhybrid.gather(pmodel)
        report(check="quickstart", strategy=s, rank=grid.rank, size=grid.size,
               weights_max_rel=max_rel(full.get_weights(), refs[s].get_weights()))


if __name__ == "__main__":
    main(sys.argv[1:] or ["df", "gmp"])
