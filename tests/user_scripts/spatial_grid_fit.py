"""A fresh job's first spatial model on a block grid (run at -np 4).

``tfhybrid.init(model_parallel=4)`` starts Horovod with the grid's groups as
static process sets; a small CNN transformed under ``s`` with a 2x2 spatial
grid exchanges halos by the method given as the first argument (default
``neighbour``). With ``pairs`` it needs the block grid's neighbour pairs (the
diagonal ones too, for the corners), which its spatial layers register while
``fit`` traces the step: Horovod starts again inside the trace
(tfhybrid/comm/backend.py). The job
must train exactly like single-process training of the unmodified model:
each rank prints ``RESULT {json}`` with the process-set mode, the largest
relative difference of the per-epoch losses and of the gathered weights
from a reference it trains itself (plain Keras, same data and weights).
"""
import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import numpy as np
import tensorflow as tf

import tfhybrid
from tfhybrid.comm import backend

L = keras.layers


def cnn():
    keras.utils.set_random_seed(3)
    i = keras.Input((16, 16, 2), name="img")
    x = L.Conv2D(6, 3, padding="same", activation="relu", name="c1")(i)
    x = L.Conv2D(6, 3, padding="same", activation="relu", name="c2")(x)
    x = L.GlobalAveragePooling2D(name="gap")(x)
    return keras.Model(i, L.Dense(3, name="out")(x), name="grid_cnn")


def max_rel(a, b):
    return max(float(np.max(np.abs(u - v) / (np.abs(v) + 1e-6))) for u, v in zip(a, b))


tfhybrid.init(model_parallel=4)
tfhybrid.comm.halo.set_halo_method(sys.argv[1] if len(sys.argv) > 1 else "neighbour")
start = backend.process_set_mode()
rng = np.random.default_rng(1)
x = rng.standard_normal((16, 16, 16, 2)).astype(np.float32)
y = rng.integers(0, 3, 16).astype(np.int64)
loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

reference = cnn()
reference.compile(optimizer=keras.optimizers.SGD(0.2), loss=loss)
want = reference.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0).history["loss"]

model = tfhybrid.transform(cnn(), "s", spatial=(2, 2))
model.compile(optimizer=tfhybrid.DistributedOptimizer(keras.optimizers.SGD(0.2)), loss=loss)
data = tfhybrid.data.shard(tf.data.Dataset.from_tensor_slices((x, y)), model=model, batch_size=8)
got = model.fit(data, epochs=2, verbose=0, callbacks=tfhybrid.callbacks.standard()).history["loss"]
weights = tfhybrid.gather(model).get_weights()
print("RESULT " + json.dumps({
    "rank": tfhybrid.rank(), "start": start, "end": backend.process_set_mode(),
    "loss_max_rel": max_rel(got, want),
    "weights_max_rel": max_rel(weights, reference.get_weights())}), flush=True)
