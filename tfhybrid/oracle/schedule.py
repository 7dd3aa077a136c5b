"""The pipeline's fill-drain step as tfhybrid runs it, simulated event by event.

``tfhybrid.transform(model, "p")`` (``transformer/pipeline.py``) runs one
step per rank as one traced function: stage 0 cuts the batch into M
micro-batches; stage k computes micro-batch m as soon as it arrives and its
previous micro-batch is done, and sends the result to stage k+1 with an
asynchronous Horovod alltoall, so the transfer runs while the stage already
computes the next micro-batch (ParaDL's Eq. 12-13 charge every transfer on
the critical path instead). Horovod runs one collective at a time per
process (its background thread), so a rank's transfers queue behind each
other, forward and backward alike: on a slow link the transfers, not the
stages, set the pace; the last stage computes the loss on all M
outputs, then each stage back-propagates the micro-batches in the order
their errors arrive and sends its input's error back. The step ends when
every stage has applied its update and the last stage's predictions were
broadcast to the pipeline (anchored on every transfer).

Ranks on one node share its cores: when n stages compute at once each runs
at ``1 / machine.oversubscription(n)`` of its speed (processor sharing), so
a 4-stage pipeline with 2 micro-batches on 2 cores is never 4-way
oversubscribed, whereas data parallelism on the same ranks is.

Example:
    >>> fill_drain([1.0, 1.0], [2.0, 2.0], 1, [0.0], lambda n: 1.0)   # F F B B
    6.0
    >>> fill_drain([1.0, 1.0], [1.0, 1.0], 2, [0.0], lambda n: float(n))  # 2 at once: x2
    8.0
"""
from __future__ import annotations

import math


def fill_drain(fwd, bwd, micro, transfer, slowdown, tail=None, nodes=None, bcast=0.0):
    """Seconds of one fill-drain step.

    Args:
        fwd: Forward seconds of one micro-batch per stage (one rank alone).
        bwd: Backward seconds of one micro-batch per stage.
        micro: Number of micro-batches M.
        transfer: Seconds of one transfer between stage k and k+1 (len S-1),
            the same forward (activations) and backward (their error).
        slowdown: ``f(n)``: the slowdown of each of n ranks computing at once
            on one node (1 for n <= cores).
        tail: Seconds each stage computes after its last backward (weight
            update), or None.
        nodes: Node index of each stage (None: all on one node).
        bcast: Seconds of the predictions' broadcast, issued once every
            transfer of the step is done.

    Example:
        >>> fill_drain([1.0, 1.0], [1.0, 1.0], 2, [0.5], lambda n: 1.0)
        7.0
    """
    S = len(fwd)
    nodes = list(nodes) if nodes is not None else [0] * S
    tail = list(tail) if tail is not None else [0.0] * S
    # each stage's task list: F(m) for m in 0..M-1, B(m) for m in 0..M-1, update
    tasks = [[("F", m) for m in range(micro)] + [("B", m) for m in range(micro)] + [("U", 0)]
             for _ in range(S)]
    work = {"F": fwd, "B": bwd, "U": tail}
    done = {}                      # (kind, stage, m) -> end time
    arrived = {}                   # (kind, stage, m) -> when its input reached the stage
    channel = [0.0] * S            # when each rank's Horovod thread is free again
    pos = [0] * S                  # next task of each stage
    left = [None] * S              # remaining work of the running task
    t = 0.0

    def send(key, a, b, seconds, at):
        """A transfer between stages a and b, issued at ``at``: Horovod runs one
        collective at a time per rank, so it waits for both ranks' earlier ones."""
        start = max(at, channel[a], channel[b])
        channel[a] = channel[b] = start + seconds
        arrived[key] = start + seconds

    def ready(k):
        kind, m = tasks[k][pos[k]]
        if kind == "F":
            return 0.0 if k == 0 else arrived.get(("F", k, m))
        if kind == "B":
            if k == S - 1:         # the loss needs every micro-batch's output
                return done.get(("F", k, micro - 1))
            return arrived.get(("B", k, m))
        return done.get(("B", k, micro - 1))

    while any(p < len(tl) for p, tl in zip(pos, tasks)):
        starts = {}
        for k in range(S):
            if pos[k] < len(tasks[k]):
                r = ready(k)
                if r is not None:
                    starts[k] = r
        running = [k for k, r in starts.items() if r <= t + 1e-15]
        upcoming = [r for k, r in starts.items() if r > t + 1e-15]
        if not running:
            t = min(upcoming)
            continue
        for k in running:
            if left[k] is None:
                kind, _ = tasks[k][pos[k]]
                left[k] = work[kind][k]
        rate = {}
        for k in running:
            n = sum(1 for j in running if nodes[j] == nodes[k])
            rate[k] = 1.0 / max(slowdown(n), 1e-12)
        dt = min(left[k] / rate[k] for k in running)
        if upcoming:
            dt = min(dt, min(upcoming) - t)
        t += dt
        for k in running:
            left[k] -= dt * rate[k]
            if left[k] <= 1e-12 * max(1.0, t):
                kind, m = tasks[k][pos[k]]
                done[(kind, k, m)] = t
                if kind == "B" and k > 0:
                    send(("B", k - 1, m), k - 1, k, transfer[k - 1], t)
                if kind == "F" and k < S - 1:
                    send(("F", k + 1, m), k, k + 1, transfer[k], t)
                pos[k] += 1
                left[k] = None
    end = max(done[("U", k, 0)] for k in range(S))
    return max(end, max(channel) + bcast) if S > 1 else end


def stage_slowdown(machine):
    """``f(n)``: the machine's compute slowdown of n ranks computing at once."""
    return lambda n: machine.oversubscription(n) if n > 1 else 1.0


def node_of(stages, machine):
    """Node index of each of ``stages`` consecutive ranks."""
    per = machine.ranks_per_node or math.inf
    return [int(k // per) if per != math.inf else 0 for k in range(stages)]
