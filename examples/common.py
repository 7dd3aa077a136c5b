"""Shared pieces of the examples: flags, data (synthetic or real), the plan, timing.

Each example is a script launched on every rank::

    horovodrun -np 2 --gloo python examples/splitbrain_vgg.py --steps=5

Flags common to all examples (absl, as TensorFlow's model scripts):

* ``--dataset=synthetic`` (default: random data of the right shape, seeded
  alike on every rank, nothing to download) or a real data set
  (``cifar10``; ``folder``: one sub-directory of images per class, as
  ImageNet's train/ directory), read from ``--data_dir``;
* ``--batch_size``: the *global* batch (every rank keeps its rows of it with
  ``tfhybrid.data.shard``);
* ``--steps`` timed training steps after ``--warmup_steps`` untimed ones (the
  first step traces the graph);
* ``--machine``: machine JSON for the printed plan (default: the shipped
  ParaDL ABCI V100 cluster, as ``tfhybrid plan``; the machine the script
  runs on: ``tfhybrid calibrate``, or the shipped 2-core CPU machine
  ``tfhybrid/oracle/machines/cpu_box.json``).
"""
from __future__ import annotations

import contextlib
import os
import pickle
import shutil
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import numpy as np
import tensorflow as tf
from absl import app, flags

import tfhybrid
from tfhybrid.cli import plan_text

FLAGS = flags.FLAGS
DATASETS = ("synthetic", "cifar10", "folder")

flags.DEFINE_enum("dataset", "synthetic", DATASETS,
                  "synthetic (default), cifar10 (CIFAR-10 python batches in --data_dir, or "
                  "downloaded by keras.datasets), folder (--data_dir/<class>/<image>)")
flags.DEFINE_string("data_dir", None, "where the real data set is")
flags.DEFINE_integer("batch_size", 32, "global batch size (all ranks together)")
flags.DEFINE_integer("steps", 10, "timed training steps")
flags.DEFINE_integer("warmup_steps", 2, "untimed steps before (the first one traces)")
flags.DEFINE_float("lr", 0.01, "learning rate (SGD with momentum 0.9)")
flags.DEFINE_integer("seed", 0, "seed of the weights and the synthetic data")
flags.DEFINE_bool("run_eagerly", False, "compile with run_eagerly=True (no tracing: quicker "
                  "for a few steps, slower per step)")
flags.DEFINE_string("machine", None, "machine JSON for the plan (default: ParaDL's ABCI V100)")


def say(*args):
    """print on global rank 0 only."""
    if tfhybrid.is_root():
        print(*args, flush=True)


def print_plan(model, batch, title, **kwargs):
    """Print what ``tfhybrid plan`` predicts for ``model`` at this world size (rank 0)."""
    say(f"\n== tfhybrid plan: {title} ==")
    say(plan_text(model, tfhybrid.grid().size, batch, machine=FLAGS.machine, **kwargs))


# -- data ---------------------------------------------------------------------

def synthetic(shape, classes, n, seed):
    """``n`` random images of ``shape`` and labels; the same on every rank."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, *shape)).astype("float32")
    y = rng.integers(0, classes, n).astype("int64")
    return x, y


def _cifar_batches(path):
    """CIFAR-10's python pickles (data_batch_1..5) from ``path``: uint8 NHWC, labels."""
    xs, ys = [], []
    for i in range(1, 6):
        with open(os.path.join(path, f"data_batch_{i}"), "rb") as f:
            batch = pickle.load(f, encoding="bytes")
        xs.append(batch[b"data"].reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1))
        ys.append(np.asarray(batch[b"labels"]))
    return np.concatenate(xs), np.concatenate(ys)


def load_cifar10(data_dir):
    """CIFAR-10's 50,000 training images (float32 in [0, 1]) and labels.

    From ``data_dir`` (the extracted ``cifar-10-batches-py`` directory or its
    parent) when given, else ``keras.datasets.cifar10.load_data()`` (downloads
    once to ~/.keras/datasets).
    """
    if data_dir:
        for path in (data_dir, os.path.join(data_dir, "cifar-10-batches-py")):
            if os.path.exists(os.path.join(path, "data_batch_1")):
                x, y = _cifar_batches(path)
                break
        else:
            raise ValueError(f"--data_dir={data_dir}: no CIFAR-10 python batches "
                             "(data_batch_1..5) there or in its cifar-10-batches-py/; download "
                             "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz and "
                             "extract it, or omit --data_dir to let Keras download it.")
    else:
        (x, y), _ = keras.datasets.cifar10.load_data()
    return (x.astype("float32") / 255.0), y.reshape(-1).astype("int64")


