"""The one definition of the full tier for the integration and multi-host suites.

``make test`` (the core tier, what CI runs) skips the tests marked
``@full_tier``; ``make test-full`` (``TFHYBRID_TEST_FULL=1``) runs them. The
parallel suite lists its full-tier tests per world size in
tests/parallel/full_tier.txt instead (tests/parallel/tiers.py).
"""
import os

import pytest

#: True in the full tier (``make test-full``, ``TFHYBRID_TEST_FULL=1``).
FULL_TIER = os.environ.get("TFHYBRID_TEST_FULL") == "1"
#: Marks a test (or a ``pytest.param``) that only the full tier runs.
full_tier = pytest.mark.skipif(not FULL_TIER, reason="full tier (make test-full)")
