"""Predict ParaDL's own logged cases with tfhybrid's oracle and explain the differences.

Reads ParaDL's model, layer-configuration and platform files and the SUMMARY
tables of its projection logs (``/work/shared/paradl``), predicts every case
with :mod:`tfhybrid.oracle` (our formulas, ABCI's platform and per-tier
alpha/beta), and writes ``docs/paradl_comparison.md`` and
``bench/results/paradl_compare.json``.

Two predictions per case:

* **ours**: tfhybrid's model as shipped (paper formulas, Table 3 / Appendix A).
* **ours, tool conventions**: the same model with the conventions we found in
  ParaDL's code output (bandwidth terms doubled, contention on the Data+Filter
  allreduce, ReLU outputs not stored); the residual ratio shows what is left.

Usage:
    .venv/bin/python bench/paradl_compare.py [--paradl DIR] [--out docs/paradl_comparison.md]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from tfhybrid.oracle import predict
from tfhybrid.oracle.machine import Tier
from tfhybrid.oracle.paradl_io import (apply_lc, parse_summary, read_lc, read_net,
                                       read_plat)

MODELS = {"vgg": "VGG_ImageNet_profall.net_sc", "alexnet": "ALEXNET_ImageNet_profall.net_sc",
          "resnet": "RESNET50_ImageNet_profall.net_sc"}
LOGS = [  # (log file, model, layer configuration or None)
    ("log/data_vgg_scaling_proj.log", "vgg", None),
    ("log/data_alexnet_scaling_proj.log", "alexnet", None),
    ("log/data_resnet_scaling_proj.log", "resnet", None),
    ("log/filter_vgg_scaling_proj.log", "vgg", "filter_vgg.lc"),
    ("log/filter_alexnet_scaling_proj.log", "alexnet", "filter_alexnet.lc"),
    ("log/filter_resnet_scaling_proj.log", "resnet", "filter_resnet.lc"),
    ("log/channel_vgg_scaling_proj.log", "vgg", "filter_vgg.lc"),
    ("log/channel_alexnet_scaling_proj.log", "alexnet", "filter_alexnet.lc"),
    ("log/channel_resnet_scaling_proj.log", "resnet", "channel_resnet.lc"),
    ("log/ranking_log/vgg/df.log", "vgg", "filter_vgg.lc"),
    ("log/ranking_log/vgg/ds.log", "vgg", "spatial_vgg.lc"),
]
NAMES = {"single": "serial", "data": "d", "filter3": "f", "chan3": "c", "df": "df", "ds": "ds"}
GPU_PER_NODE = 4


def _options(strategy, p):
    if strategy == "f":
        return {"pairing": False}          # ParaDL's per-layer scheme
    if strategy == "df":
        return {"grid": (p // GPU_PER_NODE, GPU_PER_NODE), "pairing": False}
    if strategy == "ds":
        return {"spatial": (GPU_PER_NODE, 1)}
    return {}


def _tool_machine(machine, strategy):
    """ParaDL tool conventions: every bandwidth term x2; Data+Filter data allreduce
    beta = 6.4e-10 = 16 x the tier's 4e-11 (x2 doubling, phi = 8)."""
    tiers = tuple(Tier(t.max_ranks, t.alpha, 2 * t.beta) for t in machine.tiers)
    return machine.replace(beta=2 * machine.beta, tiers=tiers,
                           phi=8.0 if strategy == "df" else 1.0)


def _in_place(row):
    return row.name.upper().startswith(("RELU", "BN"))


def _no_relu(model):
    """The profile without ReLU and batch-norm rows (the tool stores no outputs for them)."""
    rows = tuple(r for r in model.profile.rows if not _in_place(r))
    split = None
    if model.profile.split is not None:
        split = tuple(s for r, s in zip(model.profile.rows, model.profile.split)
                      if not _in_place(r))
    return dataclasses.replace(model.profile, rows=rows, split=split)


def _case(model, machine, row, strategy):
    opts = _options(strategy, row["p"])
    pred = predict(model.profile, strategy, row["p"], row["B"], machine, **opts)
    tool_m = _tool_machine(machine, strategy)
    tool = predict(model.profile, strategy, row["p"], row["B"], tool_m, **opts)
    tool_mem = pred if strategy == "ds" else predict(
        _no_relu(model), strategy, row["p"], row["B"], tool_m, **opts)
    ep = pred.per_epoch(model.dataset_size)
    # the tool counts ceil(D/B) iterations per epoch (the paper: D/B)
    tep = tool.per_epoch(math.ceil(model.dataset_size / row["B"]) * row["B"])
    return {"strategy": strategy, "B": row["B"], "p": row["p"],
            "paradl": {k: row[k] for k in ("tcomp", "tcomm", "mem")},
            "ours": {"tcomp": ep["compute_s"], "tcomm": ep["comm_total_s"],
                     "mem": pred.memory_bytes, "comm_by_phase": ep["comm_s"],
                     "options": {k: v for k, v in pred.options.items()
                                 if k in ("grid", "segments")}},
            "tool": {"tcomp": tep["compute_s"], "tcomm": tep["comm_total_s"],
                     "mem": tool_mem.memory_bytes}}


