"""Host lists for ``horovodrun -H`` from a Slurm allocation (pure Python).

Slurm names the nodes of a job in a compressed form (``SLURM_JOB_NODELIST``,
e.g. ``node[01-03,7],gpu5``) and the tasks per node in another
(``SLURM_TASKS_PER_NODE``, e.g. ``4(x3),2``). ``horovodrun`` wants
``-H node01:4,node02:4,...``. This module turns one into the other without
``scontrol`` (which compute nodes may lack), so a batch script can write::

    HOSTS=$(python -m tfhybrid.launch_hosts)          # node01:4,node02:4,node03:4,node7:4
    NP=$(python -m tfhybrid.launch_hosts --np)         # 16
    horovodrun --gloo -np "$NP" -H "$HOSTS" python train.py

(see ``examples/launch/slurm.sbatch``). ``--hostfile`` prints the
``host slots=N`` lines of an MPI hostfile instead.

Example:
    >>> expand_nodelist("node[01-03,7],gpu5")
    ['node01', 'node02', 'node03', 'node7', 'gpu5']
    >>> horovod_hosts(expand_nodelist("node[1-2]"), expand_tasks_per_node("4(x2)"))
    'node1:4,node2:4'
"""
from __future__ import annotations

import argparse
import os
import re
import sys

__all__ = ["expand_nodelist", "expand_tasks_per_node", "horovod_hosts", "hosts_from_env", "main"]

_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")
_TASKS = re.compile(r"^(\d+)(?:\(x(\d+)\))?$")


