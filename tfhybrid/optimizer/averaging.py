"""SplitBrain's periodic model averaging (§4) of the model-parallel part.

``tfhybrid.transform(model, "gmp", average_every=N, averaging=...)`` with
N > 1 marks the trainable variables of the model-parallel region (the layers
from SplitBrain's ModuloLayer on; with ``mp=1`` the layers from the first
Dense layer gmp would partition on) as *group-local*. The
:class:`tfhybrid.DistributedOptimizer` then

* reduces a group-local gradient within the model group only
  (:func:`local_reduction`): sharded blocks and replicated weights of the
  region already hold the gradient of their group's mean loss (see
  :mod:`tfhybrid.layers.splitbrain`), partial ones are summed over the
  model group; nothing crosses model groups, so each group updates its copy
  of the region with its own rows' gradient;
* every N-th applied step, replaces each group-local variable by its average
  over the model groups (:func:`average_variables`): over the rank's data
  group, the ranks that hold the same block in every model group.
  ``"p2p"``: one fused allreduce (Horovod ring) per step of averaging;
  ``"ps"``: a parameter-server exchange, the data group's first rank (the
  member of model group 0) receives every copy (rooted reduce), averages
  and broadcasts the result back: the averaged copy lives on the ranks of
  model group 0.

Everything else (the convolutions before the region) is reduced over the
world every step, as without averaging, so it stays exactly data parallel. With N > 1
training is **approximate** (not single-process training): between two
averagings the groups' copies of the region drift apart, as in SplitBrain.
Optimizer slots (momentum, Adam moments) of group-local variables stay local
(only the weights are averaged). ``N = 1`` (the default) marks nothing:
exact synchronous training. Only :func:`average_variables` needs TensorFlow
and Horovod; the rest is pure Python.
"""
from __future__ import annotations

import dataclasses
from typing import Dict, List, Sequence

from tfhybrid.layout import layout_of
from tfhybrid.process_grid import ProcessGrid

AVERAGING_METHODS = ("p2p", "ps")
_ATTR = "_tfhybrid_periodic_average"


@dataclasses.dataclass(frozen=True)
class PeriodicAverage:
    """How a group-local variable is kept consistent: averaged every ``every``
    applied steps by ``method`` ("p2p" or "ps")."""

    every: int
    method: str = "p2p"

    def __post_init__(self):
        check_average_every(self.every)
        check_averaging(self.method)


def check_average_every(value, where="tfhybrid.transform"):
    """``value`` if it is a positive integer, else ValueError naming it."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{where}: Received an invalid value for `average_every`: "
                         f"average_every={value!r}; expected a positive integer: 1 (the "
                         "default, exact synchronous training) or N > 1 (SplitBrain's model "
                         "averaging of the model-parallel part every N steps).")
    return value


def check_averaging(value, where="tfhybrid.transform"):
    """``value`` if it is one of :data:`AVERAGING_METHODS`, else ValueError."""
    if value not in AVERAGING_METHODS:
        raise ValueError(f"{where}: Received an invalid value for `averaging`: "
                         f"averaging={value!r}; expected one of {AVERAGING_METHODS} ('p2p': "
                         "allreduce-average over the model groups; 'ps': the ranks of model "
                         "group 0 gather, average and broadcast).")
    return value


def mark_periodic(variable, every: int, method: str = "p2p"):
    """Mark ``variable`` group-local, averaged over model groups every ``every`` steps."""
    setattr(variable, _ATTR, PeriodicAverage(every, method))
    return variable


def periodic_of(variable):
    """The :class:`PeriodicAverage` of a group-local variable, else None."""
    return getattr(variable, _ATTR, None)


def local_reduction(variable, grid: ProcessGrid, op: str = "average"):
    """(ranks, factor) of a group-local gradient: the model group for partial
    layouts (summed), nobody otherwise; times ``grad_scale``. ``op`` does not
    change it: the update uses the group's own gradient."""
    layout = layout_of(variable)
    ranks = ()
    if layout.kind == "partial":
        group = layout.group
        ranks = group.ranks if hasattr(group, "ranks") else grid.group("model").ranks
    return (tuple(ranks) if len(ranks) > 1 else ()), float(layout.grad_scale)


def schedules(variables) -> Dict[PeriodicAverage, List[int]]:
    """Indices of the group-local variables of ``variables``, per schedule."""
    out = {}
    for i, v in enumerate(variables):
        p = periodic_of(v)
        if p is not None:
            out.setdefault(p, []).append(i)
    return out


def average_variables(variables: Sequence, method: str, grid: ProcessGrid, name: str):
    """Replace each variable by its mean over this rank's data group (collective).

    Every rank of the world calls this with its own group-local variables in
    the same order (same shapes within a data group). Returns the assign ops.
    """
    import tensorflow as tf   # this module's planning half stays pure Python

    from tfhybrid.comm import backend

    ranks = tuple(grid.group("data").ranks)
    if len(ranks) <= 1 or not variables:
        return []
    values = [tf.convert_to_tensor(v) for v in variables]
    if method == "p2p":
        averaged = backend.grouped_allreduce(values, ranks, f"{name}.p2p",
                                             postscale=1.0 / len(ranks))
    else:
        flat = tf.concat([tf.reshape(t, [-1]) for t in values], 0)
        total = backend.reduce_to(flat, ranks[0], ranks, f"{name}.ps.push")
        mean = backend.broadcast(total / len(ranks), ranks[0], ranks, f"{name}.ps.pull")
        sizes = [int(t.shape.num_elements()) for t in values]   # tf.Tensor shapes
        averaged = [tf.reshape(part, t.shape) for part, t in
                    zip(tf.split(mean, sizes), values)]
    return [v.assign(tf.cast(a, v.dtype)) for v, a in zip(variables, averaged)]


def averaging_bytes(variables: Sequence, method: str, grid: ProcessGrid) -> Dict[str, float]:
    """Bytes one averaging moves (analytic, from the variables' sizes).

    Returns ``payload`` (this rank's bytes of group-local variables, S),
    ``sent`` (bytes this rank sends: ring allreduce 2(G-1)/G S for "p2p";
    "ps": S for a worker, (G-1) S for the server of model group 0, which
    receives (G-1) S) and ``groups`` (G, the number of model groups).
    """
    ranks = tuple(grid.group("data").ranks)
    g = len(ranks)
    s = float(sum(_nbytes(v) for v in variables))
    if g <= 1:
        sent = 0.0
    elif method == "p2p":
        sent = 2.0 * (g - 1) / g * s
    else:
        sent = (g - 1) * s if grid.rank == ranks[0] else s
    return {"payload": s, "sent": sent, "groups": g}


def _nbytes(variable):
    import numpy as np

    dtype = getattr(variable.dtype, "name", variable.dtype)
    return int(np.prod(tuple(variable.shape))) * np.dtype(str(dtype)).itemsize
