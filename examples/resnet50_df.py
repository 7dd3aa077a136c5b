"""ResNet-50 with ``df``: data-parallel groups x filter-parallel model groups.

``keras.applications.ResNet50`` (weights=None) on small images: every
convolution and the classifier are split by output filters within model
groups of ``--model_parallel`` ranks (ParaDL's filter parallelism; batch
norms become synchronised over the model group's channels), and the model
groups are data-parallel replicas (the ``df`` row of ParaDL Table 3). The
script prints the oracle's plan for the shape, the per-rank parameter count
(``model.summary`` says it is per rank) and the measured throughput::

    horovodrun -np 2 --gloo python examples/resnet50_df.py --image_size=32 --steps=3
    horovodrun -np 16 -H a:4,b:4,c:4,d:4 python examples/resnet50_df.py \\
        --model_parallel=4 --image_size=224 --classes=1000 --batch_size=256 \\
        --dataset=folder --data_dir=/data/imagenet/train

``--dataset=folder`` reads one sub-directory of images per class (ImageNet's
train/ layout); ``--dataset=cifar10`` with ``--image_size=32``.
"""
import sys

from absl import app, flags

import common
from common import FLAGS, say

import keras

import tfhybrid
from tfhybrid.layout import layout_of

flags.DEFINE_integer("model_parallel", 2, "ranks per model group (filter split)")
flags.DEFINE_integer("image_size", 32, "input height and width (ImageNet: 224)")
flags.DEFINE_integer("classes", 10, "classes (ImageNet: 1000)")
flags.DEFINE_string("strategy", "df", "df (default); d, f, ds, gmp also run for comparison")


def main(argv):
    del argv
    world = tfhybrid.init().size
    if world % FLAGS.model_parallel:
        raise app.UsageError(f"--model_parallel={FLAGS.model_parallel} must divide the world "
                             f"size {world}.")
    tfhybrid.shutdown()
    grid = tfhybrid.init(model_parallel=FLAGS.model_parallel)
    keras.utils.set_random_seed(FLAGS.seed)
    shape = (FLAGS.image_size, FLAGS.image_size, 3)
    model = keras.applications.ResNet50(weights=None, input_shape=shape,
                                        classes=FLAGS.classes, classifier_activation=None)
    common.print_plan(model, FLAGS.batch_size, f"ResNet-50 {shape[0]}x{shape[1]}, "
                      f"{grid.data_size} data x {grid.model_size} model",
                      model_parallel=grid.model_size)
    # fallback="replicate": layers the strategy cannot split (e.g. a classifier whose
    # units the group size does not divide) stay replicated instead of failing.
    pmodel = tfhybrid.transform(model, strategy=FLAGS.strategy, fallback="replicate")
    local = sum(int(v.numpy().size) for v in pmodel.weights)
    sharded = [v for v in pmodel.weights if layout_of(v).kind == "sharded"]
    say(f"{FLAGS.strategy}: {grid.data_size} data x {grid.model_size} model; this rank holds "
        f"{local:,} of the model's {model.count_params():,} parameters "
        f"({len(sharded)} of {len(pmodel.weights)} weights split by filters)")
    if tfhybrid.is_root():
        lines = []
        pmodel.summary(print_fn=lines.append)
        print(lines[-1])                    # tfhybrid's line: the counts are per rank
    data = common.global_batches(shape, FLAGS.classes, FLAGS.warmup_steps + FLAGS.steps,
                                 model=pmodel)
    timer, history = common.train(pmodel, data)
    say(f"\nResNet-50 {FLAGS.strategy} on {grid.size} ranks, global batch {FLAGS.batch_size}: "
        f"{timer.images_per_second(FLAGS.warmup_steps):.1f} images/s over {FLAGS.steps} steps, "
        f"loss {history.history['loss'][-1]:.3f}, "
        f"{common.nbytes(pmodel.weights) / 2**20:.1f} MB of weights per rank "
        f"(single process: {common.nbytes(model.weights) / 2**20:.1f} MB)")
    return 0


if __name__ == "__main__":
    sys.exit(app.run(main))