def global_batches(shape, classes, steps, model=None):
    """A ``tf.data`` pipeline of this rank's rows of ``steps`` global batches.

    Every rank builds the same global pipeline (same files, same seeded
    shuffle) and ``tfhybrid.data.shard`` keeps its rows, so the ranks of a
    model group feed the same rows. Repeats as needed.
    """
    batch = FLAGS.batch_size
    if FLAGS.dataset == "synthetic":
        x, y = synthetic(shape, classes, batch * min(steps, 8), FLAGS.seed)
        ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(batch, drop_remainder=True)
    elif FLAGS.dataset == "cifar10":
        if tuple(shape) != (32, 32, 3):
            raise ValueError(f"--dataset=cifar10 holds 32x32x3 images; this model takes {shape}: "
                             "pass --image_size=32.")
        x, y = load_cifar10(FLAGS.data_dir)
        ds = (tf.data.Dataset.from_tensor_slices((x, y))
              .shuffle(len(x), seed=FLAGS.seed).batch(batch, drop_remainder=True))
    else:
        if not FLAGS.data_dir or not os.path.isdir(FLAGS.data_dir):
            raise ValueError(f"--dataset=folder needs --data_dir=<directory with one "
                             f"sub-directory of images per class>; got {FLAGS.data_dir!r}.")
        ds = keras.utils.image_dataset_from_directory(
            FLAGS.data_dir, image_size=shape[:2], batch_size=batch, shuffle=True,
            seed=FLAGS.seed, label_mode="int", verbose=tfhybrid.is_root())
        ds = ds.map(lambda im, lab: (im / 255.0, lab))
    return tfhybrid.data.shard(ds.repeat(), model=model).prefetch(2)


# -- measurements -------------------------------------------------------------

def nbytes(variables) -> int:
    """Bytes held by ``variables`` on this rank."""
    return sum(int(np.prod(v.shape)) * np.dtype(v.dtype).itemsize for v in variables)


class StepTimer(keras.callbacks.Callback):
    """Wall time of every training step (a step ends when its outputs are ready)."""

    def __init__(self):
        super().__init__()
        self.times = []
        self._start = None

    def on_train_batch_begin(self, batch, logs=None):
        self._start = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        self.times.append(time.perf_counter() - self._start)

    def images_per_second(self, warmup):
        """Global images per second over the steps after ``warmup`` (all if none)."""
        timed = self.times[warmup:] or self.times
        return FLAGS.batch_size * len(timed) / max(sum(timed), 1e-9)


def train(pmodel, data, optimizer=None):
    """Compile ``pmodel`` (SGD, sparse crossentropy), fit warmup + timed steps.

    Returns (StepTimer, history).
    """
    optimizer = optimizer or tfhybrid.DistributedOptimizer(
        keras.optimizers.SGD(FLAGS.lr, momentum=0.9))
    pmodel.compile(optimizer=optimizer,
                   loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                   metrics=["accuracy"], run_eagerly=FLAGS.run_eagerly)
    timer = StepTimer()
    history = pmodel.fit(data, epochs=1, steps_per_epoch=FLAGS.warmup_steps + FLAGS.steps,
                         callbacks=tfhybrid.callbacks.standard() + [timer], verbose=0,
                         shuffle=False)
    return timer, history


def define_volume_flags(divisible_by):
    """The flags of the volume examples (cosmoflow.py, unet3d.py): volume edge,
    samples written, strategy s/ds/d, model-group size and split axis."""
    flags.DEFINE_integer("volume_size", 32, f"volume edge D = H = W (divisible by {divisible_by})")
    flags.DEFINE_integer("samples", 0, "volumes written (default: 2 global batches)")
    flags.DEFINE_enum("strategy", "s", ["s", "ds", "d"], "s (all ranks split each volume), ds "
                      "(model groups of --model_parallel split it) or d (whole volumes per rank)")
    flags.DEFINE_integer("model_parallel", 0, "ranks per model group (default: all for s, 2 "
                         "for ds, 1 for d)")
    flags.DEFINE_string("spatial", "depth", "split axis: depth, height or width")


