"""Every dotted ``tfhybrid.…`` path quoted in the package's docstrings, comments
and messages (and in README.md and docs/) resolves: a module imports, or an attribute of one exists.

A newcomer copies these paths from error messages into an import; a path that
moved in a refactor must move in the prose too.
"""
import importlib
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "tfhybrid"
DOTTED = re.compile(r"(?<![\w/.])tfhybrid(?:\.[A-Za-z_]\w*)+")


def _quoted_paths():
    found = {}
    files = sorted(PACKAGE.rglob("*.py")) + [ROOT / "README.md"] + sorted(ROOT.glob("docs/*.md"))
    for path in files:
        for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            for match in DOTTED.finditer(line):
                found.setdefault(match.group(0).rstrip("."), f"{path.relative_to(ROOT)}:{lineno}")
    return found


def resolve(dotted):
    """The object a dotted path names (longest importable module, then attributes)."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for name in parts[cut:]:
            obj = getattr(obj, name)
        return obj
    raise ModuleNotFoundError(dotted)


PATHS = _quoted_paths()


def test_paths_were_found():
    assert len(PATHS) > 50 and "tfhybrid.process_grid.Group" in PATHS


@pytest.mark.parametrize("dotted", sorted(PATHS))
def test_quoted_path_resolves(dotted):
    try:
        resolve(dotted)
    except (ImportError, AttributeError) as exc:
        pytest.fail(f"{dotted!r} quoted at {PATHS[dotted]} does not resolve: {exc}")
