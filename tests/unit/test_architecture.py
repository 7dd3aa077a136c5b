"""docs/ARCHITECTURE.md names every module of tfhybrid/ and no module that is gone."""
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PACKAGE = os.path.join(ROOT, "tfhybrid")


def _modules():
    found = set()
    for folder, _, files in os.walk(PACKAGE):
        for name in files:
            if name.endswith(".py"):
                rel = os.path.relpath(os.path.join(folder, name), PACKAGE)
                found.add(rel[:-3].replace(os.sep, "/"))
    return found


def _documented():
    text = open(os.path.join(ROOT, "docs", "ARCHITECTURE.md"), encoding="utf-8").read()
    table = text.split("## Modules", 1)[1].split("\n## ", 1)[0]
    return set(re.findall(r"^\| `([\w/]+)` \|", table, flags=re.M))


def test_every_module_is_in_the_module_table():
    missing = sorted(_modules() - _documented())
    assert not missing, f"add these modules to docs/ARCHITECTURE.md's module table: {missing}"


def test_the_module_table_names_only_existing_modules():
    gone = sorted(_documented() - _modules())
    assert not gone, f"docs/ARCHITECTURE.md names modules that do not exist: {gone}"
