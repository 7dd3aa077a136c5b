"""Functional models with ``keras.ops`` operation nodes (``x / 255.0``, ``a + b``)
in the planner (one process): each node is described as an operation of a
kind (elementwise, merge, full), and planned like the layer of that kind."""
import keras
import numpy as np
import pytest

from tfhybrid.process_grid import ProcessGrid
from tfhybrid.transformer.graph import as_functional, describe_graph
from tfhybrid.transformer.options import make_options
from tfhybrid.transformer.planner import make_plan


def _graph(build):
    inp = keras.Input((8, 8, 4))
    return describe_graph(as_functional(keras.Model(inp, build(inp))))


@pytest.mark.parametrize("build,kind", [
    (lambda x: x / 255.0, "elementwise"),
    (lambda x: keras.ops.relu(x), "elementwise"),
    (lambda x: keras.ops.clip(x, 0.0, 1.0), "elementwise"),
    (lambda x: x * np.float32(2), "elementwise"),
    (lambda x: x + x, "merge"),
    (lambda x: x * np.ones(4, np.float32), "full"),             # a per-channel constant
    (lambda x: x + keras.ops.mean(x, axis=-1, keepdims=True), "full"),   # broadcast
    (lambda x: keras.ops.softmax(x), "full"),                    # mixes channels
    (lambda x: keras.ops.transpose(x, (0, 2, 1, 3)), "full"),
    (lambda x: keras.ops.where(x > 0, x, 0.0), "merge"),       # the mask and x
    (lambda x: keras.ops.where(x > 0, 1.0, 0.0), "elementwise"),
    (lambda x: keras.ops.concatenate([x, x * 2.0], axis=-1), "concat"),
    (lambda x: keras.ops.concatenate([x, x], axis=1), "concat"),   # planned by its axis
    (lambda x: keras.ops.concatenate([x, keras.ops.mean(x, axis=-1, keepdims=True)], -1),
     "concat"),
])
def test_operations_are_described_by_kind(build, kind):
    last = _graph(build).nodes[-1]
    assert last.attr("operation") == kind and last.n_params == 0


def _model():
    inp = keras.Input((8, 8, 4))
    h = inp / 255.0
    h = keras.layers.Conv2D(8, 3, padding="same", name="c0")(h)
    h = keras.ops.relu(h) + h * 0.5
    h = keras.layers.Conv2D(8, 3, padding="same", name="c1")(h)
    h = keras.layers.Flatten(name="flat")(h)
    h = keras.ops.tanh(keras.layers.Dense(16, name="fc0")(h))
    return keras.Model(inp, keras.layers.Dense(4, name="fc1")(h))


def _plan(strategy, size, m):
    graph = describe_graph(as_functional(_model()))
    plan = make_plan(graph, make_options(strategy), ProcessGrid(size, 0, m))
    return {n.name: n for n in plan.nodes}, graph


def test_operations_do_not_end_the_spatial_region():
    nodes, graph = _plan("s", 2, 2)
    assert nodes["c0"].kind == nodes["c1"].kind == "spatial"
    ops = [n.name for n in graph.nodes if n.attr("operation")]
    between = [n for n in ops if graph.names().index("c0") < graph.names().index(n)
               < graph.names().index("c1")]
    assert len(between) == 3 and all(nodes[n].output.kind == "space" for n in between)
    assert nodes[ops[0]].output.kind == "replicated"       # x / 255.0 before the region


def test_an_elementwise_operation_keeps_a_filter_channel_pair():
    nodes, graph = _plan("f", 2, 2)
    tanh = next(n.name for n in graph.nodes if n.cls == "Tanh")
    assert nodes["fc0"].kind == "filter" and nodes["fc1"].kind == "channel"
    assert nodes[tanh].conversions == (None,)


def _unet():
    """A U-Net whose skip joins by keras.ops.concatenate (channels, or rows)."""
    def build(axis):
        inp = keras.Input((8, 8, 2))
        a = keras.layers.Conv2D(4, 3, padding="same", name="enc")(inp)
        b = keras.layers.MaxPooling2D(name="pool")(a)
        b = keras.layers.Conv2D(4, 3, padding="same", name="mid")(b)
        b = keras.layers.UpSampling2D(name="up")(b)
        x = keras.ops.concatenate([a, b], axis=axis)
        x = keras.layers.Conv2D(4, 3, padding="same", name="dec")(x)
        return keras.Model(inp, keras.layers.Conv2D(3, 1, name="head")(x))
    return build


@pytest.mark.parametrize("axis,spatial", [(-1, True), (3, True), (1, False)])
def test_a_concatenate_operation_joins_blocks_along_channels_only(axis, spatial):
    """keras.ops.concatenate of a U-Net's skip along channels keeps the decoder
    on blocks (like a Concatenate layer); along a split axis it gathers."""
    graph = describe_graph(as_functional(_unet()(axis)))
    plan = make_plan(graph, make_options("s"), ProcessGrid(2, 0, 2))
    nodes = {n.name: n for n in plan.nodes}
    cat = next(n.name for n in graph.nodes if n.attr("operation") == "concat")
    assert (nodes[cat].output.kind == "space") is spatial
    assert (nodes["dec"].kind == "spatial") is spatial and nodes["enc"].kind == "spatial"
