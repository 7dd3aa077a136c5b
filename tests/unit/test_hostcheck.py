"""tfhybrid.comm.hostcheck: a multi-host Gloo job whose hostname resolves to a
loopback address stops before hvd.init unless Horovod carries the project's
patch (patches/horovod/0100-gloo-process-set-interface.patch)."""
import socket

import pytest

from tfhybrid.comm import hostcheck

# What horovodrun --gloo exports to rank 1 of -np 2 -H h1:1,h2:1 --network-interface eth0.
TWO_HOSTS = {"HOROVOD_GLOO_RENDEZVOUS_ADDR": "10.213.47.11", "HOROVOD_SIZE": "2",
             "HOROVOD_LOCAL_SIZE": "1", "HOROVOD_CROSS_SIZE": "2", "HOROVOD_RANK": "1",
             "HOROVOD_HOSTNAME": "h2", "HOROVOD_GLOO_IFACE": "eth0"}
ONE_HOST = {**TWO_HOSTS, "HOROVOD_LOCAL_SIZE": "2", "HOROVOD_CROSS_SIZE": "1",
            "HOROVOD_GLOO_IFACE": "lo"}


def resolver(*addresses):
    def resolve(name, port, family, kind):
        if not addresses:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return [(socket.AF_INET6 if ":" in a else socket.AF_INET, kind, 6, "", (a, 0))
                for a in addresses]
    return resolve


DEBIAN = resolver("127.0.1.1")          # /etc/hosts: 127.0.1.1 h2
FIXED = resolver("10.213.47.12")        # /etc/hosts: 10.213.47.12 h2


@pytest.mark.parametrize("env, multi", [
    (TWO_HOSTS, True),
    (ONE_HOST, False),
    ({**TWO_HOSTS, "HOROVOD_CROSS_SIZE": "1"}, True),     # local rank 1 exists on one host only
    ({**ONE_HOST, "HOROVOD_CROSS_SIZE": "2"}, True),
    ({k: v for k, v in TWO_HOSTS.items() if k != "HOROVOD_GLOO_RENDEZVOUS_ADDR"}, False),
    ({}, False),
    ({**TWO_HOSTS, "HOROVOD_SIZE": "two"}, False),
])
def test_multi_host(env, multi):
    assert hostcheck.multi_host(env) is multi


def test_loopback_address():
    assert hostcheck.loopback_address("h2", DEBIAN) == "127.0.1.1"
    assert hostcheck.loopback_address("h2", resolver("::1")) == "::1"
    assert hostcheck.loopback_address("h2", FIXED) is None
    # Gloo binds to the first address only
    assert hostcheck.loopback_address("h2", resolver("10.213.47.12", "127.0.1.1")) is None
    assert hostcheck.loopback_address("h2", resolver("127.0.1.1", "10.213.47.12")) == "127.0.1.1"
    assert hostcheck.loopback_address("h2", resolver()) is None


def test_stock_horovod_on_debian_hosts_is_refused_with_the_fix():
    msg = hostcheck.problem(TWO_HOSTS, hostname="h2", patches=(), resolve=DEBIAN)
    assert msg is not None
    for part in ("Host h2 (rank 1)", "'h2'", "127.0.1.1", "eth0", hostcheck.PATCH,
                 "scripts/setup_env.sh", "/etc/hosts"):
        assert part in msg, (part, msg)


@pytest.mark.parametrize("env, resolve, patches", [
    (TWO_HOSTS, DEBIAN, (hostcheck.PATCH,)),          # the project's build
    (TWO_HOSTS, FIXED, ()),                            # name on the interface's address
    (ONE_HOST, DEBIAN, ()),                            # one host: loopback is right
    ({}, DEBIAN, ()),                                  # not launched by horovodrun --gloo
    (TWO_HOSTS, resolver(), ()),                       # unresolvable: Gloo reports it itself
])
def test_jobs_that_can_start_pass(env, resolve, patches):
    assert hostcheck.problem(env, hostname="h2", patches=patches, resolve=resolve) is None


def test_check_raises_on_the_rank(monkeypatch):
    monkeypatch.setattr(hostcheck, "horovod_patches", lambda: ())
    monkeypatch.setattr(hostcheck, "loopback_address", lambda name, resolve=None: "127.0.1.1")
    with pytest.raises(RuntimeError, match="Host h2 .*loopback address 127.0.1.1"):
        hostcheck.check(TWO_HOSTS)
    hostcheck.check(ONE_HOST)


def test_installed_horovod_patches_are_a_tuple():
    patches = hostcheck.horovod_patches()
    assert isinstance(patches, tuple)
    assert all(isinstance(p, str) for p in patches)


@pytest.mark.parametrize("env, patches, warned", [
    (TWO_HOSTS, (), True),                                          # stock Horovod
    (TWO_HOSTS, (hostcheck.PATCH,), True),                          # an older patched build
    (TWO_HOSTS, (hostcheck.PATCH, hostcheck.RECEIVE_FIRST), True),  # without the yield
    (TWO_HOSTS, (hostcheck.PATCH, hostcheck.RECEIVE_FIRST, hostcheck.YIELD_BUSY_PAIR), False),
    (ONE_HOST, (), False),                                          # one host: no link
    ({**TWO_HOSTS, "HOROVOD_LOCAL_RANK": "1"}, (), False),          # once per host
])
def test_a_multi_host_job_without_the_receive_first_patch_is_warned(env, patches, warned):
    message = hostcheck.slow_link_warning(env, patches)
    assert (message is not None) == warned
    if warned:
        missing = [p for p in hostcheck.LINK_PATCHES if p not in patches]
        assert all(p in message for p in missing) and "h2" in message and "make env" in message


def test_the_installed_horovod_carries_the_receive_first_patch():
    patches = hostcheck.horovod_patches()
    if hostcheck.PATCH not in patches:
        pytest.skip("Horovod built without tfhybrid's patches")
    assert hostcheck.RECEIVE_FIRST in patches and hostcheck.YIELD_BUSY_PAIR in patches
