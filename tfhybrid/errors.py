"""One template for tfhybrid's error messages, and the errors every module shares.

Pure Python. Every message reads ``<where>: <what happened, with the value
received>; <what was expected>. <the fix>.``: the subject first (a layer, an
option, a function), the offending value echoed, the accepted values or
rule, then one concrete thing to do. The helpers below build the three
shapes that recur across the package, so they read the same everywhere:

* :func:`invalid_value`: an argument outside its accepted values;
* :func:`not_divisible`: a size that must split evenly over a group of ranks
  (batch over data ranks, units over a model group, rows over a spatial
  block grid), with the nearest valid sizes;
* :func:`not_initialized`: a collective or parallel layer used before
  ``tfhybrid.init()`` in a multi-process job (:class:`NotInitializedError`).

Example:
    >>> str(not_divisible("global batch", 10, 4, "data-parallel ranks", where="tfhybrid.data.shard"))
    'tfhybrid.data.shard: global batch=10 is not divisible by the 4 data-parallel ranks; use a multiple of 4 (e.g. 8 or 12).'
    >>> str(invalid_value("scheme", "K", ("BK", "B/K"), where="tfhybrid.transform"))
    "tfhybrid.transform: Received an invalid value for `scheme`: scheme='K'; expected one of ('BK', 'B/K')."
"""
from __future__ import annotations


class NotInitializedError(RuntimeError):
    """A collective, parallel layer or grid query ran before ``tfhybrid.init()``."""


def _join(where, text, fix=None):
    head = f"{where}: {text}" if where else text[:1].upper() + text[1:]
    return f"{head} {fix}" if fix else head


def invalid_value(name, value, expected, where=None, fix=None) -> ValueError:
    """``ValueError`` for ``name=value`` outside ``expected`` (a tuple of choices or a rule).

    Args:
        name: The argument or option name.
        value: What was received (echoed with ``repr``).
        expected: A tuple/list of accepted values, or a phrase (``"a positive integer"``).
        where: The subject (layer, function); omitted when the name says it all.
        fix: One concrete thing to do, if ``expected`` does not already say it.
    """
    rule = f"one of {tuple(expected)}" if isinstance(expected, (tuple, list)) else expected
    return ValueError(_join(where, f"Received an invalid value for `{name}`: {name}={value!r}; "
                                   f"expected {rule}.", fix))


def nearest_multiples(n: int, k: int) -> str:
    """The multiples of ``k`` around ``n`` ("8 or 12"; "4" when n < k)."""
    lower, upper = n - n % k, n - n % k + k
    return f"{lower} or {upper}" if lower else f"{upper}"


def not_divisible(what, n, k, over, where=None, fix=None) -> ValueError:
    """``ValueError`` for a size ``n`` that must split evenly over ``k`` parts.

    Args:
        what: What is split ("global batch", "units", "height").
        n: Its size.
        k: The number of parts (ranks of a group).
        over: What the parts are ("data-parallel ranks", "ranks of the 'model' group").
        where: The subject (layer, function).
        fix: Another way out, appended after the nearest valid sizes.
    """
    text = (f"{what}={n} is not divisible by the {k} {over}; use a multiple of {k} "
            f"(e.g. {nearest_multiples(n, k)})")
    return ValueError(_join(where, text + (f" {fix}" if fix else "") + "."))


def not_initialized(doing="using parallel layers or collectives") -> NotInitializedError:
    """The one error for work that needs ``tfhybrid.init()`` first."""
    return NotInitializedError(
        f"tfhybrid is not initialised: call tfhybrid.init(model_parallel=...) on every rank "
        f"before {doing} (right after the imports, before building the model).")
