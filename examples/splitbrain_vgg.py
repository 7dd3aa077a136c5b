"""SplitBrain (Table 2 in miniature): the CIFAR-10 VGG over every DP x MP grid.

SplitBrain's VGG variant (Table 1: 7 convolutions, FC0 4096x1024, FC1
1024x1024, FC2 1024x10) trains on p ranks as DP data-parallel replicas x MP
model-parallel ranks: the convolutions are data parallel over all p ranks,
the fully-connected layers whose compute-to-communication ratio passes the
threshold are split within groups of MP (``strategy="gmp"``; MP=1 is plain
data parallelism, ``"d"``). For each grid the script prints the oracle's
plan for that shape, trains ``--steps`` steps and reports the measured
throughput and the per-rank parameter memory, the two columns of SplitBrain's
Table 2 and Figure 7c::

    horovodrun -np 2 --gloo python examples/splitbrain_vgg.py                 # synthetic
    horovodrun -np 8 -H a:4,b:4 python examples/splitbrain_vgg.py \\
        --dataset=cifar10 --data_dir=/data/cifar10 --batch_size=256 --steps=50

``--width`` scales every layer (0.25 runs in seconds on a laptop).
"""
import sys

from absl import app, flags

import common
from common import FLAGS, say

import keras

import tfhybrid
from tfhybrid.layout import layout_of
from tfhybrid.oracle import machine as oracle_machine, predict

# (not --mp: horovodrun would take it for an abbreviation of its own --mpi options)
flags.DEFINE_list("mp_sizes", [], "MP (model-parallel group) sizes to run, e.g. 1,2 "
                  "(default: every divisor of the world size)")
flags.DEFINE_float("width", 1.0, "multiplier of every layer's width (1.0: SplitBrain Table 1)")
flags.DEFINE_float("ccr_threshold", None, "SplitBrain's CCR threshold for splitting an FC "
                   "layer (default: tfhybrid's, 64)")
flags.DEFINE_integer("classes", 10, "classes (CIFAR-10: 10)")


def make_vgg(width, classes):
    """SplitBrain's Table 1 VGG for 32x32x3 images, every layer's width x ``width``."""
    w = lambda n: max(2, int(round(n * width)))  # noqa: E731
    layers = [keras.Input((32, 32, 3))]
    for i, c in enumerate([64, 64, "pool", 128, 128, "pool", 256, 256, 256, "pool"]):
        if c == "pool":
            layers.append(keras.layers.MaxPooling2D(2, name=f"pool{i}"))
        else:
            layers.append(keras.layers.Conv2D(w(c), 3, padding="same", activation="relu",
                                              name=f"conv{i}"))
    layers += [keras.layers.Flatten(name="flatten"),
               keras.layers.Dense(w(1024), activation="relu", name="fc0"),
               keras.layers.Dense(w(1024), activation="relu", name="fc1"),
               keras.layers.Dense(classes, name="fc2")]
    return keras.Sequential(layers, name="splitbrain_vgg")


def run_grid(mp):
    """Train on a grid of (p / mp) x mp; returns the row of the table."""
    tfhybrid.shutdown()
    grid = tfhybrid.init(model_parallel=mp)
    keras.utils.clear_session()
    keras.utils.set_random_seed(FLAGS.seed)
    model = make_vgg(FLAGS.width, FLAGS.classes)
    strategy = "gmp" if mp > 1 else "d"
    common.print_plan(model, FLAGS.batch_size, f"DP {grid.size // mp} x MP {mp}",
                      strategies=("d", "gmp", "df", "f"), model_parallel=mp)
    machine = FLAGS.machine or oracle_machine.cluster_machine_path()
    predicted = predict(model, strategy, grid.size, FLAGS.batch_size, machine,
                        **({"mp": mp} if strategy == "gmp" else {}))
    options = {}
    if strategy == "gmp" and FLAGS.ccr_threshold is not None:
        options["ccr_threshold"] = FLAGS.ccr_threshold
    pmodel = tfhybrid.transform(model, strategy=strategy, **options)
    split = sorted({v.path.split("/")[0] for v in pmodel.weights
                    if layout_of(v).kind == "sharded"})
    data = common.global_batches((32, 32, 3), FLAGS.classes, FLAGS.warmup_steps + FLAGS.steps,
                                 model=pmodel)
    timer, history = common.train(pmodel, data)
    weights = common.nbytes(pmodel.weights)
    slots = common.nbytes(pmodel.optimizer.variables)
    row = {"p": grid.size, "DP": grid.size // mp, "MP": mp, "strategy": strategy,
           "images/s": f"{timer.images_per_second(FLAGS.warmup_steps):.1f}",
           "plan images/s": f"{FLAGS.batch_size / predicted.total_s:.0f}",
           "weights MB/rank": f"{weights / 2**20:.2f}",
           "+slots MB/rank": f"{(weights + slots) / 2**20:.2f}",
           "FC split": ",".join(split) or "-",
           "loss": f"{history.history['loss'][-1]:.3f}"}
    say(f"DP {row['DP']} x MP {mp}: {row['images/s']} images/s, {row['weights MB/rank']} MB "
        f"of weights per rank (FC layers split: {row['FC split']})")
    return row


def main(argv):
    del argv
    world = tfhybrid.init().size
    mps = [int(m) for m in FLAGS.mp_sizes] or [m for m in range(1, world + 1) if world % m == 0]
    bad = [m for m in mps if m < 1 or world % m]
    if bad:
        raise app.UsageError(f"--mp_sizes {bad}: each model-parallel size must divide the world "
                             f"size {world}.")
    rows = [run_grid(mp) for mp in mps]
    say(f"\nSplitBrain Table 2 in miniature ({FLAGS.dataset}, global batch {FLAGS.batch_size}, "
        f"width {FLAGS.width}, {FLAGS.steps} timed steps):")
    say("(images/s measured here; plan images/s predicted by the oracle for --machine, default "
        "ParaDL's ABCI V100 cluster)")
    say(common.table(rows, ["p", "DP", "MP", "strategy", "images/s", "plan images/s",
                            "weights MB/rank",
                            "+slots MB/rank", "FC split", "loss"]))
    return 0


if __name__ == "__main__":
    sys.exit(app.run(main))
