"""Horovod's process sets as tfhybrid starts them (run at -np 4).

``tfhybrid.init(model_parallel=2)`` starts Horovod with the grid's model and
data groups as static process sets. A group registered afterwards starts
Horovod again with the known sets in their order, then the new ones (static;
dynamic after ``TFHYBRID_STATIC_RESTARTS`` restarts): a collective traced
before (its process-set id baked into the graph) must still reach its own
group afterwards, and the new groups must work. Two registrations: the pairs
(0, 3), (1, 2), then the triples (0, 1, 2), (1, 2, 3). Each rank prints
``RESULT {json}``: the mode after init and after each registration, and the
sums. ``--dynamic-first`` sets ``TFHYBRID_PROCESS_SETS=dynamic`` before init;
``--max-restarts N`` sets ``TFHYBRID_STATIC_RESTARTS``.

Then rank 0's script ends at once while ranks 1-3 sleep and sum over
(1, 2, 3) once more (``LATE rank sum``), with no barrier of the script's
own: tfhybrid's exit barrier must keep rank 0's Horovod (started again by
the registrations, so its shutdown was registered after the barrier) up
until they are done.
"""
import json
import os
import sys
import time

if "--dynamic-first" in sys.argv:
    os.environ["TFHYBRID_PROCESS_SETS"] = "dynamic"
if "--max-restarts" in sys.argv:
    os.environ["TFHYBRID_STATIC_RESTARTS"] = sys.argv[sys.argv.index("--max-restarts") + 1]

import tensorflow as tf

import tfhybrid
from tfhybrid.comm import backend

grid = tfhybrid.init(model_parallel=2)
rank = tfhybrid.rank()
model_group = tuple(grid.model_group_ranks(grid.data_rank))
data_group = tuple(grid.data_group_ranks(grid.model_rank))
x = tf.constant([float(2 ** rank)])      # sums name the ranks they came from


def want(group):
    return float(sum(2 ** r for r in group))


@tf.function
def group_sums(v):
    return (backend.allreduce(v, model_group, "ps.model"),
            backend.allreduce(v, data_group, "ps.data"))


def sums():
    return [float(t.numpy()[0]) for t in group_sums(x)]     # traced at the first call


modes, traced, new = [backend.process_set_mode()], [sums()], []
for groups in ([(0, 3), (1, 2)], [(0, 1, 2), (1, 2, 3)]):   # neither model nor data groups
    backend.register_groups(groups)
    modes.append(backend.process_set_mode())
    traced.append(sums())
    for g in groups:
        if rank in g:
            new.append([float(backend.allreduce(x, g, f"ps.{len(g)}").numpy()[0]), want(g)])
print("RESULT " + json.dumps({
    "rank": rank, "modes": modes, "traced": traced,
    "want": [want(model_group), want(data_group)], "new": new}), flush=True)
if rank != 0:
    time.sleep(2.0)
    late = backend.allreduce(x, (1, 2, 3), "ps.late").numpy()[0]
    print(f"LATE {rank} {float(late)}", flush=True)
