"""Multi-host suite: two test hosts on this machine (tests/multihost/hosts.py),
``horovodrun --gloo -H h1:..,h2:.. --network-interface eth0`` started on h1.

The hosts write ``/etc/hosts`` as Debian, Ubuntu and cloud-init do (own name
on 127.0.1.1), the configuration users meet. Stock Horovod 0.28.1 cannot
start a job across such hosts (its process-set Gloo contexts ignore the
interface); the Horovod that scripts/setup_env.sh builds carries the
project's patch (patches/horovod/). So the tests that train across hosts need
the patched build: with a stock Horovod they skip, saying so, and
``test_stock_horovod_is_refused`` checks instead that ``tfhybrid.init``
stops every rank with the error naming the host and the fix. The hosts file
is never rewritten to hide the problem.

``TFHYBRID_MULTIHOST_PYTHON`` names the interpreter of another environment to
run the ranks with (default: the one running pytest); its ``horovodrun`` is
used. Without root, namespaces or sshd the whole suite skips with one line
saying why.
"""
import pytest

from hosts import TestHosts, leftovers, unavailable_reason
from jobs import PATCH, horovod_patches, python


@pytest.fixture(scope="session")
def hosts():
    reason = unavailable_reason()
    if reason:
        pytest.skip(f"multi-host tests: {reason}")
    with TestHosts(2) as made:
        yield made
    left = leftovers()
    assert not left, f"test hosts left behind: {left}"


@pytest.fixture(scope="session")
def patched():
    """Whether the ranks' Horovod carries the project's Gloo interface patch."""
    return PATCH in horovod_patches()


@pytest.fixture
def needs_patch(patched):
    if not patched:
        pytest.skip(f"{python()}: this Horovod lacks tfhybrid's patch {PATCH} (stock 0.28.1 "
                    "cannot start jobs across hosts whose name resolves to 127.0.1.1); "
                    "scripts/setup_env.sh builds the patched one")
