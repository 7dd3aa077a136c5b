"""ParaDL file formats and its published projections (shared/paradl)."""
import math
import os

import pytest

from tfhybrid.oracle import Machine, predict
from tfhybrid.oracle import paradl_io as io

PARADL = "/work/shared/paradl"
need_data = pytest.mark.skipif(not os.path.isdir(PARADL), reason="ParaDL data not present")


def test_parse_net_text_and_duplicates():
    m = io.parse_net_text("Dataset|Toy\nInput|10x3x8x8\nModel|T\n# comment\n"
                          "CONV1|3x8x8|3x4x3x3|4x8x8|0.5\nRELU|4x8x8|4x4x0x0|4x8x8|0\n"
                          "RELU|4x8x8|4x4x0x0|4x8x8|0\nFC|4x8x8|4x2x8x8|2x1x1")
    rows = m.profile.rows
    assert [r.name for r in rows] == ["CONV1", "RELU", "RELU#2", "FC"]
    assert (m.dataset, m.dataset_size, m.profile.input_items, m.total_time) == ("Toy", 10, 192, 0.5)
    assert rows[0].weights == 108 and rows[0].kind == "conv" and rows[0].halo_x == 8 * 3
    assert rows[3].kind == "dense" and rows[3].weights == 512 and rows[3].y == 2
    assert rows[1].weights == 0 and rows[1].kind == "elementwise"
    assert sum(sum(v) for v in m.layer_times.values()) == pytest.approx(0.5)


def test_parse_errors():
    with pytest.raises(ValueError, match="line 1 'CONV1|3x8x8'"):
        io.parse_net_text("CONV1|3x8x8")
    with pytest.raises(ValueError, match="line 2 'oops'"):
        io.parse_lc_text("CONV1|1\noops")
    m = io.parse_net_text("Input|1x3x8x8\nCONV1|3x8x8|3x4x3x3|4x8x8")
    with pytest.raises(ValueError, match="has 2 entries but the model has 1 layers"):
        io.apply_lc(m, [("CONV1", True), ("X", False)])
    with pytest.raises(ValueError, match="entry 0 is 'FC' but the model's layer 0 is 'CONV1'"):
        io.apply_lc(m, [("FC", True)])
    with pytest.raises(ValueError, match="lacks keys"):
        io.machine_from_plat({"LATENCY": 1.0})


def test_summary_and_plat_text():
    rows = io.parse_summary("x\n==SUMMARY==\nname\tB\tp\nfilter3\t32.0\t2.0\t8.6e9\t5465.1\t2155.1"
                            "\t7620.2\t256.0\n")
    assert rows == [{"name": "filter3", "B": 32, "p": 2, "mem": 8.6e9, "tcomp": 5465.1,
                     "tcomm": 2155.1, "time": 7620.2}]
    plat = io.parse_plat_text("LATENCY|500E-9|second \nBANDWIDTH|12.5E9|Bps")
    assert plat == {"LATENCY": 5e-7, "BANDWIDTH": 12.5e9}


@need_data
def test_real_files_vgg():
    vgg = io.read_net(os.path.join(PARADL, "model/VGG_ImageNet_profall.net_sc"))
    assert len(vgg.profile.rows) == 38 and vgg.profile.total_weights == 169801408
    assert vgg.total_time == pytest.approx(0.008245589) and vgg.dataset_size == 1280000
    # per-layer split reproduces the tool's table within 0.2% (CONV1_1, FC6, MPOOL)
    assert sum(vgg.layer_times["CONV1_1"]) == pytest.approx(4.34765322602e-05, rel=2e-3)
    assert sum(vgg.layer_times["FC6"]) == pytest.approx(4.95864824011e-05, rel=2e-3)
    assert sum(vgg.layer_times["MPOOL"]) == pytest.approx(5.15274897282e-05, rel=2e-3)
    lc = io.read_lc(os.path.join(PARADL, "model/filter_vgg.lc"))
    vgg_f = io.apply_lc(vgg, lc)
    assert sum(vgg_f.profile.split) == 13
    mach = io.read_plat(os.path.join(PARADL, "ABCI.plat"), os.path.join(PARADL, "abci_tiers.json"))
    assert (mach.alpha, mach.beta, mach.memory_bytes, mach.ranks_per_node) == \
        (5e-7, 8e-11, 16e9, 4)
    assert mach.alpha_beta(8) == (3.031e-05, 4e-11)


@need_data
def test_reproduces_paradl_data_log_with_tool_conventions():
    """data_vgg_scaling_proj.log: Tcomp 5277.17696 s and, with the tool's doubled bandwidth
    term, Tcomm 272.0422528 s at p=2, B=64; memory 9360484864 B without ReLU rows."""
    vgg = io.read_net(os.path.join(PARADL, "model/VGG_ImageNet_profall.net_sc"))
    mach = io.read_plat(os.path.join(PARADL, "ABCI.plat"), os.path.join(PARADL, "abci_tiers.json"),
                        layer_times=vgg.layer_times).replace(wu_flops_per_param=0.0)
    r = predict(vgg.profile, "d", 2, 64, mach)
    assert r.per_epoch(vgg.dataset_size)["compute_s"] == pytest.approx(5277.17696, rel=1e-9)
    assert r.per_epoch(vgg.dataset_size)["comm_total_s"] == pytest.approx(136.2011264)
    tool = mach.replace(beta=2 * mach.beta, tiers=tuple(
        {"max_ranks": t.max_ranks, "alpha": t.alpha, "beta": 2 * t.beta} for t in mach.tiers))
    rt = predict(vgg.profile, "d", 2, 64, tool)
    assert rt.per_epoch(vgg.dataset_size)["comm_total_s"] == pytest.approx(272.0422528)
    import dataclasses
    no_relu = dataclasses.replace(vgg.profile, rows=tuple(
        x for x in vgg.profile.rows if not x.name.startswith("RELU")))
    assert predict(no_relu, "serial", 1, 32, mach).memory_bytes == 9360484864
    assert not math.isnan(r.total_s)


@need_data
def test_filter_with_layer_configuration_keeps_fc_replicated():
    vgg = io.apply_lc(io.read_net(os.path.join(PARADL, "model/VGG_ImageNet_profall.net_sc")),
                      io.read_lc(os.path.join(PARADL, "model/filter_vgg.lc")))
    mach = io.read_plat(os.path.join(PARADL, "ABCI.plat"), os.path.join(PARADL, "abci_tiers.json"),
                        layer_times=vgg.layer_times).replace(wu_flops_per_param=0.0)
    r = predict(vgg.profile, "f", 2, 32, mach, pairing=False)   # ParaDL's scheme
    assert len(r.options["partitioned_layers"]) == 13
    # filter_vgg_scaling_proj.log: Tcomp 5465.10787204 s (replicated FC/pool/ReLU not divided)
    assert r.per_epoch(vgg.dataset_size)["compute_s"] == pytest.approx(5465.10787204, rel=2e-3)


def test_machine_from_plat_tiers_dict():
    m = io.machine_from_plat({"LATENCY": 1e-6, "BANDWIDTH": 1e9, "NODE_SPEED": 1e12},
                             {"bytes_per_item": 2, "tiers": [{"max_ranks": 4, "alpha": 1e-5,
                                                              "beta": 1e-10}]})
    assert isinstance(m, Machine) and m.bytes_per_item == 2 and m.alpha_beta(3) == (1e-5, 1e-10)
