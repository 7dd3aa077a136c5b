"""`tfhybrid plan` end to end through the venv's console script (subprocess)."""
import json
import os
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXE = os.path.join(ROOT, ".venv", "bin", "tfhybrid")
MACHINE = os.path.join(ROOT, "tfhybrid", "oracle", "machines", "cpu_box.json")
PARADL = "/work/shared/paradl"
ENV = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", CUDA_VISIBLE_DEVICES="")


def _run(*args, timeout=120):
    return subprocess.run([EXE, *args], capture_output=True, text=True, timeout=timeout,
                          env=ENV, cwd=ROOT)


def test_plan_vgg16_table_json_png(tmp_path):
    out, png = tmp_path / "out.json", tmp_path / "out.png"
    proc = _run("plan", "vgg16", "--np", "8", "--batch", "64", "--machine", MACHINE,
                "--json", str(out), "--png", str(png))
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("vgg16: p=8, B=64")
    table = "\n".join(lines)
    for name in ("serial", " d ", " f ", " c ", " s ", " p ", "df", "ds", "gmp", "ls"):
        assert name in table
    doc = json.loads(out.read_text())
    preds = doc["predictions"]
    assert len(preds) == 10 and doc["meta"]["p"] == 8 and doc["meta"]["batch"] == 64
    assert [p["rank"] for p in preds] == list(range(1, 11))
    assert all(p["reasons"] for p in preds if not p["feasible"])   # limits are explained
    feasible = [p for p in preds if p["feasible"]]
    assert feasible and all(p["total_s"] > 0 for p in feasible)
    assert set(preds[0]["comm_s"]) == {"FB-allgather", "FB-allreduce", "halo", "GE-allreduce",
                                       "p2p"}
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_plan_without_machine_uses_the_shipped_cluster_and_says_so():
    proc = _run("plan", "vgg16", "--np", "64", "--batch", "2048")
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    assert "no --machine: using" in lines[0] and "abci_v100.json" in lines[0]
    assert lines[1].startswith("vgg16: p=64, B=2048, machine: ParaDL ABCI platform")
    ranked = [ln.split()[1] for ln in lines[4:14]]
    assert set(ranked) == {"serial", "d", "f", "c", "s", "p", "df", "ds", "gmp", "ls"}
    assert "yes" in lines[4]   # the first-ranked strategy is feasible


@pytest.mark.skipif(not os.path.isdir(PARADL), reason="ParaDL data not present")
def test_plan_paradl_files(tmp_path):
    out = tmp_path / "p.json"
    proc = _run("plan", "--paradl-net", f"{PARADL}/model/VGG_ImageNet_profall.net_sc",
                "--paradl-lc", f"{PARADL}/model/filter_vgg.lc",
                "--paradl-plat", f"{PARADL}/ABCI.plat",
                "--paradl-tiers", f"{PARADL}/abci_tiers.json",
                "--np", "4", "--batch", "128", "--strategies", "serial,d,f,df",
                "--dataset-size", "1280000", "--json", str(out))
    assert proc.returncode == 0, proc.stderr[-2000:]
    preds = {p["strategy"]: p for p in json.loads(out.read_text())["predictions"]}
    assert set(preds) == {"serial", "d", "f", "df"}
    assert preds["f"]["options"]["partitioned_layers"][0] == "CONV1_1"
    assert preds["d"]["per_epoch"]["iterations"] == 10000
