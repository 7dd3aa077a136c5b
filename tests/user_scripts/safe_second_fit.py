"""A second ``fit`` with a new ``callbacks.standard()``.

    horovodrun -np 2 --gloo python safe_second_fit.py f 2
    horovodrun -np 4 --gloo python safe_second_fit.py df 2

For each optimizer (Adam, SGD with momentum, RMSprop with momentum): every
rank builds the model with its own random weights and rank 0 alone restores
pretrained ones, ``transform``, ``fit`` one epoch, ``fit`` another epoch with
a fresh ``callbacks.standard()`` (the usual pattern; its broadcast must not
overwrite the optimizer slots of sharded weights with rank 0's blocks), and
``gather``. Each rank prints the largest relative difference of the gathered
weights and of its own optimizer slots (blocks of the reference's, for
sharded weights) from single-process training with the same two ``fit``
calls.
"""
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import keras

import tfhybrid
from safe_common import (data, dataset, loss, max_rel, rank0_pretrained_model,
                         reference_fit, report, slot_blocks_max_rel)

GLOBAL_BATCH, PRETRAINED_SEED = 16, 11
OPTIMIZERS = {
    "adam": lambda: keras.optimizers.Adam(0.01),
    "sgd_momentum": lambda: keras.optimizers.SGD(0.05, momentum=0.9),
    "rmsprop": lambda: keras.optimizers.RMSprop(0.005, momentum=0.5),
}


def main(strategy, model_parallel):
    grid = tfhybrid.init(model_parallel=model_parallel)
    x, y = data(1)
    path = os.path.join(tempfile.mkdtemp(), "pretrained.weights.h5") if grid.rank == 0 else None
    for opt_name, make_optimizer in OPTIMIZERS.items():
        name = f"mlp_{opt_name}"
        ref = reference_fit(PRETRAINED_SEED, make_optimizer(), x, y, GLOBAL_BATCH, [1, 1], name)
        model = rank0_pretrained_model(PRETRAINED_SEED, name, grid.rank, path)
        pmodel = tfhybrid.transform(model, strategy=strategy)
        pmodel.compile(optimizer=tfhybrid.DistributedOptimizer(make_optimizer()), loss=loss())
        batches = tfhybrid.data.shard(dataset(x, y, GLOBAL_BATCH), model=pmodel)
        for _ in range(2):
            pmodel.fit(batches, epochs=1, callbacks=tfhybrid.callbacks.standard(), verbose=0)
        slots_rel, slots = slot_blocks_max_rel(pmodel.optimizer.inner_optimizer, ref.optimizer,
                                               grid.model_rank)
        full = tfhybrid.gather(pmodel)
        report(check="second_fit", strategy=strategy, optimizer=opt_name, rank=grid.rank,
               size=grid.size, weights_max_rel=max_rel(full.get_weights(), ref.get_weights()),
               slots_max_rel=slots_rel, slots=slots)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "f", int(sys.argv[2]) if len(sys.argv) > 2 else 2)
