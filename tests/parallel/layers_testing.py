"""Helpers shared by tests/parallel/test_layers_*.py: run a parallel layer and
its dense Keras reference on the same data and compare values and gradients.

Layouts at the test boundary (``feed``/``collect``) turn the full replicated
test tensors into what a layer's ``input_layout`` expects and its output
back into the full tensor, with gradient layouts that are exact, so a wrong
forward *or* backward in the layer shows up as a mismatch.
"""
import os

import numpy as np
import tensorflow as tf

from tfhybrid import comm
from tfhybrid.comm import backend
from tfhybrid.layout import layout_of

FWD = dict(rtol=1e-5, atol=1e-5)
GRAD = dict(rtol=1e-4, atol=1e-4)


def block(a, axis, g):
    """Block ``g.index`` of ``g.size`` along ``axis`` of a numpy array."""
    return np.split(np.asarray(a), g.size, axis=axis)[g.index]


def feed(x, layout, g):
    """Full R tensor -> a tensor in ``layout`` whose gradient comes back exact."""
    if layout == "split":
        return comm.split(x, -1, g)
    if layout == "replicated_partial_grad":   # R value whose producer sums P gradients
        return comm.shard(comm.split(x, -1, g), -1, g)
    return x


def collect(y, u, layout, g):
    """(full output, loss) for an output in ``layout``; sum(loss over ranks)=<y, u>."""
    if layout == "split":
        return comm.gather(y, -1, g), tf.reduce_sum(y * block(u, -1, g))
    if layout == "partial":
        full = comm.reduce(y, g)
        return full, tf.reduce_sum(full * u)
    if layout == "replicated_partial_grad":   # consumer partitioned: gradient P
        mask = np.zeros(u.shape, np.float32)
        np.split(mask, g.size, axis=-1)[g.index][...] = 1
        return y, tf.reduce_sum(y * u * mask)
    return y, tf.reduce_sum(y * u)


