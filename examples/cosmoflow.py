"""CosmoFlow-like 3-D regression on volumes split over the ranks (domain parallelism).

ParaDL's CosmoFlow case: one sample (a 4-channel 512^3 dark-matter volume)
does not fit one device, so the leading convolutions are split spatially
(``s``: every rank holds a depth block; ``ds``: the same within model
groups, over data-parallel groups). Here synthetic volumes are written to
``.npy`` files first (inputs ``(N, D, D, D, C)`` and 4 regression targets
per sample, a smooth function of the volume so that training can fit
them), then read back with ``tfhybrid.data.volumes``: each rank reads only
its rows and, of each, only its depth block (memory-mapped), and the
transformed model takes the block as it is.

Before training, rank 0 prints the oracle's plan for this shape (``tfhybrid
plan``) and the per-layer layout (``tfhybrid.describe``)::

    horovodrun -np 4 --gloo python examples/cosmoflow.py --volume_size=64
    horovodrun -np 4 --gloo python examples/cosmoflow.py --strategy=ds --model_parallel=2
    horovodrun -np 2 --gloo python examples/cosmoflow.py --volume_size=16 --steps=1

``--data_dir``: where the ``.npy`` files go (a directory every rank sees:
rank 0 writes them once). Without it, every rank writes the same seeded
files to its own temporary directory (one host or many, nothing shared).
"""
import os
import sys

from absl import app, flags

import common
from common import FLAGS

import keras
import numpy as np

import tfhybrid

common.define_volume_flags("2**levels * ranks")
flags.DEFINE_integer("channels", 4, "input channels (CosmoFlow: 4 redshifts)")
flags.DEFINE_integer("filters", 8, "filters of the first convolution (doubled per level)")
flags.DEFINE_integer("levels", 3, "Conv3D + MaxPooling3D levels")


TARGETS = 4


def make_model():
    """CosmoFlow in miniature: Conv3D + MaxPooling3D levels, then Dense layers."""
    keras.utils.set_random_seed(FLAGS.seed)
    L, f = keras.layers, FLAGS.filters
    x = inputs = keras.Input((FLAGS.volume_size,) * 3 + (FLAGS.channels,), name="volume")
    for level in range(FLAGS.levels):
        x = L.Conv3D(f * 2 ** level, 3, padding="same", activation="relu",
                     name=f"conv{level}")(x)
        x = L.MaxPooling3D(2, name=f"pool{level}")(x)
    x = L.Flatten(name="flatten")(x)
    x = L.Dense(64, activation="relu", name="fc0")(x)
    x = L.Dense(32, activation="relu", name="fc1")(x)
    return keras.Model(inputs, L.Dense(TARGETS, name="targets")(x), name="cosmoflow_like")


def write_volumes(directory, n):
    """``x.npy`` (n volumes, written one at a time) and ``y.npy`` (n x 4 targets)."""
    shape = (n,) + (FLAGS.volume_size,) * 3 + (FLAGS.channels,)
    x = np.lib.format.open_memmap(os.path.join(directory, "x.npy"), "w+", np.float32, shape)
    rng = np.random.default_rng(FLAGS.seed)
    mix = rng.standard_normal((FLAGS.channels, TARGETS)).astype(np.float32)
    y = np.empty((n, TARGETS), np.float32)
    for i in range(n):
        sample = rng.standard_normal(shape[1:], dtype=np.float32)
        sample += rng.standard_normal(FLAGS.channels).astype(np.float32)   # per-sample level
        x[i] = sample
        y[i] = np.tanh(sample.mean(axis=(0, 1, 2)) @ mix)
    x.flush()
    del x
    np.save(os.path.join(directory, "y.npy"), y)


def main(argv):
    del argv
    common.volume_grid()
    batch = FLAGS.batch_size
    pmodel, desc = common.transform_volume_model(
        make_model, batch, f"CosmoFlow-like {FLAGS.volume_size}^3 x {FLAGS.channels}")
    with common.volume_files(write_volumes, FLAGS.samples or 2 * batch, "cosmoflow_") as d:
        data = tfhybrid.data.volumes(os.path.join(d, "x.npy"), os.path.join(d, "y.npy"),
                                     batch_size=batch, model=pmodel, shuffle=True,
                                     seed=FLAGS.seed)
        block = tuple(data.element_spec[0].shape)
        timer, history = common.fit_volumes(pmodel, data, loss="mse")
    rows = [{"strategy": FLAGS.strategy, "block/rank": "x".join(map(str, block)),
             "volumes/s": f"{timer.images_per_second(FLAGS.warmup_steps):.2f}",
             "param KB/rank": f"{desc.param_bytes / 1024:.0f}",
             "comm KB/step": f"{desc.comm_bytes / 1024:.0f}",
             "loss": f"{history.history['loss'][-1]:.4f}"}]
    common.report_volumes("CosmoFlow-like regression", rows)
    return 0


if __name__ == "__main__":
    sys.exit(app.run(main))
