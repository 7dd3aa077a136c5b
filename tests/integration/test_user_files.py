"""Callbacks that write files, as users write scripts.

``tests/user_scripts/checkpoint_new_dir.py`` trains under horovodrun with
``tfhybrid.callbacks.Checkpoint("<tmp>/newdir/e{epoch:03d}.keras")`` into a
directory that does not exist, then a plain Keras process (no horovodrun, no
tfhybrid) loads the last checkpoint: its ``evaluate`` equals the parallel
run's, and its weights equal plain Keras training of the same model. A path
that cannot be written stops every rank before training.
"""
from userscripts import launch, results

TOL = 1e-5


def test_checkpoint_makes_its_directory_loads_alone_and_refuses_unwritable_paths(tmp_path):
    newdir = tmp_path / "newdir"
    ok = launch("checkpoint_new_dir.py", np=2,
                args=["--phase", "train", "--ckpt", newdir / "e{epoch:03d}.keras"])
    assert ok.rc == 0, ok
    rows = results(ok)
    assert len(rows) == 2 and ok.out.count("TRAINED A STEP") == 2 * 2 * 4, ok
    for row in rows:
        assert row["files"] == ["e001.keras", "e001.keras.state.npz",
                                "e002.keras", "e002.keras.state.npz"], row
    parallel = rows[0]["evaluate"]
    assert rows[1]["evaluate"] == parallel, rows

    plain = launch("checkpoint_new_dir.py", np=1,
                   args=["--phase", "load", "--ckpt", newdir / "e002.keras"])
    assert plain.rc == 0, plain
    [row] = results(plain)
    assert not row["tfhybrid_imported"], row
    assert row["weights_rel"] < TOL, row
    for name in ("loss", "accuracy"):
        tol = TOL * max(1.0, abs(parallel[name]))
        assert abs(row["evaluate"][name] - parallel[name]) <= tol, (name, row, parallel)
        assert abs(row["plain_evaluate"][name] - parallel[name]) <= tol, (name, row, parallel)

    # The same script with a checkpoint path whose parent is a file: every rank
    # refuses the path when the callback is made, and the job exits non-zero
    # without a step.
    blocker = tmp_path / "blocker"
    blocker.write_text("a file, not a directory\n")
    run = launch("checkpoint_new_dir.py", np=2, timeout=240,
                 args=["--phase", "train", "--ckpt", blocker / "newdir" / "e{epoch:03d}.keras"])
    assert run.rc not in (0, "timeout"), run
    message = f"cannot be written: {str(blocker)!r} is a file, not a directory"
    for rank in (0, 1):
        assert any(line.startswith(f"[{rank}]") and message in line
                   for line in run.out.splitlines()), run
    assert "TRAINED A STEP" not in run.out and not results(run), run
    assert not (blocker / "newdir").exists() and not (tmp_path / "e001.keras").exists()
    # start-up, the check, exit: no wait for a collective, for the watchdog's
    # bound (100 s) or the exit barrier's (300 s). Compared with the run that
    # trained (same start-up on the same shared box), with 30 s for its noise.
    assert run.seconds < ok.seconds + 30, (run, ok.seconds)
