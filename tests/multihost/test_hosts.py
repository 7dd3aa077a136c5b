"""The test hosts themselves (tests/multihost/hosts.py): names, hosts files,
the images' sshd policy, key login, a cut link, and nothing left behind after
Ctrl-C or SIGTERM."""
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from hosts import SSHD_POLICY, sshd_binary

HERE = Path(__file__).resolve().parent


def test_hostnames_and_debian_hosts_files(hosts):
    out = hosts.run("h1", ["sh", "-c", "hostname; getent hosts h1 h2; "
                           "ssh h2 'hostname; getent hosts h2 h1'"])
    assert out.returncode == 0, out.stderr
    lines = [ln.split() for ln in out.stdout.splitlines()]
    assert lines == [["h1"], ["127.0.1.1", "h1"], [hosts.address["h2"], "h2"],
                     ["h2"], ["127.0.1.1", "h2"], [hosts.address["h1"], "h1"]], out.stdout
    # the machine's own name and hosts file are untouched
    assert os.uname().nodename not in hosts.names
    assert "h1" not in Path("/etc/hosts").read_text().split()


def test_sshd_runs_the_images_policy(hosts):
    effective = subprocess.run([sshd_binary(), "-T", "-f", str(hosts.tmp / "h1" / "sshd_config")],
                               capture_output=True, text=True, timeout=30)
    assert effective.returncode == 0, effective.stderr
    settings = dict(line.split(" ", 1) for line in effective.stdout.splitlines() if " " in line)
    alias = {"prohibit-password": "without-password"}   # sshd -T prints the older name
    for line in SSHD_POLICY.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            key, value = line.lower().split(None, 1)
            assert settings.get(key) in (value, alias.get(value)), (line, settings.get(key))
    # a password login is refused outright (keys only)
    out = hosts.run("h1", ["ssh", "-o", "PreferredAuthentications=password,keyboard-interactive",
                           "h2", "true"])
    assert out.returncode != 0


def test_cut_and_restore(hosts):
    probe = ["ssh", "-o", "ConnectTimeout=2", "h2", "true"]
    hosts.cut("h2")
    try:
        assert hosts.run("h1", probe).returncode != 0
    finally:
        hosts.restore("h2")
    assert hosts.run("h1", probe).returncode == 0


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_nothing_left_after_interrupt(sig, hosts):
    """A second set of hosts (its own name prefix, beside the session's) in a
    child process that is interrupted while the hosts are up."""
    env = dict(os.environ, TFHYBRID_TEST_HOSTS_PREFIX="tfhmt", PYTHONPATH=str(HERE))
    # a suite started in the background (``cmd &`` in a script) inherits SIGINT
    # ignored, and Python then leaves it so: the child takes Ctrl-C's default back
    code = ("import signal, time, hosts\n"
            "signal.signal(signal.SIGINT, signal.default_int_handler)\n"
            "with hosts.TestHosts(1) as h:\n"
            "    h.run('h1', ['sh', '-c', 'sleep 3217 >/dev/null 2>&1 &'])\n"   # a process in the host to end
            "    print('up', flush=True)\n"
            "    time.sleep(120)\n")
    child = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
    try:
        assert child.stdout.readline().strip() == "up"
        child.send_signal(sig)
        child.wait(timeout=60)
    finally:
        if child.poll() is None:
            child.kill()
    left = subprocess.run([sys.executable, str(HERE / "hosts.py"), "status"], env=env,
                          capture_output=True, text=True, timeout=60).stdout.strip()
    assert left == "no test hosts", left
    assert not subprocess.run(["pgrep", "-f", "sleep 3217"], capture_output=True).stdout
