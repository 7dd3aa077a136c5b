"""What the catalogue scripts (tests/integration/test_user_catalogue.py) do around
the user's code: where they run, and the one line and file the test reads.

A script runs as one plain Keras process (``python script.py OUT``) or under
``horovodrun`` (``DIST``); the test compares the two runs' ``RESULT {json}``
lines (every rank prints one) and the weights rank 0 or the plain process
writes to ``OUT``. Not a tfhybrid API.
"""
import json
import os
import sys

import numpy as np

OUT = sys.argv[1] if len(sys.argv) > 1 else "."
DIST = int(os.environ.get("HOROVOD_SIZE", "1")) > 1    # under horovodrun; else plain Keras


def full_model(model):
    """The plain Keras model with the full weights: ``tfhybrid.gather`` under
    horovodrun (collective: every rank calls it), else ``model`` itself."""
    if not DIST:
        return model
    import tfhybrid
    return tfhybrid.gather(model)


def report(full, weights="weights.npz", history=None, scores=None, **extra):
    """Print ``RESULT {json}`` (the rank, the History, the ``evaluate`` dict and
    ``extra``) on every rank; rank 0, or the plain process, saves ``full``'s
    weights to ``OUT/weights``."""
    rank, root = 0, True
    if DIST:
        import tfhybrid
        rank, root = tfhybrid.rank(), tfhybrid.is_root()
    result = {"rank": rank}
    if history is not None:
        result["history"] = {k: [float(v) for v in vs] for k, vs in history.history.items()}
    if scores is not None:
        result["evaluate"] = {k: float(v) for k, v in scores.items()}
    result.update(extra)
    print("RESULT " + json.dumps(result), flush=True)
    if root:
        np.savez(os.path.join(OUT, weights), **{w.path: w.numpy() for w in full.weights})
