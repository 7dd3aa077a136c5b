"""Horovod's process sets as tfhybrid starts them (run at -np 4).

``tfhybrid.init(model_parallel=2)`` starts Horovod with the grid's model and
data groups as static process sets. A group registered afterwards switches
Horovod to dynamic sets once, registering the known sets again in their
order: a collective traced before the switch (its process-set id baked into
the graph) must still reach its own group afterwards, and the new group must
work. Each rank prints ``RESULT {json}``: the mode before/after and the sums.
``--dynamic-first`` sets ``TFHYBRID_PROCESS_SETS=dynamic`` before init.
"""
import json
import os
import sys

if "--dynamic-first" in sys.argv:
    os.environ["TFHYBRID_PROCESS_SETS"] = "dynamic"

import tensorflow as tf  # noqa: E402

import tfhybrid  # noqa: E402
from tfhybrid.comm import backend  # noqa: E402

grid = tfhybrid.init(model_parallel=2)
rank = tfhybrid.rank()
model_group = tuple(grid.model_group_ranks(grid.data_rank))
data_group = tuple(grid.data_group_ranks(grid.model_rank))
x = tf.constant([float(2 ** rank)])      # sums name the ranks they came from


@tf.function
def group_sums(v):
    return (backend.allreduce(v, model_group, "ps.model"),
            backend.allreduce(v, data_group, "ps.data"))


start = backend.process_set_mode()
before = [float(t.numpy()[0]) for t in group_sums(x)]
backend.register_groups([(0, 3), (1, 2)])     # neither a model nor a data group
after_mode = backend.process_set_mode()
after = [float(t.numpy()[0]) for t in group_sums(x)]     # traced before the switch
cross = (0, 3) if rank in (0, 3) else (1, 2)
new = float(backend.allreduce(x, cross, "ps.cross").numpy()[0])
print("RESULT " + json.dumps({
    "rank": rank, "start": start, "after": after_mode, "before": before, "after_sums": after,
    "want": [float(sum(2 ** r for r in model_group)), float(sum(2 ** r for r in data_group))],
    "new": new, "want_new": float(sum(2 ** r for r in cross))}), flush=True)
