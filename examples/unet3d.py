"""3-D U-Net segmentation with every layer on spatial blocks (no layer at full size).

A volume too large for one device is split along depth over the ranks
(``s``) or within model groups (``ds``); under ``tfhybrid.transform`` the
whole U-Net runs on blocks: encoder convolutions and pooling, the
bottleneck, transposed convolutions, the skip ``Concatenate``, the per-voxel
softmax head. The output and the labels stay split; the loss is the mean
over every voxel of the global batch, as in one process.

Synthetic volumes with a few spheres of two classes in noise are written to
``.npy`` first (inputs ``(N, D, D, D, 1)``, per-voxel labels ``(N, D, D,
D)``: one file per sample in ``x/`` and ``y/``), then read back with
``tfhybrid.data.volumes``: each rank reads only its block of each input and
label. Before training, rank 0 prints the oracle's plan for this shape
(``tfhybrid plan``) and ``tfhybrid.describe``'s layout::

    horovodrun -np 4 --gloo python examples/unet3d.py --volume_size=64
    horovodrun -np 4 --gloo python examples/unet3d.py --strategy=ds --model_parallel=2
    horovodrun -np 2 --gloo python examples/unet3d.py --volume_size=16 --steps=1

``--data_dir``: where the files go (every rank must see it; rank 0 writes
them once). Without it, each rank writes the same seeded files to its own
temporary directory.
"""
import os
import sys

from absl import app, flags

import common
from common import FLAGS

import keras
import numpy as np

import tfhybrid

common.define_volume_flags("2**depth * ranks")
flags.DEFINE_integer("filters", 4, "filters of the first level (doubled per level)")
flags.DEFINE_integer("depth", 2, "pooling levels of the U-Net")
flags.DEFINE_integer("classes", 3, "segmentation classes (0: background)")

def make_model():
    """A 3-D U-Net: (Conv3D-BN-ReLU) x 2 per level, MaxPooling3D down,
    Conv3DTranspose(2, strides 2) up, skip Concatenate, 1x1x1 softmax head."""
    keras.utils.set_random_seed(FLAGS.seed)
    L = keras.layers

    def block(x, filters, name):
        for j in (1, 2):
            x = L.Conv3D(filters, 3, padding="same", name=f"{name}_conv{j}")(x)
            x = L.BatchNormalization(name=f"{name}_bn{j}")(x)
            x = L.Activation("relu", name=f"{name}_relu{j}")(x)
        return x

    x = inputs = keras.Input((FLAGS.volume_size,) * 3 + (1,), name="volume")
    skips = []
    for level in range(FLAGS.depth):
        x = block(x, FLAGS.filters * 2 ** level, f"enc{level}")
        skips.append(x)
        x = L.MaxPooling3D(2, name=f"pool{level}")(x)
    x = block(x, FLAGS.filters * 2 ** FLAGS.depth, "mid")
    for level in reversed(range(FLAGS.depth)):
        x = L.Conv3DTranspose(FLAGS.filters * 2 ** level, 2, strides=2, name=f"up{level}")(x)
        x = L.Concatenate(name=f"skip{level}")([x, skips[level]])
        x = block(x, FLAGS.filters * 2 ** level, f"dec{level}")
    x = L.Conv3D(FLAGS.classes, 1, name="head")(x)
    return keras.Model(inputs, L.Activation("softmax", name="softmax")(x), name="unet3d")


def write_volumes(directory, n):
    """``x/NNNN.npy`` (one volume each) and ``y/NNNN.npy`` (its per-voxel classes)."""
    size, rng = FLAGS.volume_size, np.random.default_rng(FLAGS.seed)
    grid = np.stack(np.meshgrid(*[np.arange(size, dtype=np.float32)] * 3, indexing="ij"), -1)
    for sub in ("x", "y"):
        os.makedirs(os.path.join(directory, sub), exist_ok=True)
    for i in range(n):
        label = np.zeros((size,) * 3, np.int32)
        for c in rng.integers(1, FLAGS.classes, 3):          # three spheres, random classes
            centre = rng.uniform(0, size, 3).astype(np.float32)
            radius = rng.uniform(size / 8, size / 3)
            label[np.sum((grid - centre) ** 2, -1) < radius ** 2] = c
        x = label[..., None].astype(np.float32) + 0.5 * rng.standard_normal(
            (size,) * 3 + (1,), dtype=np.float32)
        np.save(os.path.join(directory, "x", f"{i:04d}.npy"), x)
        np.save(os.path.join(directory, "y", f"{i:04d}.npy"), label)


def main(argv):
    del argv
    common.volume_grid()
    batch = FLAGS.batch_size
    pmodel, desc = common.transform_volume_model(make_model, batch,
                                                 f"3-D U-Net {FLAGS.volume_size}^3")
    with common.volume_files(write_volumes, FLAGS.samples or 2 * batch, "unet3d_") as d:
        data = tfhybrid.data.volumes(os.path.join(d, "x"), os.path.join(d, "y"),
                                     batch_size=batch, model=pmodel, shuffle=True,
                                     seed=FLAGS.seed)
        blocks = [tuple(s.shape) for s in data.element_spec]
        timer, history = common.fit_volumes(pmodel, data, loss="sparse_categorical_crossentropy",
                                            metrics=["accuracy"])
    rows = [{"strategy": FLAGS.strategy, "input block/rank": "x".join(map(str, blocks[0])),
             "label block/rank": "x".join(map(str, blocks[1])),
             "volumes/s": f"{timer.images_per_second(FLAGS.warmup_steps):.2f}",
             "param KB/rank": f"{desc.param_bytes / 1024:.0f}",
             "loss": f"{history.history['loss'][-1]:.4f}"}]
    common.report_volumes("3-D U-Net segmentation", rows)
    return 0


if __name__ == "__main__":
    sys.exit(app.run(main))