def value_and_grads(call, variables, x, mode):
    """(y, dloss/dx, [dloss/dv]) of ``loss, y = call(x)``, eager or tf.function."""
    def step(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y, loss = call(x)
        gx, *gv = tape.gradient(loss, [x] + list(variables))
        return y, gx, gv
    if mode == "function":
        step = tf.function(step)
    y, gx, gv = step(tf.constant(x))
    return y.numpy(), gx.numpy(), [g.numpy() for g in gv]


def reference(layer, x, u):
    """(y, dx, {weight name: grad}) of the plain Keras layer on the full tensors."""
    def call(t):
        y = layer(t)
        return y, tf.reduce_sum(y * u)
    y, gx, gv = value_and_grads(call, layer.trainable_weights, x, "eager")
    return y, gx, dict(zip(names(layer.trainable_weights), gv))


def names(variables):
    return [v.path.split("/")[-1] for v in variables]


def reduced(variable, grad, g):
    """The group-complete gradient of ``variable`` (partial ones summed over ``g``)."""
    if layout_of(variable).kind == "partial" and g.size > 1:
        return backend.allreduce(tf.constant(grad), g.ranks, "test.partial").numpy()
    return grad


def expected(variable, full, g):
    """This rank's part of the reference gradient ``full`` of ``variable``."""
    lay = layout_of(variable)
    if lay.kind == "sharded" and g.size > 1:
        return block(full, lay.axis, g)
    return full


def check_weight_grads(variables, grads, ref_grads, g):
    for v, gr, name in zip(variables, grads, names(variables)):
        np.testing.assert_allclose(reduced(v, gr, g), expected(v, ref_grads[name], g),
                                   err_msg=f"gradient of {v.path}", **GRAD)


def count_horovod_ops(concrete_fn):
    """{op type: count} of the Horovod collectives in a traced function's graph."""
    counts = {}
    for op in concrete_fn.graph.get_operations():
        if op.type.startswith("Horovod"):
            counts[op.type] = counts.get(op.type, 0) + 1
    return counts


def rank_path(tmp_path, stem):
    """A per-rank file name (every rank of the pytest session saves its own)."""
    return os.path.join(str(tmp_path), f"{stem}.rank{backend.rank()}.keras")


def compare_partitioned(cls, ref, in_layout, out_layout, mode, x, u):
    """``cls.from_layer(ref)`` equals ``ref`` in value, input and weight gradients."""
    g = comm.resolve_group("model")
    layer = cls.from_layer(ref, input_layout=in_layout, output_layout=out_layout)
    y_ref, dx_ref, dw_ref = reference(ref, x, u)

    def call(t):
        return collect(layer(feed(t, in_layout, g)), u, out_layout, g)

    y, dx, dw = value_and_grads(call, layer.trainable_weights, x, mode)
    np.testing.assert_allclose(y, y_ref, **FWD)
    np.testing.assert_allclose(dx, dx_ref, **GRAD)
    check_weight_grads(layer.trainable_weights, dw, dw_ref, g)


def check_save_load(model, x, path):
    """``model`` saved to ``path`` loads back with the same classes, weights,
    layouts and outputs."""
    import keras
    model.save(path)
    loaded = keras.models.load_model(path)
    assert [type(a) for a in loaded.layers] == [type(b) for b in model.layers]
    for a, b in zip(loaded.weights, model.weights):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
        assert layout_of(a) == layout_of(b)
    np.testing.assert_allclose(loaded(x), model(x), **FWD)


# -- filter/channel-parallel convolutions (test_layers_conv.py, test_conv3d_parallel.py) --

def seeded_conv(source, filters, in_ch, *key, **options):
    """A built ``source`` (keras.layers.Conv2D/Conv3D) with weights every rank draws
    from ``key``, named after its filters."""
    from conftest import randn
    layer = source(filters, name=f"{source.__name__.lower()}_{filters}", **options)
    layer.build((None,) * (len(layer.kernel_size) + 1) + (in_ch,))
    layer.set_weights([randn(w.shape, "w", i, *key) for i, w in enumerate(layer.weights)])
    return layer


def conv_config_id(config):
    """Test id of a (kernel_size, strides, padding, dilation_rate, activation, use_bias) tuple."""
    return "k{}-s{}-{}-d{}-{}-{}".format(*config).replace(" ", "")


def conv_of_config(source, filters, in_ch, config):
    """:func:`seeded_conv` with the options of a :func:`conv_config_id` tuple."""
    ks, st, pad, dil, act, bias = config
    return seeded_conv(source, filters, in_ch, "cfg", conv_config_id(config), kernel_size=ks,
                       strides=st, padding=pad, dilation_rate=dil, activation=act, use_bias=bias)


def compare_conv(cls, ref, in_shape, in_layout, out_layout, mode):
    """:func:`compare_partitioned` of ``ref`` on seeded inputs of ``in_shape``."""
    from conftest import randn
    u = randn(ref.compute_output_shape(in_shape), "u", ref.name)
    compare_partitioned(cls, ref, in_layout, out_layout, mode, randn(in_shape, "x"), u)


def check_conv_stack(ref, par, x, u, g, mode):
    """Sequential ``par`` (an f(split) -> c(split) stack of ``ref``'s layers) equals
    ``ref`` in value, input gradient and this rank's block of every weight gradient,
    and its traced train step issues one allreduce forward and one for dx."""
    def loss_of(model):
        return lambda t: (model(t), tf.reduce_sum(model(t) * u))

    y_ref, dx_ref, dw_ref = value_and_grads(loss_of(ref), ref.trainable_weights, x, "eager")
    y, dx, dw = value_and_grads(loss_of(par), par.trainable_weights, x, mode)
    np.testing.assert_allclose(y, y_ref, **FWD)
    np.testing.assert_allclose(dx, dx_ref, **GRAD)
    for v, gr, full in zip(par.trainable_weights, dw, dw_ref):
        np.testing.assert_allclose(gr, expected(v, full, g), err_msg=v.path, **GRAD)

    @tf.function
    def train_step(t):
        with tf.GradientTape() as tape:
            tape.watch(t)
            loss = tf.reduce_sum(par(t))
        return tape.gradient(loss, [t] + par.trainable_weights)

    concrete = train_step.get_concrete_function(tf.constant(x))
    train_step(tf.constant(x))
    assert count_horovod_ops(concrete) == ({"HorovodAllreduce": 2} if g.size > 1 else {})


def check_conv_to_layer(ref, classes):
    """``from_layer`` -> config round trip -> ``to_layer`` gives ``ref`` back exactly,
    for each (parallel class, layout options) of ``classes``."""
    for cls, options in classes:
        layer = cls.from_layer(ref, **options)
        assert type(layer).from_config(layer.get_config()).get_config() == layer.get_config()
        plain = layer.to_layer()
        assert type(plain) is type(ref) and plain.get_config() == ref.get_config()
        for a, b in zip(plain.get_weights(), ref.get_weights()):
            np.testing.assert_array_equal(a, b)
