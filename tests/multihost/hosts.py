#!/usr/bin/env python3
"""Test hosts on one machine: network namespaces on a Linux bridge, each with
its own hostname and an SSH server, for ``horovodrun -H h1:2,h2:2`` runs.

Each host ``hN`` is

- a network namespace ``tfhmh-hN`` joined to the bridge ``tfhmh-br0`` by a
  veth pair; inside, the interface is ``eth0`` with the address
  ``TEST_NETWORK``'s ``.10+N`` (the bridge itself has no address: the test
  hosts reach each other and nothing else);
- its own UTS namespace with the hostname ``hN``;
- ``/etc/hosts`` as Debian, Ubuntu and cloud-init write it: the host's own
  name on ``127.0.1.1``, the other test hosts on their addresses
  (``ip netns exec`` bind-mounts ``/etc/netns/tfhmh-hN/hosts`` over
  ``/etc/hosts`` inside the host's mount namespace);
- an ``sshd`` on port 22 with the server policy the Docker images ship
  (``docker/sshd_config``: keys only, root by key), plus this run's host key
  and ``authorized_keys`` (a throwaway key pair in a temporary directory);
- an ssh client configuration (bind-mounted over ``/etc/ssh/ssh_config``
  inside the host only) that logs in to the test hosts with that key and
  without host-key checks, so ``horovodrun`` (plain ``ssh``) reaches them.

Nothing outside the namespaces changes but the bridge, ``/etc/netns/tfhmh-*``
and ``/run/sshd`` (created if missing); :meth:`TestHosts.down` removes all of
it and ends every process in the hosts' namespaces, and runs on normal exit,
on an exception, on Ctrl-C and on SIGTERM. A later :meth:`TestHosts.up` first
removes what a killed run left behind (every name starts with ``tfhmh``).

The hosts share the machine's file system, so the project's virtual
environment works on each. Commands run *on* a host with :meth:`TestHosts.run`
(``nsenter`` into the host's sshd namespaces: network, hostname, mounts), e.g.
the launcher ``horovodrun`` on ``h1``.

Faults: :meth:`TestHosts.cut` drops all of a host's traffic on ``eth0`` (an
``nft`` table inside the host's namespace), :meth:`TestHosts.restore` lifts it;
:meth:`TestHosts.limit` rate-limits what a host sends (``tc ... tbf``; the
kernel here has no ``netem``), :meth:`TestHosts.unlimit` lifts it;
:meth:`TestHosts.stop_sshd` / :meth:`TestHosts.start_sshd` take a host's SSH
server away and back; :meth:`TestHosts.ssh_client_options` adds ssh client
options (keep-alives) for a while.

In pytest: the session fixture ``hosts`` (tests/multihost/conftest.py) makes
``h1`` and ``h2`` once per session and removes them at the end, asserting
that nothing is left; :func:`jobs.launch` runs ``horovodrun -H h1:k,h2:k
--network-interface eth0`` on ``h1``. What users meet on real clusters (and
what these hosts reproduce) is described in ``python -m tfhybrid.docs
multinode``.

CLI (root)::

    python tests/multihost/hosts.py up 2      # hosts h1, h2 stay up
    python tests/multihost/hosts.py shell h1  # a shell on h1
    python tests/multihost/hosts.py down      # remove everything
"""
from __future__ import annotations

import atexit
import contextlib
import ipaddress
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# The test network: the project's own range for test hosts (never routed anywhere).
TEST_NETWORK = ipaddress.ip_network("10.213.47.0/24")
# Every name of the test hosts starts with this (namespaces, bridge, veths, nft table,
# files); TFHYBRID_TEST_HOSTS_PREFIX gives a second set of hosts beside the first (tests).
PREFIX = os.environ.get("TFHYBRID_TEST_HOSTS_PREFIX", "tfhmh")
BRIDGE = f"{PREFIX}-br0"
IFACE = "eth0"                          # the interface inside every test host
SSHD_POLICY = ROOT / "docker" / "sshd_config"
STATE = Path(tempfile.gettempdir()) / f"{PREFIX}-state.json"
FAULT_TABLE = f"{PREFIX}_fault"


def _sh(*args, check=True, **kw):
    return subprocess.run([str(a) for a in args], check=check, capture_output=True,
                          text=True, **kw)


