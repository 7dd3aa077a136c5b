"""This process as one rank of a pretend process grid, for one-process tests of
what a rank of a larger job computes locally (no Horovod is started)."""
import contextlib

from tfhybrid import runtime
from tfhybrid.process_grid import ProcessGrid


@contextlib.contextmanager
def pretend(size, rank, mp):
    """This process as global rank ``rank`` of a ``size``-rank grid with model groups of
    ``mp``; the runtime's state is restored on exit."""
    saved = dict(runtime._STATE)
    runtime._STATE.update(grid=ProcessGrid(size=size, rank=rank, model_parallel=mp),
                          args=(mp, None))
    try:
        yield
    finally:
        runtime._STATE.clear()
        runtime._STATE.update(saved)
