"""Conv3D under f, c and df, in one process: the planner partitions Conv3D
like Conv2D (pairs f -> c through 3-D pooling), the rewrite builds the 3-D
parallel layers, and the oracle's f/c pricing counts the Conv3D layers the
transformer partitions. Multi-rank exactness: tests/parallel/test_conv3d_parallel.py."""
import keras

from tfhybrid import oracle
from tfhybrid.transformer.rewrite import _CHANNEL, _FILTER

from test_transform_spatial_cropping import plan_of

MACHINE = {"alpha": 1e-5, "beta": 1e-9, "flop_rate": 1e10}


def cosmoflow():
    i = keras.Input((8, 8, 8, 4))
    x = keras.layers.Conv3D(8, 3, padding="same", activation="relu", name="conv1")(i)
    x = keras.layers.MaxPooling3D(2, name="pool1")(x)
    x = keras.layers.Conv3D(8, 3, padding="same", name="conv2")(x)
    x = keras.layers.BatchNormalization(name="bn")(x)
    x = keras.layers.MaxPooling3D(2, name="pool2")(x)
    x = keras.layers.Flatten(name="flat")(x)
    x = keras.layers.Dense(8, activation="relu", name="fc1")(x)
    return keras.Model(i, keras.layers.Dense(4, name="out")(x))


def test_f_pairs_conv3d_through_3d_pooling():
    plan = plan_of(cosmoflow(), "f", 4, 4)
    node = {n.name: n for n in plan.nodes}
    assert node["conv1"].kind == "filter" and node["conv1"].params["output_layout"] == "split"
    assert node["conv2"].kind == "channel" and node["conv2"].params["input_layout"] == "split"
    assert node["pool1"].output.kind == "channel"
    assert node["fc1"].params["output_layout"] == "split"
    assert _FILTER["Conv3D"].__name__ == "FilterParallelConv3D"
    assert _CHANNEL["Conv3D"].__name__ == "ChannelParallelConv3D"


def test_c_and_df_partition_every_conv3d():
    assert {n.name: n.kind for n in plan_of(cosmoflow(), "c", 2, 2).nodes if n.cls == "Conv3D"} \
        == {"conv1": "channel", "conv2": "channel"}
    plan = plan_of(cosmoflow(), "df", 4, 2)
    assert [n.kind for n in plan.nodes if n.cls == "Conv3D"] == ["filter", "channel"]
    assert plan.node("bn").kind == "syncbn" and plan.node("bn").params["bn_groups"] == ("data",)


def test_oracle_prices_conv3d_under_f_and_c():
    prof = oracle.profile(cosmoflow())
    f = oracle.predict(prof, "f", p=4, batch_size=8, machine=MACHINE)
    assert f.options["partitioned_layers"] == ["conv1", "conv2", "fc1", "out"]
    assert ("conv1", "conv2") in [tuple(p) for p in f.options["pairs"]]
    c = oracle.predict(prof, "c", p=4, batch_size=8, machine=MACHINE)
    assert "conv2" in c.options["partitioned_layers"]
    assert f.comm_total_s > 0 and c.comm_total_s > 0
