"""Calls from a lower level of tfhybrid into a higher one, registered by the higher one.

Modules import their own level or below (docs/ARCHITECTURE.md, checked by
``lint-imports``). Where a lower module must reach a higher one at run time (the
backend telling the watchdog about an eager collective, the optimizer asking the
callbacks to agree on rank 0's values), it calls a hook by name here and the higher level provides
the function: ``tfhybrid/__init__`` registers every hook when the package is
imported, which Python does before importing any of its submodules.
"""
from __future__ import annotations

_HOOKS = {}


def register(name: str, function) -> None:
    """Make :func:`call` ``(name, ...)`` run ``function`` (replacing any earlier one)."""
    _HOOKS[name] = function


def call(name: str, *args, **kwargs):
    """Run the function registered as ``name`` and return its result."""
    try:
        function = _HOOKS[name]
    except KeyError:
        raise RuntimeError(
            f"tfhybrid.hooks: no function is registered as {name!r}; the higher level that "
            "provides it registers it when `tfhybrid` is imported. Import tfhybrid "
            "normally (import tfhybrid, or from tfhybrid... import ...).") from None
    return function(*args, **kwargs)