def run(paradl_dir):
    cases = []
    for log, model_key, lc in LOGS:
        path = os.path.join(paradl_dir, log)
        if not os.path.exists(path):
            print(f"skip {log}: not found")
            continue
        model = read_net(os.path.join(paradl_dir, "model", MODELS[model_key]))
        if lc:
            model = apply_lc(model, read_lc(os.path.join(paradl_dir, "model", lc)))
        machine = read_plat(os.path.join(paradl_dir, "ABCI.plat"),
                            os.path.join(paradl_dir, "abci_tiers.json"),
                            layer_times=model.layer_times)
        for row in parse_summary(open(path, encoding="utf-8").read()):
            strategy = NAMES.get(row["name"])
            if strategy is None:
                continue
            case = _case(model, machine, row, strategy)
            case.update(model=model_key, log=log)
            cases.append(case)
    return cases


def _ratio(a, b):
    return a / b if b else (1.0 if a == b else float("inf"))


def _fmt(v):
    return f"{v:.4g}"


def table(cases):
    head = ("| model | strategy | B | p | ParaDL Tcomp (s) | ours | ratio | ParaDL Tcomm (s) | "
            "ours | ratio | ratio, tool conv. | ParaDL mem (GB) | ours | ratio | "
            "ratio, tool conv. |")
    lines = [head, "|" + "---|" * 15]
    for c in cases:
        P, O, T = c["paradl"], c["ours"], c["tool"]
        lines.append("| " + " | ".join([
            c["model"], c["strategy"], str(c["B"]), str(c["p"]), _fmt(P["tcomp"]),
            _fmt(O["tcomp"]), f"{_ratio(O['tcomp'], P['tcomp']):.3f}", _fmt(P["tcomm"]),
            _fmt(O["tcomm"]), f"{_ratio(O['tcomm'], P['tcomm']):.3f}",
            f"{_ratio(T['tcomm'], P['tcomm']):.3f}", _fmt(P["mem"] / 1e9),
            _fmt(O["mem"] / 1e9), f"{_ratio(O['mem'], P['mem']):.3f}",
            f"{_ratio(T['mem'], P['mem']):.3f}"]) + " |")
    return "\n".join(lines)


def summary(cases):
    out = ["| strategy | cases | median Tcomp ratio | median Tcomm ratio | median Tcomm ratio, "
           "tool conv. | median mem ratio | median mem ratio, tool conv. |", "|---|" * 1 + "---|" * 6]
    for s in ("serial", "d", "f", "c", "df", "ds"):
        cs = [c for c in cases if c["strategy"] == s]
        if not cs:
            continue
        med = [statistics.median(_ratio(c[k][m], c["paradl"][m]) for c in cs)
               for k, m in (("ours", "tcomp"), ("ours", "tcomm"), ("tool", "tcomm"),
                            ("ours", "mem"), ("tool", "mem"))]
        out.append(f"| {s} | {len(cs)} | " + " | ".join(f"{v:.3f}" for v in med) + " |")
    return "\n".join(out)


