"""tfhybrid.save / tfhybrid.load: checkpoint under one strategy and world size,
resume under others, compare with one uninterrupted single-process run.

Each chain trains 3 steps, saves, and resumes for 3 more steps on another
world size / strategy; the resumed run's gathered weights and optimizer
slots must equal plain Keras training of all 6 steps on the same global
batches (1e-4 relative), with the same iteration count.
"""
import subprocess
import sys

from userscripts import launch, results

TOL = 1e-4


def _train(tmp_path, np_, strategy, mp, optimizer, *extra):
    ckpt = tmp_path / "ckpt.keras"
    run = launch("resume.py", np=np_, args=["--phase", "train", "--strategy", strategy,
                                            "--model-parallel", mp, "--steps", 3,
                                            "--ckpt", ckpt, "--optimizer", optimizer, *extra])
    assert run.rc == 0, run
    assert ckpt.exists() and (tmp_path / "ckpt.keras.state.npz").exists(), run
    return ckpt


def _resume(ckpt, np_, strategy, mp, optimizer):
    run = launch("resume.py", np=np_, args=["--phase", "resume", "--strategy", strategy,
                                            "--model-parallel", mp, "--steps", 3, "--before", 3,
                                            "--ckpt", ckpt, "--optimizer", optimizer])
    assert run.rc == 0, run
    rows = results(run)
    assert len(rows) == np_, run
    for row in rows:
        assert row["iterations"] == row["ref_iterations"] == 6, row
        assert row["slot_names"], row            # the slots were found and compared
        assert row["weights_rel"] < TOL, row
        assert row["slots_rel"] < TOL, row


def test_adam_df_at_4_resumes_as_d_at_2(tmp_path):
    ckpt = _train(tmp_path, 4, "df", 2, "adam", "--via-callback")   # Checkpoint(every_n_steps=3)
    _resume(ckpt, 2, "d", 1, "adam")


def test_sgd_momentum_s_at_2_resumes_as_gmp_at_4_and_alone(tmp_path):
    ckpt = _train(tmp_path, 2, "s", 2, "sgd")
    _resume(ckpt, 4, "gmp", 2, "sgd")
    _resume(ckpt, 1, "d", 1, "sgd")


def test_sharded_redundant_checkpoint_survives_a_lost_rank_file(tmp_path):
    """Large-model mode: per-rank files + manifest; with redundant=True the
    neighbour's copy replaces a deleted rank file (Stanza §5.3). Resumed on
    the same grid (read rank by rank), on 1 rank (consolidated in memory),
    and consolidated offline to a single file."""
    ckpt = tmp_path / "sharded"
    run = launch("resume.py", np=2, args=["--phase", "train", "--strategy", "f",
                                          "--model-parallel", 2, "--steps", 3, "--ckpt", ckpt,
                                          "--sharded", "--redundant", "--via-callback"])
    assert run.rc == 0, run
    names = sorted(p.name for p in ckpt.iterdir())
    assert names == ["manifest.json", "rank-00000.copy.npz", "rank-00000.npz",
                     "rank-00001.copy.npz", "rank-00001.npz"], names
    (ckpt / "rank-00001.npz").unlink()                  # one rank's disk is gone
    _resume(ckpt, 2, "f", 2, "adam")
    _resume(ckpt, 1, "d", 1, "adam")
    single = tmp_path / "consolidated.keras"
    proc = subprocess.run([sys.executable, "-c", "import sys, tfhybrid.checkpoint as c; "
                           "c.consolidate(sys.argv[1], sys.argv[2])", str(ckpt), str(single)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    _resume(single, 1, "d", 1, "adam")                  # offline consolidation, plain file
    (ckpt / "rank-00001.copy.npz").unlink()             # both copies gone: a clear error
    run = launch("resume.py", np=1, args=["--phase", "resume", "--strategy", "d", "--steps", 3,
                                          "--before", 3, "--ckpt", ckpt])
    assert run.rc != 0 and "No readable file for rank 1" in run.out, run


def test_dropout_seed_states_survive_save_and_load(tmp_path):
    """Each rank's dropout stream (Keras SeedGenerator state) is saved and restored."""
    run = launch("resume.py", np=2, args=["--phase", "rng", "--strategy", "d", "--steps", 3,
                                          "--ckpt", tmp_path / "rng.keras"])
    assert run.rc == 0, run
    rows = results(run)
    assert len(rows) == 2, run
    for row in rows:
        assert row["before"] and row["after"] == row["before"], row
        assert row["global_seed"] is not None, row
    assert rows[0]["before"] != rows[1]["before"]     # replicas keep their own streams
