"""The two tiers of the parallel tests (no TensorFlow import: the unit tests
check the lists in one process).

The core tier (``make test``, what CI runs) is every test except those that
``full_tier.txt`` lists for the session's world size and, at 4 or more ranks,
the eager twins of the layer tests (they run at -np 2, and at -np 4 they
would cost minutes of the suite for no new path). The full tier (``make test-full``,
``TFHYBRID_TEST_FULL=1``) is every test at every world size.
"""
import os
import re

LIST = os.path.join(os.path.dirname(os.path.abspath(__file__)), "full_tier.txt")


def full_tier() -> bool:
    return os.environ.get("TFHYBRID_TEST_FULL") == "1"


def entries(path=None):
    """The list as (pattern, worlds or None, "file:line") triples: one test id
    per line, relative to tests/parallel, ``*`` matching anything; a line
    starting ``@np4`` (``@np2``, ``@np2,4``) applies at those world sizes only;
    ``#`` starts a comment."""
    path = path or LIST
    out = []
    with open(path) as f:
        for number, line in enumerate(f, 1):
            line = line.split("#", 1)[0].strip()
            if not line:
                continue
            worlds = None
            if line.startswith("@np"):
                head, line = line.split(None, 1)
                worlds = tuple(int(w) for w in head[3:].split(","))
            pattern = re.compile("^" + ".*".join(map(re.escape, line.split("*"))) + "$")
            out.append((pattern, worlds, f"{os.path.basename(path)}:{number}"))
    return out


def select(tests, size, path=None):
    """Split ``tests`` ((test id, eager) pairs, ids relative to tests/parallel)
    into the core tier's (kept, left to the full tier) at world size ``size``,
    plus the list lines that name none of ``tests``."""
    here = [e for e in entries(path) if e[1] is None or size in e[1]]
    used, kept, left = set(), [], []
    for test_id, eager in tests:
        listed = [where for pattern, _, where in here if pattern.match(test_id)]
        used.update(listed)
        (left if listed or (size >= 4 and eager) else kept).append(test_id)
    unused = [where for _, _, where in here if where not in used]
    return kept, left, unused
