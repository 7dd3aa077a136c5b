"""Every example in examples/ runs 1-2 steps at -np 2 with synthetic data
and tiny sizes (flags), prints the oracle's plan for its shape before
training and its result table, and exits 0."""
import pytest

from userscripts import ROOT, launch

TINY = ["--batch_size=8", "--steps=1", "--warmup_steps=1"]
CASES = {
    "splitbrain_vgg.py": (["--width=0.125"], "SplitBrain Table 2 in miniature",
                          ["DP 2 x MP 1", "DP 1 x MP 2"]),
    "resnet50_df.py": (["--image_size=32", "--run_eagerly", "--batch_size=4"],
                       "ResNet-50 df on 2 ranks",
                       ["the parameter counts above are global rank 0's"]),
    "lee_replicated_fc.py": (["--fc_units=64", "--conv_filters=8"],
                             "largest weight difference between the two runs",
                             ["replicated (F=2)", "all-gather"]),
    "gholami_integrated.py": (["--image_size=16", "--fc_units=32", "--filters=4"],
                              "integrated parallelism on 2 ranks",
                              ["ds+layers", "filter (split out)", "channel (split in)"]),
    "cosmoflow.py": (["--volume_size=16", "--filters=2", "--run_eagerly", "--batch_size=4"],
                     "CosmoFlow-like regression on 2 ranks", ["4x8x16x16x4", "spatial"]),
    "unet3d.py": (["--volume_size=16", "--filters=2", "--run_eagerly", "--batch_size=2"],
                  "3-D U-Net segmentation on 2 ranks", ["2x8x16x16x1", "2x8x16x16 ", "up0"]),
}


@pytest.mark.parametrize("script", sorted(CASES))
def test_example_runs_at_2_ranks(script):
    args, final, also = CASES[script]
    run = launch(ROOT / "examples" / script, np=2, args=TINY + args, timeout=300)
    assert run.rc == 0, run
    assert "Traceback" not in run.out, run
    plan = run.out.find("== tfhybrid plan:")
    assert plan >= 0 and "strategy  ok" in run.out, run
    assert plan < run.out.find(final), run          # the plan comes before the results
    for text in also:
        assert text in run.out, (text, run)