def sshd_binary():
    return shutil.which("sshd") or next(
        (p for p in ("/usr/sbin/sshd", "/usr/local/sbin/sshd") if os.access(p, os.X_OK)), None)


def unavailable_reason():
    """Why test hosts cannot be made here (one line), or None."""
    if not sys.platform.startswith("linux"):
        return "test hosts need Linux network namespaces"
    if os.geteuid() != 0:
        return "test hosts need root (network namespaces, a bridge, sshd)"
    for tool in ("ip", "unshare", "nsenter", "ssh", "ssh-keygen", "mount"):
        if shutil.which(tool) is None:
            return f"test hosts need `{tool}` (iproute2 / util-linux / openssh-client)"
    if sshd_binary() is None:
        return "test hosts need an sshd binary (apt-get install openssh-server)"
    if not os.path.exists("/etc/ssh/ssh_config"):
        return "test hosts need /etc/ssh/ssh_config (openssh-client)"
    probe = subprocess.run(["unshare", "--net", "--uts", "--mount", "true"], capture_output=True)
    if probe.returncode != 0:
        return ("cannot create network/UTS/mount namespaces here: "
                + probe.stderr.decode(errors="replace").strip())
    return None


def host_address(i):
    """Address of host ``h{i}`` (i >= 1) in :data:`TEST_NETWORK`."""
    return TEST_NETWORK.network_address + 10 + i


def hosts_file(name, names):
    """``/etc/hosts`` of ``name`` as Debian/cloud-init write it: own name on
    127.0.1.1, the other test hosts on their addresses."""
    lines = ["127.0.0.1\tlocalhost", f"127.0.1.1\t{name}"]
    lines += [f"{host_address(i)}\t{other}" for i, other in enumerate(names, 1) if other != name]
    lines += ["::1\tlocalhost ip6-localhost ip6-loopback", "ff02::1\tip6-allnodes",
              "ff02::2\tip6-allrouters"]
    return "\n".join(lines) + "\n"


