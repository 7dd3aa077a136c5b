"""Refuse, before ``hvd.init``, a multi-host Gloo job that stock Horovod cannot start.

Horovod 0.28.1 creates the Gloo contexts of its process sets (the global set
included, so every job) on a device made without the interface the launcher
chose (``horovodrun --network-interface``, exported as ``HOROVOD_GLOO_IFACE``):
Gloo then binds to the address this host's name resolves to. Debian, Ubuntu
and cloud-init write ``127.0.1.1 <hostname>`` into ``/etc/hosts``, so on
ordinary cloud machines that address is a loopback address, the other hosts'
ranks cannot connect, and ``hvd.init`` aborts every rank with
``gloo ... connect [127.0.1.1]:NNNNN: Connection refused``.

The Horovod that ``scripts/setup_env.sh`` builds carries the project's patch
(``patches/horovod/0100-gloo-process-set-interface.patch``: every Gloo context
uses the launcher's interface) and the module ``horovod.tfhybrid_patches``
listing the patches applied. :func:`check` stops a rank when all of these
hold: the job spans several hosts, this host's name resolves to a loopback
address, and the Horovod build lacks the patch. :func:`slow_link_warning` warns
(once per host) when a multi-host job's Horovod lacks the patches that let
Gloo's allgathers and alltoalls use both directions of a link at once
(``0101-gloo-receive-before-send``) and keep Gloo's network thread from
spinning on a rank's core (``0102-gloo-yield-to-busy-pair``). Only this module
and :mod:`tfhybrid.comm.backend` look at Horovod.
"""
from __future__ import annotations

import ipaddress
import os
import socket

PATCH = "0100-gloo-process-set-interface"
RECEIVE_FIRST = "0101-gloo-receive-before-send"   # both directions of a link at once
YIELD_BUSY_PAIR = "0102-gloo-yield-to-busy-pair"   # no spinning on a rank's one core
LINK_PATCHES = (RECEIVE_FIRST, YIELD_BUSY_PAIR)   # what slow_link_warning asks for


def horovod_patches() -> tuple:
    """The tfhybrid patches the installed Horovod was built with (empty for a
    stock build or when Horovod is absent)."""
    try:
        from horovod import tfhybrid_patches  # noqa: WPS433 (only tfhybrid.comm imports horovod)
    except ImportError:
        return ()
    return tuple(getattr(tfhybrid_patches, "PATCHES", ()))


def multi_host(env=None) -> bool:
    """Whether ``horovodrun --gloo`` started this job on more than one host:
    the ranks on this host (``HOROVOD_LOCAL_SIZE``) are fewer than the world
    (``HOROVOD_SIZE``), or ranks of the same local rank sit on several hosts
    (``HOROVOD_CROSS_SIZE``)."""
    env = os.environ if env is None else env
    if not env.get("HOROVOD_GLOO_RENDEZVOUS_ADDR"):
        return False   # not a Gloo launch by horovodrun (MPI builds its contexts otherwise)
    try:
        size = int(env.get("HOROVOD_SIZE") or 1)
        local_size = int(env.get("HOROVOD_LOCAL_SIZE") or size)
        cross_size = int(env.get("HOROVOD_CROSS_SIZE") or 1)
    except ValueError:
        return False
    return local_size < size or cross_size > 1


def loopback_address(hostname=None, resolve=socket.getaddrinfo):
    """The address Gloo binds to when it is given no interface (the first
    address ``hostname``, default this host's name, resolves to) if that is a
    loopback address, else None (also when the name does not resolve)."""
    name = hostname or socket.gethostname()
    try:
        infos = resolve(name, None, socket.AF_UNSPEC, socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return None
    for info in infos:
        addr = info[4][0].split("%")[0]
        try:
            return addr if ipaddress.ip_address(addr).is_loopback else None
        except ValueError:
            continue
    return None


def problem(env=None, hostname=None, patches=None, resolve=socket.getaddrinfo):
    """The error message for this rank, or None when the job can start."""
    env = os.environ if env is None else env
    if not multi_host(env):
        return None
    name = hostname or socket.gethostname()
    addr = loopback_address(name, resolve)
    if addr is None:
        return None
    patches = horovod_patches() if patches is None else patches
    if PATCH in patches:
        return None
    host = env.get("HOROVOD_HOSTNAME") or name
    iface = env.get("HOROVOD_GLOO_IFACE") or "the network interface"
    rank = env.get("HOROVOD_RANK", "?")
    return (
        f"Host {host} (rank {rank}): its hostname {name!r} resolves to the loopback address "
        f"{addr}, and this Horovod build lacks tfhybrid's patch {PATCH}. Stock Horovod 0.28.1 "
        f"binds its process-set Gloo contexts to that address instead of {iface}, so ranks on "
        "other hosts cannot connect and hvd.init aborts with 'Connection refused'. "
        "Fix either: install the patched Horovod that scripts/setup_env.sh builds (`make env`, "
        "patches/horovod/), or make the hostname resolve to the address of "
        f"{iface} on every host (in /etc/hosts replace '127.0.1.1 {name}' with "
        f"'<address of {iface}> {name}').")


def slow_link_warning(env=None, patches=None):
    """A warning for local rank 0 of a multi-host Gloo job whose Horovod lacks
    :data:`RECEIVE_FIRST` or :data:`YIELD_BUSY_PAIR` (a stock build, or one made
    elsewhere or from an older checkout), else None.

    Stock Gloo sends an allgather's or alltoall's data before it tells the peer it
    is ready to receive, on the same ordered stream, so the two directions of a
    link take turns: on a slow link such collectives take up to twice as long.
    Its network thread also spins while Horovod's thread sends on the same
    connection, and where both share a core (one core per rank) every small
    collective then waits 2-8 ms. The job still runs and computes the same numbers.
    """
    env = os.environ if env is None else env
    if not multi_host(env) or env.get("HOROVOD_LOCAL_RANK", "0") != "0":
        return None
    patches = horovod_patches() if patches is None else patches
    missing = [p for p in LINK_PATCHES if p not in patches]
    if not missing:
        return None
    costs = {RECEIVE_FIRST: "its Gloo allgathers and alltoalls (the c, s, ds and gmp layers', "
                            "the halo exchanges, the pipeline's and the layer separation's "
                            "transfers) send one direction of the link after the other and "
                            "can take up to twice as long",
             YIELD_BUSY_PAIR: "with one core per rank, each collective can wait 2-8 ms more "
                              "(a 4 KB allreduce: 1.3 ms with the patch, 4.7 without)"}
    host = env.get("HOROVOD_HOSTNAME") or socket.gethostname()
    return (f"tfhybrid: host {host}: this Horovod build lacks tfhybrid's "
            f"patch{'es' if len(missing) > 1 else ''} {', '.join(missing)}; across hosts "
            + "; ".join(costs[p] for p in missing) + ". "
            "Install the Horovod that scripts/setup_env.sh builds (`make env`, "
            "patches/horovod/).")


def check(env=None):
    """Raise RuntimeError with :func:`problem`'s message on a rank that would
    hang in ``hvd.init``; every rank of the job runs it before ``hvd.init``."""
    message = problem(env)
    if message:
        raise RuntimeError(message)
