"""Documentation shipped with the package: the pages are package data (a
built wheel contains them), ``python -m tfhybrid.docs`` finds them, the
anchors that error messages cite exist, every ``tfhybrid.*`` path the pages
quote resolves, and every module ``make docs`` hands to pdoc imports.
"""
import importlib
import os
import re
import subprocess
import sys
import zipfile

import pytest

import tfhybrid.docs as docs

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_dotted_paths import DOTTED, resolve  # noqa: E402

# The sections error messages point to instead of DESIGN.md (not shipped).
CITED = {"concepts": ["the-process-grid", "layouts", "the-collective-algebra", "strategies",
                      "the-transformer", "the-distributed-optimizer", "the-oracle"],
         "timeline": ["tfhybrids-names"], "launching": ["gpu-pinning-and-local-ranks"]}


def test_pages_exist_and_are_package_data():
    text = open(os.path.join(ROOT, "setup.py")).read()
    assert '"tfhybrid.docs": ["*.md"]' in text
    for page in docs.PAGES:
        assert os.path.isfile(docs.path(page)), page
        assert docs.read(page).startswith("# ")


def test_wheel_contains_the_pages(tmp_path):
    out = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                          "-q", "-w", str(tmp_path), ROOT], capture_output=True, text=True,
                         timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    wheel = next(p for p in os.listdir(tmp_path) if p.endswith(".whl"))
    names = zipfile.ZipFile(tmp_path / wheel).namelist()
    for page in docs.PAGES:
        assert f"tfhybrid/docs/{page}.md" in names, page
    assert "tfhybrid/docs/__main__.py" in names


@pytest.mark.parametrize("page", sorted(CITED))
def test_cited_anchors_exist(page):
    assert set(CITED[page]) <= set(docs.anchors(page)), docs.anchors(page)


def test_links_between_pages_resolve():
    for page in docs.PAGES:
        for target, anchor in re.findall(r"`(\w+)\.md#([\w-]+)`", docs.read(page)):
            assert anchor in docs.anchors(target), f"{page}: {target}.md#{anchor}"


@pytest.mark.parametrize("page", docs.PAGES)
def test_quoted_paths_resolve(page):
    for line in docs.read(page).splitlines():
        for match in DOTTED.finditer(line):
            resolve(match.group(0).rstrip("."))


def test_command_line():
    run = lambda *a: subprocess.run([sys.executable, "-m", "tfhybrid.docs", *a],  # noqa: E731
                                    capture_output=True, text=True, timeout=60)
    assert run("--path", "concepts").stdout.strip() == docs.path("concepts")
    assert run("timeline").stdout == docs.read("timeline")
    assert all(p in run().stdout for p in docs.PAGES)
    bad = run("nope")
    assert bad.returncode == 2 and "expected one of concepts" in bad.stderr
    with pytest.raises(ValueError, match="unknown documentation page 'nope'"):
        docs.path("nope")


def test_api_modules_import():
    modules = docs.api_modules()
    assert "tfhybrid.runtime" in modules and "tfhybrid.docs" in modules
    assert not [m for m in modules if m.rsplit(".", 1)[-1].startswith("_")]
    for name in modules:
        importlib.import_module(name)
