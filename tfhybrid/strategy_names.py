"""The one table of strategy names (pure Python, no TensorFlow).

Every place that accepts or lists a strategy name reads it from here:
``tfhybrid.transform`` (what it builds), the oracle (what it predicts), the
CLI (``tfhybrid plan --strategies``) and the error messages.

=========  ========================================================  =====  =========
name       what it is (paper)                                        built  predicted
=========  ========================================================  =====  =========
serial     one rank, the reference (ParaDL)                                 yes
d          data parallelism (ParaDL §3.1; Horovod)                   yes    yes
f          filter / output-unit parallelism (ParaDL §3.3)            yes    yes
c          channel / input-unit parallelism (ParaDL §3.3)            yes    yes
s          spatial (domain) parallelism (ParaDL §3.2; Gholami)       yes    yes
df         data x filter on a 2-D grid (ParaDL; Gholami's 1.5D)       yes    yes
ds         data x spatial (ParaDL; Gholami's integrated)             yes    yes
gmp        SplitBrain's group model parallelism                      yes    yes
p          pipeline over layer stages (ParaDL §3.4; GPipe)           yes    yes
ls         Stanza's layer separation (CONV / FC workers)             yes    yes
auto       the oracle's choice (``transform`` only)                  yes
=========  ========================================================  =====  =========

Example:
    >>> BUILT
    ('d', 'f', 'c', 's', 'df', 'ds', 'gmp', 'p', 'ls')
    >>> "auto" in TRANSFORM_NAMES and "auto" not in PREDICTED
    True
"""
from __future__ import annotations

import dataclasses
from typing import Tuple


@dataclasses.dataclass(frozen=True)
class StrategyName:
    """One row of the table.

    Attributes:
        name: What users pass as ``strategy=``.
        summary: One line for messages and ``tfhybrid plan``.
        built: ``tfhybrid.transform`` builds it.
        predicted: ``tfhybrid.oracle`` predicts it.
    """

    name: str
    summary: str
    built: bool
    predicted: bool


TABLE: Tuple[StrategyName, ...] = (
    StrategyName("serial", "one rank, the reference", False, True),
    StrategyName("d", "data parallelism", True, True),
    StrategyName("f", "filter (output-unit) parallelism", True, True),
    StrategyName("c", "channel (input-unit) parallelism", True, True),
    StrategyName("s", "spatial (domain) parallelism", True, True),
    StrategyName("df", "data x filter grid", True, True),
    StrategyName("ds", "data x spatial grid", True, True),
    StrategyName("gmp", "SplitBrain group model parallelism", True, True),
    StrategyName("p", "pipeline over layer stages", True, True),
    StrategyName("ls", "Stanza layer separation", True, True),
    StrategyName("auto", "the oracle's choice", True, False),
)

#: Strategies ``tfhybrid.transform`` builds (``auto`` picks among them).
BUILT = tuple(s.name for s in TABLE if s.built and s.name != "auto")
#: What ``tfhybrid.transform(strategy=...)`` accepts.
TRANSFORM_NAMES = BUILT + ("auto",)
#: Strategies the oracle predicts (``tfhybrid plan``, ``tfhybrid.oracle.predict``).
PREDICTED = tuple(s.name for s in TABLE if s.predicted)


def summary(name: str) -> str:
    """The one-line description of a strategy name.

    Raises:
        ValueError: for a name not in :data:`TABLE`.
    """
    for row in TABLE:
        if row.name == name:
            return row.summary
    raise ValueError(f"Received strategy={name!r}; expected one of "
                     f"{tuple(r.name for r in TABLE)}.")
