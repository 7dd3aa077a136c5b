"""Lee et al.: data parallelism with replicated fully-connected gradients.

In data parallelism every rank all-reduces each weight gradient; for a big
first FC layer (VGG-A's 25,088 x 4,096) that is most of the traffic. Lee et
al. (Section III-C.2) all-gather the layer's inputs and output errors
instead, (K_in + K_out) x B values for a global batch of B, and let every
rank compute the whole batch's weight gradient itself.
``tfhybrid.DistributedOptimizer(..., replicate_fc_gradients=F)`` does it for
the first F Dense layers. The script prints the oracle's plan, the bytes
each FC layer moves both ways, then trains the same model from the same
weights on the same batches with F=0 and with F, and reports the step times
and the largest difference between the two runs' weights (the two are the
same computation: float32 round-off only)::

    horovodrun -np 2 --gloo python examples/lee_replicated_fc.py --steps=5
    horovodrun -np 8 -H a:4,b:4 python examples/lee_replicated_fc.py \\
        --dataset=cifar10 --data_dir=/data/cifar10 --batch_size=128 --fc_units=4096
"""
import sys

import numpy as np
from absl import app, flags

import common
from common import FLAGS, say

import keras

import tfhybrid
from tfhybrid.oracle import machine as oracle_machine, predict

flags.DEFINE_integer("replicate_fc", 2, "F: Dense layers (from the input) whose gradients are "
                     "computed replicated")
flags.DEFINE_integer("fc_units", 1024, "units of the two hidden FC layers")
flags.DEFINE_integer("conv_filters", 32, "filters of the first convolution (doubles twice)")
flags.DEFINE_integer("classes", 10, "classes")


def make_model():
    """A small VGG-A: three conv blocks on 32x32x3, then FC-FC-classifier (big first FC)."""
    keras.utils.set_random_seed(FLAGS.seed)
    L = keras.layers
    layers = [keras.Input((32, 32, 3))]
    for i in range(3):
        layers += [L.Conv2D(FLAGS.conv_filters * 2 ** i, 3, padding="same", activation="relu",
                            name=f"conv{i}"), L.MaxPooling2D(2, name=f"pool{i}")]
    layers += [L.Flatten(name="flatten"),
               L.Dense(FLAGS.fc_units, activation="relu", name="fc0"),
               L.Dense(FLAGS.fc_units, activation="relu", name="fc1"),
               L.Dense(FLAGS.classes, name="fc2")]
    return keras.Sequential(layers, name="vgg_a_small")


def run(replicate_fc):
    keras.utils.clear_session()
    model = make_model()
    pmodel = tfhybrid.transform(model, strategy="d")
    optimizer = tfhybrid.DistributedOptimizer(keras.optimizers.SGD(FLAGS.lr, momentum=0.9),
                                              replicate_fc_gradients=replicate_fc)
    data = common.global_batches((32, 32, 3), FLAGS.classes, FLAGS.warmup_steps + FLAGS.steps,
                                 model=pmodel)
    timer, history = common.train(pmodel, data, optimizer)
    weights = tfhybrid.gather(pmodel).get_weights()       # collective: every rank
    steps = timer.times[FLAGS.warmup_steps:] or timer.times
    return weights, 1e3 * float(np.median(steps)), history.history["loss"][-1]


def main(argv):
    del argv
    grid = tfhybrid.init()
    model = make_model()
    dense = [layer for layer in model.layers if isinstance(layer, keras.layers.Dense)]
    if not 0 <= FLAGS.replicate_fc <= len(dense):
        raise app.UsageError(f"--replicate_fc={FLAGS.replicate_fc}: expected 0..{len(dense)} "
                             "(the model's Dense layers).")
    B = FLAGS.batch_size
    common.print_plan(model, B, f"data parallel over {grid.size} ranks",
                      strategies=("d", "f", "df", "gmp"))
    machine = FLAGS.machine or oracle_machine.cluster_machine_path()
    say("\nthe oracle's `d` with Lee et al.'s option (predict(model, 'd', ..., replicated_fc=F)):")
    for f in sorted({0, FLAGS.replicate_fc}):
        pred = predict(model, "d", grid.size, B, machine, replicated_fc=f)
        say(f"  F={f}: {1e3 * pred.total_s:.4g} ms per step: gradient all-reduce "
            f"{1e3 * pred.comm_s['GE-allreduce']:.4g} ms, FC all-gathers {1e3 * pred.comm_s['FB-allgather']:.4g} "
            f"ms, compute {1e3 * (pred.compute_s + pred.overhead_s):.4g} ms")
    say("\nbytes per step (float32): all-reduce of the gradient vs all-gather of "
        "[inputs | errors] of the global batch")
    for layer in dense[:FLAGS.replicate_fc]:
        k_in, k_out = layer.kernel.shape
        say(f"  {layer.name}: {k_in} x {k_out}: all-reduce {4 * (k_in * k_out + k_out):,} B, "
            f"all-gather {4 * (k_in + k_out) * B:,} B")

    plain, plain_ms, plain_loss = run(0)
    lee, lee_ms, lee_loss = run(FLAGS.replicate_fc)
    diff = max(float(np.max(np.abs(a - b)) / max(1e-12, float(np.max(np.abs(b)))))
               for a, b in zip(lee, plain))
    say(f"\ndata parallel on {grid.size} ranks, global batch {B}, {FLAGS.steps} timed steps:")
    say(common.table([
        {"FC gradients": "all-reduced (F=0)", "median step ms": f"{plain_ms:.1f}",
         "loss": f"{plain_loss:.4f}"},
        {"FC gradients": f"replicated (F={FLAGS.replicate_fc})", "median step ms": f"{lee_ms:.1f}",
         "loss": f"{lee_loss:.4f}"}], ["FC gradients", "median step ms", "loss"]))
    say(f"largest weight difference between the two runs: {diff:.2e} of a tensor's largest "
        "weight (the same update: float32 round-off)")
    return 0


if __name__ == "__main__":
    sys.exit(app.run(main))
