"""tfhybrid.load resumes at the saved data position.

A checkpoint written by ``tfhybrid.callbacks.Checkpoint(every_n_steps=3)``
in the middle of an epoch holds (epoch 0, step 3). Loading it under another
strategy and calling ``fit`` on the whole dataset for 2 epochs (no
``initial_epoch``, no ``skip``) must train the rest of epoch 0 and epoch 1
whole: 8 steps in all, weights and Adam slots equal to one uninterrupted
single-process run of 2 epochs (1e-4 relative), and the resumed run's own
checkpoints named by their position in the epoch.
"""
from userscripts import launch, results

TOL = 1e-4


def test_mid_epoch_checkpoint_resumes_at_its_step_under_another_strategy(tmp_path):
    ckpt = tmp_path / "mid.keras"
    run = launch("resume_position.py", np=2, args=["--phase", "train", "--strategy", "f",
                                                   "--model-parallel", 2, "--ckpt", ckpt])
    assert run.rc == 0, run
    meta = results(run)[0]["meta"]
    assert (meta["epoch"], meta["step"], meta["iterations"]) == (0, 3, 3), meta
    run = launch("resume_position.py", np=2, args=["--phase", "resume", "--strategy", "d",
                                                   "--ckpt", ckpt])
    assert run.rc == 0, run
    rows = results(run)
    assert len(rows) == 2, run
    for row in rows:
        assert row["iterations"] == row["ref_iterations"] == 8, row
        assert row["history_epochs"] == [0, 1] and row["losses"] == 2, row
        assert row["slot_names"] and row["slots_rel"] < TOL, row
        assert row["weights_rel"] < TOL, row
        # step 4 of epoch 0 is the first resumed batch (+3 skipped), then 2 and 4 of epoch 1
        assert row["saved"] == ["r-e0-s4.keras", "r-e1-s2.keras", "r-e1-s4.keras"], row