def _netns_list():
    out = _sh("ip", "netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _kill_netns_processes(ns):
    """End every process in namespace ``ns`` (sshd and the sessions it started)."""
    for sig, pause in ((signal.SIGTERM, 0.5), (signal.SIGKILL, 0.2)):
        pids = [int(p) for p in _sh("ip", "netns", "pids", ns, check=False).stdout.split()]
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.time() + 5
        while time.time() < deadline and _sh("ip", "netns", "pids", ns, check=False).stdout.split():
            time.sleep(pause)


def cleanup(verbose=False):
    """Remove every test host, the bridge and the files of any earlier run
    (everything named ``tfhmh*``). Safe to call when nothing is there."""
    state = {}
    if STATE.exists():
        try:
            state = json.loads(STATE.read_text())
        except ValueError:
            pass
    for ns in _netns_list():
        if ns.startswith(PREFIX + "-"):
            _kill_netns_processes(ns)
            _sh("ip", "netns", "del", ns, check=False)
            if verbose:
                print(f"removed namespace {ns}")
    links = _sh("ip", "-o", "link", "show", check=False).stdout
    for line in links.splitlines():
        name = line.split(":")[1].strip().split("@")[0]
        if name.startswith(PREFIX):
            _sh("ip", "link", "del", name, check=False)
            if verbose:
                print(f"removed link {name}")
    netns_etc = Path("/etc/netns")
    if netns_etc.is_dir():
        for d in netns_etc.glob(f"{PREFIX}-*"):
            shutil.rmtree(d, ignore_errors=True)
        if state.get("created_etc_netns") and not any(netns_etc.iterdir()):
            netns_etc.rmdir()
    if state.get("created_run_sshd") and os.path.isdir("/run/sshd"):
        shutil.rmtree("/run/sshd", ignore_errors=True)
    if state.get("tmp") and os.path.isdir(state["tmp"]):
        shutil.rmtree(state["tmp"], ignore_errors=True)
    STATE.unlink(missing_ok=True)


def leftovers():
    """What of the test hosts exists now (empty after :func:`cleanup`)."""
    out = [f"netns {ns}" for ns in _netns_list() if ns.startswith(PREFIX)]
    for line in _sh("ip", "-o", "link", "show", check=False).stdout.splitlines():
        name = line.split(":")[1].strip().split("@")[0]
        if name.startswith(PREFIX):
            out.append(f"link {name}")
    out += [f"file {p}" for p in Path("/etc/netns").glob(f"{PREFIX}-*")] \
        if Path("/etc/netns").is_dir() else []
    if shutil.which("nft"):
        tables = _sh("nft", "list", "tables", check=False).stdout
        out += [f"nft {t}" for t in tables.splitlines() if PREFIX in t]
    return out


class TestHosts:
    """``n`` test hosts ``h1..hn``; a context manager (``with TestHosts(2) as hosts``).

    Attributes: ``names`` (``['h1', 'h2']``), ``address`` (name -> address),
    ``iface`` (``eth0``), ``tmp`` (the run's key pair, configs and sshd logs).
    """

    __test__ = False   # not a pytest test class

    def __init__(self, n=2):
        if n < 1 or 10 + n >= TEST_NETWORK.num_addresses - 1:
            raise ValueError(f"Received n={n} test hosts; expected 1 to "
                             f"{TEST_NETWORK.num_addresses - 12} in {TEST_NETWORK}.")
        self.names = [f"h{i}" for i in range(1, n + 1)]
        self.address = {name: str(host_address(i)) for i, name in enumerate(self.names, 1)}
        self.iface = IFACE
        self.tmp = None
        self._sshd = {}
        self._old_handlers = {}

    # -- life cycle -------------------------------------------------------------------------

    def __enter__(self):
        try:
            self.up()
        except BaseException:
            self.down()
            raise
        return self

    def __exit__(self, *exc):
        self.down()
        return False

    def up(self, persist=False):
        """Make the hosts; with ``persist`` (the CLI) they outlive this process."""
        reason = unavailable_reason()
        if reason:
            raise RuntimeError(f"cannot make test hosts: {reason}")
        cleanup()
        if not persist:
            atexit.register(self.down)
            for sig in (signal.SIGTERM, signal.SIGHUP):
                self._old_handlers[sig] = signal.signal(sig, self._on_signal)
        state = {"created_etc_netns": not os.path.isdir("/etc/netns"),
                 "created_run_sshd": not os.path.isdir("/run/sshd")}
        self.tmp = Path(tempfile.mkdtemp(prefix=f"{PREFIX}-"))
        state["tmp"] = str(self.tmp)
        STATE.write_text(json.dumps(state))
        os.makedirs("/run/sshd", mode=0o755, exist_ok=True)
        self._keys()
        _sh("ip", "link", "add", BRIDGE, "type", "bridge")
        _sh("ip", "link", "set", BRIDGE, "up")
        for name in self.names:
            self._make_host(name)
        for name in self.names:
            self._sshd[name] = self._start_sshd(name, persist)
        self._wait_for_login()
        if persist:
            state["sshd"] = {n: p.pid for n, p in self._sshd.items()}
            state["names"] = self.names
            STATE.write_text(json.dumps(state))
        return self

    def down(self):
        """Remove the hosts, their processes, the bridge and the run's files."""
        for proc in self._sshd.values():
            if proc.poll() is None:
                proc.terminate()
        cleanup()
        for proc in self._sshd.values():
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
        self._sshd = {}
        for sig, old in self._old_handlers.items():
            signal.signal(sig, old)
        self._old_handlers = {}

    def _on_signal(self, signum, frame):
        self.down()
        raise SystemExit(128 + signum)

    # -- building blocks --------------------------------------------------------------------

    def _keys(self):
        _sh("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "tfhybrid-test-hosts",
            "-f", self.tmp / "id_ed25519")
        _sh("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", self.tmp / "ssh_host_ed25519_key")
        shutil.copy(self.tmp / "id_ed25519.pub", self.tmp / "authorized_keys")
        (self.tmp / "ssh_config").write_text(
            f"Host {' '.join(self.names)} {' '.join(self.address.values())}\n"
            "    User root\n"
            f"    IdentityFile {self.tmp / 'id_ed25519'}\n"
            "    IdentitiesOnly yes\n"
            "    BatchMode yes\n"
            "    StrictHostKeyChecking no\n"
            "    UserKnownHostsFile /dev/null\n"
            "    LogLevel ERROR\n"
            "    ConnectTimeout 10\n")

    def _make_host(self, name):
        ns = f"{PREFIX}-{name}"
        _sh("ip", "netns", "add", ns)
        _sh("ip", "link", "add", ns, "type", "veth", "peer", "name", IFACE, "netns", ns)
        _sh("ip", "link", "set", ns, "master", BRIDGE)
        _sh("ip", "link", "set", ns, "up")
        prefix = TEST_NETWORK.prefixlen
        for cmd in (("addr", "add", f"{self.address[name]}/{prefix}", "dev", IFACE),
                    ("link", "set", IFACE, "up"), ("link", "set", "lo", "up")):
            _sh("ip", "-n", ns, *cmd)
        etc = Path("/etc/netns") / ns
        etc.mkdir(parents=True, exist_ok=True)
        (etc / "hosts").write_text(hosts_file(name, self.names))
        (etc / "hostname").write_text(name + "\n")
        host = self.tmp / name
        host.mkdir()
        # The images' policy first (sshd keeps the first value of a keyword), then
        # what differs per run: where the keys and the pid file are.
        (host / "sshd_config").write_text(
            f"Include {SSHD_POLICY}\n"
            "Port 22\n"
            f"HostKey {self.tmp / 'ssh_host_ed25519_key'}\n"
            f"AuthorizedKeysFile {self.tmp / 'authorized_keys'}\n"
            # the key files live under /tmp (world-writable), which StrictModes refuses
            "StrictModes no\n"
            f"PidFile {host / 'sshd.pid'}\n")
        check = _sh(sshd_binary(), "-t", "-f", host / "sshd_config", check=False)
        if check.returncode != 0:
            raise RuntimeError(f"sshd rejects the configuration of {name}: {check.stderr.strip()}")

    def _start_sshd(self, name, persist):
        ns = f"{PREFIX}-{name}"
        script = (f"hostname {name} && mount --bind {shlex.quote(str(self.tmp / 'ssh_config'))} "
                  f"/etc/ssh/ssh_config && exec {sshd_binary()} -D -e "
                  f"-f {shlex.quote(str(self.tmp / name / 'sshd_config'))}")
        log = open(self.tmp / name / "sshd.log", "w")
        # ip netns exec: network namespace + a mount namespace with /etc/netns/NS over /etc;
        # unshare --uts: the host's own hostname. Both exec, so the pid is sshd's.
        proc = subprocess.Popen(["ip", "netns", "exec", ns, "unshare", "--uts", "sh", "-c", script],
                                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=persist)
        log.close()
        return proc

    def _wait_for_login(self, timeout=20):
        first = self.names[0]
        deadline = time.time() + timeout
        pending = list(self.names)
        while pending:
            for name, proc in self._sshd.items():
                if proc.poll() is not None:
                    raise RuntimeError(f"sshd on {name} exited ({proc.returncode}): "
                                       f"{(self.tmp / name / 'sshd.log').read_text()[-2000:]}")
            name = pending[0]
            out = self.run(first, ["ssh", name, "hostname"], timeout=15)
            if out.returncode == 0 and out.stdout.strip() == name:
                pending.pop(0)
                continue
            if time.time() > deadline:
                raise RuntimeError(f"cannot log in from {first} to {name} by ssh: "
                                   f"{out.stdout}{out.stderr}; sshd log: "
                                   f"{(self.tmp / name / 'sshd.log').read_text()[-2000:]}")
            time.sleep(0.2)

    # -- using the hosts --------------------------------------------------------------------

    def pid(self, name):
        """Pid of the sshd of ``name``: its namespaces are the host."""
        if name in self._sshd:
            return self._sshd[name].pid
        state = json.loads(STATE.read_text())
        return state["sshd"][name]

    def command(self, name, argv):
        """``argv`` wrapped to run on host ``name``."""
        return ["nsenter", "-t", str(self.pid(name)), "-n", "-u", "-m", "--", *map(str, argv)]

    def run(self, name, argv, timeout=60, **kw):
        """Run ``argv`` on host ``name`` (cwd and environment as given); a CompletedProcess."""
        return subprocess.run(self.command(name, argv), capture_output=True, text=True,
                              timeout=timeout, **kw)

    def cut(self, name):
        """Drop all of ``name``'s traffic on its interface (in and out)."""
        if shutil.which("nft") is None:
            raise RuntimeError("cut() needs nft (apt-get install nftables)")
        rules = (f"table inet {FAULT_TABLE} {{\n"
                 f"  chain input {{ type filter hook input priority 0; iifname \"{IFACE}\" drop; }}\n"
                 f"  chain output {{ type filter hook output priority 0; oifname \"{IFACE}\" drop; }}\n"
                 "}\n")
        out = subprocess.run(["ip", "netns", "exec", f"{PREFIX}-{name}", "nft", "-f", "-"],
                             input=rules, capture_output=True, text=True)
        if out.returncode != 0:
            raise RuntimeError(f"nft on {name}: {out.stderr.strip()}")

    def restore(self, name):
        """Lift :meth:`cut` on ``name``."""
        _sh("ip", "netns", "exec", f"{PREFIX}-{name}", "nft", "delete", "table", "inet", FAULT_TABLE,
            check=False)

    def limit(self, name, rate="1mbit"):
        """Limit what ``name`` sends on its interface to ``rate`` (a tbf qdisc;
        this kernel has no netem)."""
        _sh("ip", "netns", "exec", f"{PREFIX}-{name}", "tc", "qdisc", "replace", "dev", IFACE,
            "root", "tbf", "rate", rate, "burst", "32kbit", "latency", "400ms")

    def unlimit(self, name):
        """Lift :meth:`limit` on ``name``."""
        _sh("ip", "netns", "exec", f"{PREFIX}-{name}", "tc", "qdisc", "del", "dev", IFACE, "root",
            check=False)

    @contextlib.contextmanager
    def ssh_client_options(self, **options):
        """Extra ssh client options for the test hosts while the block runs,
        e.g. ``ServerAliveInterval=2`` (``ssh_config`` keywords; the file
        bind-mounted on every host is rewritten in place)."""
        config = self.tmp / "ssh_config"
        before = config.read_text()
        config.write_text(before + "".join(f"    {k} {v}\n" for k, v in options.items()))
        try:
            yield
        finally:
            config.write_text(before)

    def stop_sshd(self, name):
        """End the sshd of ``name`` (the host stays: its network namespace is
        named). Commands cannot run on it until :meth:`start_sshd`."""
        proc = self._sshd.pop(name)
        proc.terminate()
        proc.wait(timeout=10)

    def start_sshd(self, name):
        """Start the sshd of ``name`` again after :meth:`stop_sshd`."""
        self._sshd[name] = self._start_sshd(name, False)
        self._wait_for_login()


def main(argv=None):
    import argparse
    ap = argparse.ArgumentParser(description="Test hosts on this machine (root).")
    sub = ap.add_subparsers(dest="cmd", required=True)
    up = sub.add_parser("up", help="make N hosts h1..hN that stay up until `down`")
    up.add_argument("n", type=int)
    sh = sub.add_parser("shell", help="run a command (default: a shell) on a host")
    sh.add_argument("host")
    sh.add_argument("argv", nargs="*")
    sub.add_parser("down", help="remove every test host and its processes")
    sub.add_parser("status", help="list what exists of the test hosts")
    args = ap.parse_args(argv)
    if args.cmd == "up":
        hosts = TestHosts(args.n)
        try:
            hosts.up(persist=True)
        except BaseException:
            cleanup()
            raise
        for name in hosts.names:
            print(f"{name} {hosts.address[name]} (interface {IFACE}, sshd pid {hosts.pid(name)})")
        print(f"a shell on h1: {sys.argv[0]} shell h1; remove: {sys.argv[0]} down")
        return 0
    if args.cmd == "shell":
        if not STATE.exists():
            print("no test hosts are up (hosts.py up N)", file=sys.stderr)
            return 2
        hosts = TestHosts(len(json.loads(STATE.read_text())["names"]))
        return subprocess.call(hosts.command(args.host, args.argv or [os.environ.get("SHELL", "bash")]))
    if args.cmd == "down":
        cleanup(verbose=True)
        return 0
    print("\n".join(leftovers()) or "no test hosts")
    return 0


if __name__ == "__main__":
    sys.exit(main())