def _split_top_level(text, what):
    """Split ``text`` at commas outside brackets."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
            if depth > 1:
                raise ValueError(f"Received {what} {text!r}: nested '[' at position {i}; "
                                 "expected Slurm's form, e.g. node[01-03,7],gpu5.")
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"Received {what} {text!r}: ']' without '[' at position {i}; "
                                 "expected Slurm's form, e.g. node[01-03,7],gpu5.")
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth != 0:
        raise ValueError(f"Received {what} {text!r}: '[' is never closed; "
                         "expected Slurm's form, e.g. node[01-03,7],gpu5.")
    parts.append(text[start:])
    return parts


def _expand_bracket(body, text):
    """``01-03,7`` -> ['01', '02', '03', '7'] (zero padding kept per range)."""
    out = []
    for item in body.split(","):
        m = _RANGE.match(item.strip())
        if not m:
            raise ValueError(f"Received nodelist {text!r}: range {item!r} inside brackets is not "
                             "N or N-M with digits; e.g. node[01-03,7].")
        lo, hi = m.group(1), m.group(2) if m.group(2) is not None else m.group(1)
        if int(hi) < int(lo):
            raise ValueError(f"Received nodelist {text!r}: range {item!r} ends below its start; "
                             f"write [{hi}-{lo}] instead.")
        width = len(lo) if lo.startswith("0") else 0
        out.extend(str(n).zfill(width) for n in range(int(lo), int(hi) + 1))
    return out


def expand_nodelist(nodelist: str) -> list[str]:
    """Expand a Slurm node list into host names, in Slurm's order.

    Handles several comma-separated groups, ranges and single numbers in
    brackets, zero padding (``[08-10]`` -> 08, 09, 10) and several bracket
    groups in one name (``rack[1-2]-n[1-2]`` -> rack1-n1, rack1-n2, ...).
    Duplicates are kept once.

    Raises:
        ValueError: on an empty list or malformed brackets, naming the value.

    Example:
        >>> expand_nodelist("gpu[08-10],cpu1")
        ['gpu08', 'gpu09', 'gpu10', 'cpu1']
    """
    text = (nodelist or "").strip()
    if not text:
        raise ValueError("Received an empty nodelist; expected Slurm's SLURM_JOB_NODELIST, "
                         "e.g. node[01-03,7],gpu5 (run inside an allocation, or pass --nodelist).")
    hosts = []
    for part in _split_top_level(text, "nodelist"):
        part = part.strip()
        if not part:
            raise ValueError(f"Received nodelist {text!r}: empty host name between commas.")
        names = [""]
        for token in re.split(r"(\[[^\]]*\])", part):
            if token.startswith("["):
                names = [n + x for n in names for x in _expand_bracket(token[1:-1], text)]
            elif token:
                names = [n + token for n in names]
        hosts.extend(n for n in names if n not in hosts)
    return hosts


def expand_tasks_per_node(spec: str | None, n_nodes: int | None = None) -> list[int]:
    """Expand ``SLURM_TASKS_PER_NODE`` (``4(x3),2``) into per-node counts ``[4, 4, 4, 2]``.

    A single number (``SLURM_NTASKS_PER_NODE`` style) is repeated for
    ``n_nodes`` nodes when given.

    Raises:
        ValueError: on a malformed spec, naming it.

    Example:
        >>> expand_tasks_per_node("2(x2),1")
        [2, 2, 1]
        >>> expand_tasks_per_node("4", n_nodes=3)
        [4, 4, 4]
    """
    text = (spec or "").strip()
    counts = []
    for item in text.split(","):
        m = _TASKS.match(item.strip())
        if not m or int(m.group(1)) < 1:
            raise ValueError(f"Received tasks per node {spec!r}: {item!r} is not N or N(xK) with "
                             "N >= 1; expected Slurm's SLURM_TASKS_PER_NODE, e.g. 4(x2),2.")
        counts.extend([int(m.group(1))] * int(m.group(2) or 1))
    if n_nodes is not None and len(counts) == 1 and n_nodes > 1:
        counts *= n_nodes
    return counts


def horovod_hosts(hosts: list[str], slots: list[int]) -> str:
    """``horovodrun -H`` value: ``host:slots`` joined by commas.

    Raises:
        ValueError: when the two lists differ in length.

    Example:
        >>> horovod_hosts(["a", "b"], [2, 1])
        'a:2,b:1'
    """
    if len(hosts) != len(slots):
        raise ValueError(f"Received {len(hosts)} hosts ({','.join(hosts)}) but {len(slots)} slot "
                         f"counts ({slots}); give one count per host, or one for all "
                         "(--slots N).")
    return ",".join(f"{h}:{s}" for h, s in zip(hosts, slots))


def hosts_from_env(environ=None, nodelist=None, tasks_per_node=None, slots=None):
    """``(hosts, slots)`` of the current Slurm allocation.

    Node list: ``nodelist`` or ``SLURM_JOB_NODELIST`` (``SLURM_NODELIST``).
    Slots per node: ``slots`` (one number for every node), else
    ``tasks_per_node`` or ``SLURM_TASKS_PER_NODE`` (``SLURM_NTASKS_PER_NODE``),
    else ``SLURM_GPUS_ON_NODE`` (one process per GPU), else 1.

    Example:
        >>> hosts_from_env({"SLURM_JOB_NODELIST": "n[1-2]", "SLURM_TASKS_PER_NODE": "4(x2)"})
        (['n1', 'n2'], [4, 4])
    """
    env = os.environ if environ is None else environ
    text = nodelist or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if not text:
        raise ValueError("No node list: SLURM_JOB_NODELIST is not set. Run inside a Slurm "
                         "allocation (sbatch/salloc) or pass --nodelist, e.g. "
                         "--nodelist 'node[01-02]' --slots 4.")
    hosts = expand_nodelist(text)
    if slots is not None:
        if int(slots) < 1:
            raise ValueError(f"Received slots={slots}; expected processes per node >= 1, "
                             "e.g. --slots 4 (one per GPU).")
        counts = [int(slots)] * len(hosts)
    else:
        spec = (tasks_per_node or env.get("SLURM_TASKS_PER_NODE")
                or env.get("SLURM_NTASKS_PER_NODE") or env.get("SLURM_GPUS_ON_NODE") or "1")
        counts = expand_tasks_per_node(spec, n_nodes=len(hosts))
    horovod_hosts(hosts, counts)   # same lengths, or a clear error
    return hosts, counts


def main(argv=None) -> int:
    """``python -m tfhybrid.launch_hosts``: print ``-H`` hosts, ``--np`` or a hostfile."""
    ap = argparse.ArgumentParser(
        prog="python -m tfhybrid.launch_hosts",
        description="Print the horovodrun -H host list of this Slurm allocation "
                    "(SLURM_JOB_NODELIST x SLURM_TASKS_PER_NODE).")
    ap.add_argument("--nodelist", help="Slurm node list (default: $SLURM_JOB_NODELIST)")
    ap.add_argument("--tasks-per-node", help="Slurm tasks per node, e.g. '4(x2),2' "
                    "(default: $SLURM_TASKS_PER_NODE)")
    ap.add_argument("--slots", type=int, help="processes on every node (overrides the above)")
    out = ap.add_mutually_exclusive_group()
    out.add_argument("--np", action="store_true", help="print the total number of processes")
    out.add_argument("--hostfile", action="store_true", help="print 'host slots=N' lines")
    args = ap.parse_args(argv)
    try:
        hosts, counts = hosts_from_env(nodelist=args.nodelist, tasks_per_node=args.tasks_per_node,
                                       slots=args.slots)
    except ValueError as err:
        print(f"{ap.prog}: error: {err}", file=sys.stderr)
        return 2
    if args.np:
        print(sum(counts))
    elif args.hostfile:
        print("\n".join(f"{h} slots={c}" for h, c in zip(hosts, counts)))
    else:
        print(horovod_hosts(hosts, counts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