EXPLANATION = """## Systematic differences, and why

**1. Computation (Tcomp): matches.** We spread the measured per-sample time of
the `_profall.net_sc` files over the layers with the same operation weights as
ParaDL's tool (2 x MACs for conv, 1.5 x MACs for FC, |y| x C x K^2 for pooling,
|y| for ReLU, 0 for dropout; reverse-engineered from its per-layer log tables),
so serial, d, f, c and df agree within 0.5% (layers the `.lc` file keeps
replicated are not divided by p, as in the tool). ResNet-50 f/c are 5% lower:
its batch-norm and add layers carry weights we could not reverse-engineer.
ds is 9% higher: our ds gathers the activations before the first Dense layer
and runs the FC layers replicated in each spatial group on B/p_data samples
(DESIGN.md), and charges ceil(H/ph) rows when the split is uneven; the tool
divides every configured layer by p.

**2. Data-parallel Tcomm: the tool doubles the bandwidth term.** Paper Eq. 6 is
2(D/B)(p-1)(alpha + delta|W|beta/p); the tool's output equals
2 ceil(D/B)(p-1)(alpha + 2 delta|W|beta/p) (its per-p log lines print the
(p-1)alpha and (p-1)delta|W|beta/p terms; the SUMMARY is 2x latency + 4x
bandwidth). We implement the paper (ratio ~0.5, rising to 0.75 at p = 2048
where latency dominates). With beta doubled and ceil(D/B) iterations, all 33
data cases agree to 1.000 (the 'tool conv.' column).

**3. Filter/channel Tcomm.** Fitting the tool's six p values gives exactly
3 (D/B)(p-1) sum_{l in .lc} (alpha + 2 B|y_l| delta beta / p): three collectives
of |y_l| on every configured layer, bandwidth again doubled (Eq. 15/19 assume
|x_{l+1}| = |y_l|). We charge the collectives tfhybrid actually issues: f
allgathers y_l forward (not after the model's last layer) and allreduces
dL/dx_l backward with the *actual* |x_l| (four times smaller than |y_{l-1}|
after each 2x2 pooling) and not for the first layer (the input needs no
gradient); c does the converse (allreduce y_l forward, allgather dL/dx_l
backward). With the tool's beta the residual is 0.78 (VGG f), 0.89 (VGG c),
0.59-0.61 (AlexNet, whose overlapping 3x3/2 pools and 11x11/4 first layer
make |x_l| much smaller than |y_{l-1}|), 0.96-0.98 (ResNet-50, few poolings).
These rows use ParaDL's per-layer scheme (`pairing=False`); tfhybrid's own
default pairs a filter layer with the next weighted layer (channel-parallel,
one allreduce per pair, DESIGN.md), which the oracle predicts by default.

**4. Data+Filter Tcomm.** The tool's df log prints the data allreduce with
beta = 6.4e-10 s/B = 16 x the tier's 4e-11 and alpha = 4.031e-5 (tier + 1e-5):
bandwidth doubling (x2) and a contention penalty of 8 on the inter-node link
(four disjoint allreduces per node, each doubled). Our default machine has
phi = 1 (the paper used phi = 2 for Fig. 3); with phi = 8 and doubled beta the
residual is 0.92, the filter-part difference of point 3. Grid: the tool puts
the filter group inside a node (p_model = 4), so we pass grid = (p/4, 4).

**5. Data+Spatial Tcomm: the tool prices point-to-point on a slower path.**
Its ds log shows the halo exchanges, the spatial allgather and an all-to-all
scatter of the samples priced with MPI without GPUDirect: alpha = 3.00011e-3 s
and beta = 5e-10 s/B (300x the NCCL tier's latency), and pooling layers are
charged 2 alpha of halo even with 0 bytes. Our machine prices every collective
with the same tiers (calibration measures the path tfhybrid really uses), the
first layer exchanges no backward halo (the input needs no gradient, as
tfhybrid's SpatialConv), and a data group whose ranks sit in one node is priced
with its own size's tier rather than its span's, so our ds Tcomm is 6-140x
lower (most at small batches, where latency dominates). To reproduce the tool, give the machine a tier
with that alpha/beta; we did not add a separate p2p network to the model.

**6. Memory: the tool does not store ReLU and batch-norm outputs.** Ours
counts 2B(|x_l| + |y_l|) for every layer (Keras keeps ReLU, pooling, dropout
and batch-norm outputs as separate tensors), so ours is 1.7-2.2x higher.
Dropping ReLU and BN rows reproduces the tool exactly for serial, d and df
(VGG, AlexNet, ResNet-50: 1.000). Filter/channel remain 1.00-1.15 higher: the tool divides the weights of *every* layer by p,
including the FC layers its `.lc` keeps replicated; we keep replicated weights
whole. For ds we report our own memory (the tool's ds memory already matches
ours within 0.2%).

**7. Not compared.** `filter1`/`chan1` rows (a tool variant without batch
splitting), pipeline (no logged projection), CosmoFlow and the ResNet ranking
logs (their SUMMARY format differs).
"""


def write_markdown(cases, out):
    text = ["# tfhybrid oracle vs ParaDL's own projections", "",
            "Generated by `bench/paradl_compare.py` from ParaDL's data in `shared/paradl/` "
            "(ABCI platform, per-tier alpha/beta of `abci_tiers.json`, measured per-sample "
            "times of the `_profall.net_sc` models, the layer configurations of the `.lc` "
            "files). Times are per epoch of ImageNet (D = 1.28M samples), memory per GPU. "
            "Ratios are ours / ParaDL. 'tool conv.' re-runs our model with the conventions "
            "we found in ParaDL's code output (see below), so the residual shows what is left.",
            "", "## Summary", "", summary(cases), "", EXPLANATION, "", "## All cases", "",
            table(cases), ""]
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out, "w", encoding="utf-8") as fh:
        fh.write("\n".join(text))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--paradl", default="/work/shared/paradl")
    ap.add_argument("--out", default="docs/paradl_comparison.md")
    ap.add_argument("--json", default="bench/results/paradl_compare.json")
    args = ap.parse_args(argv)
    cases = run(args.paradl)
    write_markdown(cases, args.out)
    os.makedirs(os.path.dirname(args.json), exist_ok=True)
    with open(args.json, "w", encoding="utf-8") as fh:
        json.dump(cases, fh, indent=1, default=str)
    print(summary(cases))
    print(f"wrote {args.out} and {args.json} ({len(cases)} cases)")


if __name__ == "__main__":
    main()
