"""The exit barrier never holds a failing rank."""
import sys

import pytest

from tfhybrid import exit_barrier


@pytest.fixture
def fresh(monkeypatch):
    """install() on a clean state; sys.exit / sys.excepthook restored afterwards."""
    monkeypatch.setattr(sys, "exit", sys.exit)
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)
    monkeypatch.setattr(exit_barrier, "_STATE", {"installed": False, "failed": False})
    monkeypatch.setattr(exit_barrier.atexit, "register", lambda fn: None)
    exit_barrier.install()
    return exit_barrier._STATE


def test_nonzero_sys_exit_skips_the_barrier(fresh):
    with pytest.raises(SystemExit):
        sys.exit(0)
    assert not fresh["failed"]
    with pytest.raises(SystemExit):
        sys.exit("fatal: bad input")
    assert fresh["failed"]


def test_uncaught_exception_skips_the_barrier(fresh, capsys):
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        sys.excepthook(*sys.exc_info())
    assert fresh["failed"]
    assert "boom" in capsys.readouterr().err          # the previous hook still prints


def test_bound_from_environment(monkeypatch):
    monkeypatch.delenv(exit_barrier.ENV_VAR, raising=False)
    assert exit_barrier.bound_seconds() == exit_barrier.DEFAULT_SECONDS
    monkeypatch.setenv(exit_barrier.ENV_VAR, "0")
    assert exit_barrier.bound_seconds() == 0
    for bad in ("-1", "soon", "nan"):
        monkeypatch.setenv(exit_barrier.ENV_VAR, bad)
        with pytest.raises(ValueError, match=exit_barrier.ENV_VAR):
            exit_barrier.bound_seconds()
