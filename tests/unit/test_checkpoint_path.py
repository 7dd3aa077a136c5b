"""tfhybrid.callbacks.Checkpoint refuses a path no save could write when it is
made (every rank decides alike from the path and the file system, before any
training), and accepts a directory that does not exist yet (made at the first
save, as Keras' ModelCheckpoint does)."""
import os

import pytest

from tfhybrid.checkpoint import Checkpoint, check_writable


def test_missing_directories_are_accepted_and_made_at_the_first_save(tmp_path):
    path = tmp_path / "runs" / "a" / "e{epoch:03d}-s{step}.keras"
    callback = Checkpoint(path)
    assert not (tmp_path / "runs").exists()          # nothing is written when it is made
    callback._make_directory(str(path).format(epoch=1, step=0))     # one process: no peers
    assert (tmp_path / "runs" / "a").is_dir()
    Checkpoint(tmp_path / "sharded" / "step{step}", sharded=True)


def test_parent_that_is_a_file_is_refused_naming_it(tmp_path):
    blocker = tmp_path / "blocker"
    blocker.write_text("x")
    for path in (blocker / "e{epoch}.keras", blocker / "deeper" / "ckpt" / "last.keras"):
        with pytest.raises(ValueError) as err:
            Checkpoint(path)
        text = str(err.value)
        assert repr(str(path)) in text and f"{str(blocker)!r} is a file, not a directory" in text
        assert "pass a path in a directory you can write to" in text


def test_directory_without_write_permission_is_refused(tmp_path, monkeypatch):
    locked = tmp_path / "locked"
    locked.mkdir()
    real = os.access
    # the suite may run as root, whom no mode bit stops: deny this one directory
    monkeypatch.setattr(os, "access", lambda p, mode, *a, **k: False
                        if os.path.abspath(p) == str(locked) else real(p, mode, *a, **k))
    with pytest.raises(ValueError, match=r"no write permission in directory .*locked.* "
                                         r"\(to write into it\).*chmod u\+w"):
        Checkpoint(locked / "last.keras")
    with pytest.raises(ValueError, match=r"no write permission in directory .*locked.* "
                                         r"\(to create .*locked/new.* in it\)"):
        Checkpoint(locked / "new" / "e{epoch}.keras")
    with pytest.raises(ValueError, match="no write permission"):
        Checkpoint(locked / "parts", sharded=True)


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes whatever the mode bits say")
def test_read_only_directory_is_refused(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        with pytest.raises(ValueError, match="no write permission"):
            Checkpoint(locked / "ckpt" / "last.keras")
    finally:
        locked.chmod(0o700)


def test_path_of_the_wrong_kind_is_refused(tmp_path):
    (tmp_path / "taken.keras").mkdir()
    with pytest.raises(ValueError, match=r"taken\.keras' is a directory; pass a file name"):
        Checkpoint(tmp_path / "taken.keras")
    (tmp_path / "parts").write_text("x")
    with pytest.raises(ValueError, match=r"parts' is a file and a sharded checkpoint is a "
                                         "directory"):
        Checkpoint(tmp_path / "parts", sharded=True)


def test_template_fields_other_than_epoch_and_step_are_refused(tmp_path):
    with pytest.raises(ValueError, match=r"cannot be formatted \(KeyError: 'batch'\).*"
                                         r"\{epoch\} and \{step\}"):
        Checkpoint(tmp_path / "e{epoch}-b{batch}.keras")
    with pytest.raises(ValueError, match="cannot be formatted"):
        check_writable(str(tmp_path / "e{epoch:q}.keras"))
    check_writable(str(tmp_path / "{{literal}}-e{epoch:03d}.keras"))
