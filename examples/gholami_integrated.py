"""Gholami et al.: integrated batch, domain and model parallelism, chosen per layer.

Gholami et al. split a CNN's P processes into a grid: batch parallelism
across it, and within each group of ranks the early convolutions split by
*domain* (image halves, halo exchange: their activations are large, their
weights small) while the fully-connected layers split by *model* (their
weights are large, their activations small). ``tfhybrid.transform(model,
"ds", layers={...})`` builds that mix: ``ds`` splits the leading
convolutions spatially within model groups of ``--model_parallel`` ranks
over data-parallel groups, and ``layers=`` overrides single layers
(``{"fc0": "f", "fc1": "c"}``: the first FC layer split by output units, the
second by input units, with nothing exchanged between the two).

The script prints the oracle's plan for the shape and, for pure batch
parallelism (``d``), domain + batch (``ds``, FC layers replicated) and the
integrated mix, the per-layer layout (``tfhybrid.describe``), this rank's
parameter bytes, the bytes its collectives move per step, and the measured
throughput::

    horovodrun -np 4 --gloo python examples/gholami_integrated.py --model_parallel=2
    horovodrun -np 16 -H a:4,b:4,c:4,d:4 python examples/gholami_integrated.py \\
        --model_parallel=4 --image_size=128 --dataset=folder --data_dir=/data/train
"""
import sys

from absl import app, flags

import common
from common import FLAGS, say

import keras

import tfhybrid

flags.DEFINE_integer("model_parallel", 2, "ranks per model group (domain / model split)")
flags.DEFINE_integer("image_size", 64, "input height and width")
flags.DEFINE_integer("filters", 16, "filters of the first convolutions (doubled after each pool)")
flags.DEFINE_integer("fc_units", 512, "units of the two hidden FC layers")
flags.DEFINE_integer("classes", 10, "classes")
flags.DEFINE_list("layers", ["fc0=f", "fc1=c"], "per-layer overrides of the integrated mix, "
                  "name=f|c|s|replicate")
flags.DEFINE_list("configs", ["d", "ds", "ds+layers"], "what to run: d, ds, ds+layers")


def make_model():
    """conv-conv-pool-conv-pool on --image_size images, then FC-FC-classifier."""
    keras.utils.set_random_seed(FLAGS.seed)
    L, f = keras.layers, FLAGS.filters
    return keras.Sequential([
        keras.Input((FLAGS.image_size, FLAGS.image_size, 3)),
        L.Conv2D(f, 3, padding="same", activation="relu", name="conv0"),
        L.Conv2D(f, 3, padding="same", activation="relu", name="conv1"),
        L.MaxPooling2D(2, name="pool1"),
        L.Conv2D(2 * f, 3, padding="same", activation="relu", name="conv2"),
        L.MaxPooling2D(2, name="pool2"),
        L.Flatten(name="flatten"),
        L.Dense(FLAGS.fc_units, activation="relu", name="fc0"),
        L.Dense(FLAGS.fc_units, activation="relu", name="fc1"),
        L.Dense(FLAGS.classes, name="fc2")], name="gholami_cnn")


def parse_layers(items):
    layers = {}
    for item in items:
        name, _, kind = item.partition("=")
        if not name or kind not in ("f", "c", "s", "replicate"):
            raise app.UsageError(f"--layers {item!r}: expected name=f|c|s|replicate, e.g. "
                                 "--layers=fc0=f,fc1=c.")
        layers[name] = kind
    return layers


def run(config, layers):
    keras.utils.clear_session()
    model = make_model()
    if config == "d":
        pmodel = tfhybrid.transform(model, strategy="d")
    elif config == "ds":
        pmodel = tfhybrid.transform(model, strategy="ds")
    else:
        pmodel = tfhybrid.transform(model, strategy="ds", layers=layers)
    say(f"\n-- {config} --")
    desc = tfhybrid.describe(pmodel, batch_size=FLAGS.batch_size,
                             print_fn=print if tfhybrid.is_root() else None)
    shape = (FLAGS.image_size, FLAGS.image_size, 3)
    data = common.global_batches(shape, FLAGS.classes, FLAGS.warmup_steps + FLAGS.steps,
                                 model=pmodel)
    timer, history = common.train(pmodel, data)
    return {"config": config, "images/s": f"{timer.images_per_second(FLAGS.warmup_steps):.1f}",
            "param KB/rank": f"{desc.param_bytes / 1024:.0f}",
            "comm KB/step": f"{desc.comm_bytes / 1024:.0f}",
            "loss": f"{history.history['loss'][-1]:.3f}"}


def main(argv):
    del argv
    world = tfhybrid.init().size
    if world % FLAGS.model_parallel:
        raise app.UsageError(f"--model_parallel={FLAGS.model_parallel} must divide the world "
                             f"size {world}.")
    unknown = set(FLAGS.configs) - {"d", "ds", "ds+layers"}
    if unknown:
        raise app.UsageError(f"--configs {sorted(unknown)}: expected d, ds, ds+layers.")
    layers = parse_layers(FLAGS.layers)
    rows = []
    for config in FLAGS.configs:
        mp = 1 if config == "d" else FLAGS.model_parallel
        tfhybrid.shutdown()
        grid = tfhybrid.init(model_parallel=mp)
        if config != "ds+layers" or not rows:
            common.print_plan(make_model(), FLAGS.batch_size,
                              f"{grid.data_size} data x {grid.model_size} model",
                              model_parallel=mp)
        rows.append(run(config, layers))
    say(f"\nintegrated parallelism on {world} ranks (model groups of {FLAGS.model_parallel}; "
        f"layers={layers}), global batch {FLAGS.batch_size}, {FLAGS.steps} timed steps:")
    say(common.table(rows, ["config", "images/s", "param KB/rank", "comm KB/step", "loss"]))
    return 0


if __name__ == "__main__":
    sys.exit(app.run(main))