def volume_grid():
    """``tfhybrid.init`` with the model groups ``--strategy``/``--model_parallel`` ask
    for. Returns (world size, grid); a size that does not fit is a usage error."""
    world = tfhybrid.init().size
    mp = FLAGS.model_parallel or {"s": world, "ds": min(2, world), "d": 1}[FLAGS.strategy]
    if world % mp or (FLAGS.strategy == "s" and mp != world):
        raise app.UsageError(f"--model_parallel={mp} with --strategy={FLAGS.strategy} on "
                             f"{world} ranks: s uses all ranks, ds a divisor of them.")
    tfhybrid.shutdown()
    return world, tfhybrid.init(model_parallel=mp)


@contextlib.contextmanager
def volume_files(write, n, prefix):
    """The directory holding the ``n`` volumes ``write(directory, n)`` puts there.

    With ``--data_dir`` rank 0 writes them once and every rank waits until they
    exist (every rank must see that directory); without it each rank writes the
    same seeded files to a temporary directory of its own, removed on exit.
    """
    if FLAGS.data_dir:
        os.makedirs(FLAGS.data_dir, exist_ok=True)
        if tfhybrid.is_root():
            write(FLAGS.data_dir, n)
        tfhybrid.comm.barrier()         # the files exist before any rank opens them
        yield FLAGS.data_dir
        return
    directory = tempfile.mkdtemp(prefix=prefix)
    try:
        write(directory, n)
        yield directory
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def transform_volume_model(make_model, batch, title):
    """Print ``tfhybrid plan`` for ``make_model()`` at ``batch`` under ``title``,
    transform a fresh copy with ``--strategy``/``--spatial`` and print its
    ``describe`` on rank 0. Returns (transformed model, description)."""
    grid = tfhybrid.grid()
    common_title = f"{title}, {grid.data_size} data x {grid.model_size} model"
    print_plan(make_model(), batch, common_title, model_parallel=grid.model_size)
    options = {"spatial": FLAGS.spatial} if FLAGS.strategy != "d" else {}
    pmodel = tfhybrid.transform(make_model(), FLAGS.strategy, **options)
    say(f"\n-- {FLAGS.strategy} --")
    desc = tfhybrid.describe(pmodel, batch_size=batch,
                             print_fn=print if tfhybrid.is_root() else None)
    return pmodel, desc


def report_volumes(what, rows):
    """Print the result table ``rows`` of a volume example under a heading
    naming ``what`` was trained, the grid, batch and timed steps."""
    grid = tfhybrid.grid()
    say(f"\n{what} on {grid.size} ranks ({grid.data_size} data x {grid.model_size} "
        f"model), global batch {FLAGS.batch_size}, {FLAGS.steps} timed steps:")
    say(table(rows, list(rows[0])))


def fit_volumes(pmodel, data, **compile_kwargs):
    """Compile ``pmodel`` (Adam ``--lr``, ``compile_kwargs``: loss, metrics), fit
    warmup + timed steps over ``data`` repeated. Returns (StepTimer, history)."""
    pmodel.compile(optimizer=tfhybrid.DistributedOptimizer(keras.optimizers.Adam(FLAGS.lr)),
                   run_eagerly=FLAGS.run_eagerly, **compile_kwargs)
    timer = StepTimer()
    history = pmodel.fit(data.repeat(), epochs=1,
                         steps_per_epoch=FLAGS.warmup_steps + FLAGS.steps, verbose=0,
                         callbacks=tfhybrid.callbacks.standard() + [timer], shuffle=False)
    return timer, history


def table(rows, columns):
    """A plain-text table of dicts (rank 0 prints it)."""
    widths = [max(len(c), *(len(str(r[c])) for r in rows)) for c in columns]
    lines = ["  ".join(c.rjust(w) for c, w in zip(columns, widths)),
             "  ".join("-" * w for w in widths)]
    lines += ["  ".join(str(r[c]).rjust(w) for c, w in zip(columns, widths)) for r in rows]
    return "\n".join(lines)
