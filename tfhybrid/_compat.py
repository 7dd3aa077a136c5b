"""Old spellings of public names and options, accepted with a ``DeprecationWarning``.

Pure Python. Two helpers: :func:`module_aliases` gives a module a PEP 562
``__getattr__`` for renamed constants; :func:`renamed_option` moves a renamed
keyword option to its new name.

Example:
    >>> import warnings
    >>> with warnings.catch_warnings(record=True) as seen:
    ...     warnings.simplefilter("always")
    ...     renamed_option({"modulo": "BK"}, "modulo", "scheme", "tfhybrid.transform")
    {'scheme': 'BK'}
    >>> seen[0].category.__name__
    'DeprecationWarning'
"""
from __future__ import annotations

import warnings


def _warn(old, new, where):
    warnings.warn(f"{where}: {old!r} is deprecated; use {new!r} (same meaning). The old "
                  "spelling will be removed in a future release.", DeprecationWarning,
                  stacklevel=4)


def module_aliases(module_name: str, namespace: dict, aliases: dict):
    """A module ``__getattr__`` resolving each old name in ``aliases`` to its new one.

    Args:
        module_name: The module's ``__name__`` (for the messages).
        namespace: The module's ``globals()``.
        aliases: ``{old name: new name}``.
    """
    def __getattr__(name):
        if name in aliases:
            _warn(name, aliases[name], module_name)
            return namespace[aliases[name]]
        raise AttributeError(f"module {module_name!r} has no attribute {name!r}")
    return __getattr__


def renamed_option(options: dict, old: str, new: str, where: str) -> dict:
    """``options`` with ``old`` moved to ``new`` (warning once per call).

    Raises:
        ValueError: when both spellings are given.
    """
    if old not in options:
        return options
    if new in options:
        raise ValueError(f"{where}: received both {old}= (deprecated) and {new}=; pass only "
                         f"{new}={options[old]!r}.")
    _warn(old, new, where)
    out = dict(options)
    out[new] = out.pop(old)
    return out
