"""Documentation pages shipped with the package (package data, no TensorFlow needed).

========== ===========================================================================
page       what it covers
========== ===========================================================================
concepts   the process grid, layouts, the collective algebra, strategies, the
           transformer, the distributed optimizer, the oracle, guards and watchdog
guide      what tfhybrid does with each part of a Keras workflow: saving, metrics,
           losses, custom layers, input, guards, the watchdog, checkpoints, elastic
launching  installing for CPU/GPU, horovodrun, Slurm, Kubernetes, GPU pinning
multinode  jobs across machines: network interface, hosts files, SSH keys, where model
           groups live, what a network fault looks like (watchdog, Gloo timeout), elastic
timeline   Horovod's timeline (``--timeline-filename``) and tfhybrid's collective names
========== ===========================================================================

Error messages point to a section as ``concepts.md#<anchor>``; :func:`anchors`
lists a page's anchors. From a shell::

    python -m tfhybrid.docs                 # list the pages and where they are
    python -m tfhybrid.docs concepts        # print a page
    python -m tfhybrid.docs --path concepts # print its file path

Example:
    >>> import tfhybrid.docs
    >>> "the-process-grid" in tfhybrid.docs.anchors("concepts")
    True
"""
from __future__ import annotations

import os
import re

__all__ = ["PAGES", "path", "read", "anchors", "api_modules"]

HERE = os.path.dirname(os.path.abspath(__file__))
PAGES = ("concepts", "guide", "launching", "multinode", "timeline")


def path(page: str = "concepts") -> str:
    """Absolute path of a shipped page (``concepts``, ``guide``, ``launching``, ``multinode``
    or ``timeline``).

    Raises:
        ValueError: for an unknown page, naming the pages there are.

    Example:
        >>> path("timeline").endswith("timeline.md")
        True
    """
    name = page[:-3] if page.endswith(".md") else page
    if name not in PAGES:
        raise ValueError(f"Received an unknown documentation page {page!r}; expected one of "
                         f"{', '.join(PAGES)} (python -m tfhybrid.docs lists them).")
    return os.path.join(HERE, f"{name}.md")


def read(page: str = "concepts") -> str:
    """The text (Markdown) of a shipped page."""
    with open(path(page), encoding="utf-8") as f:
        return f.read()


def _slug(heading: str) -> str:
    """GitHub's anchor of a Markdown heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(page: str = "concepts") -> list[str]:
    """Anchors of a page's ``##`` sections, as ``page.md#anchor`` links use them.

    Example:
        >>> anchors("concepts")[:2]
        ['the-process-grid', 'layouts']
    """
    return [_slug(m.group(1)) for m in re.finditer(r"^##\s+(.+)$", read(page), re.M)]


def api_modules() -> list[str]:
    """Every public module of the package, for the API reference (``make docs``).

    Found on disk, without importing anything; names starting with ``_`` are
    left out (``__main__``, ``_compat``).

    Example:
        >>> "tfhybrid.comm.primitives" in api_modules()
        True
    """
    root = os.path.dirname(HERE)
    names = ["tfhybrid"]
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if not d.startswith(("_", "."))
                         and os.path.exists(os.path.join(folder, d, "__init__.py")))
        rel = os.path.relpath(folder, root)
        package = "tfhybrid" if rel == "." else "tfhybrid." + rel.replace(os.sep, ".")
        if folder != root:
            names.append(package)
        names += [f"{package}.{f[:-3]}" for f in sorted(files)
                  if f.endswith(".py") and not f.startswith("_")]
    return names
