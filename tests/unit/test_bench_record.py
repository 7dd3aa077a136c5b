"""bench/record.py: the sections of docs/benchmarks.md come from a run's output."""
import datetime
import importlib.util
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _record():
    spec = importlib.util.spec_from_file_location("record", os.path.join(ROOT, "bench", "record.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


WHEN = datetime.datetime(2026, 1, 2, 3, 4, tzinfo=datetime.timezone.utc)


def test_section_names_date_machine_command_and_keeps_result_lines():
    rec = _record()
    out = ("[1]<stdout>:| contender | ms |\n[0]<stderr>:noise\n"
           "W0000 00:00 something.cc:12] log\n| a | 1.0 |\nWARNING: x\n")
    text = rec.section(["python", "bench/dp.py", "--pair"], rec.result_lines(out), WHEN)
    assert text.startswith("## `python bench/dp.py --pair`\n")
    assert "- date: 2026-01-02 03:04 UTC" in text
    assert "- machine: " in text and " cores (" in text
    assert "| contender | ms |\n| a | 1.0 |" in text
    assert "noise" not in text and "WARNING" not in text and "something.cc" not in text


def test_a_new_run_replaces_the_section_of_the_same_command():
    rec = _record()
    page = rec.HEADER
    one = rec.section(["b", "x"], ["old"], WHEN)
    two = rec.section(["b", "y"], ["other"], WHEN)
    page = rec.merge(rec.merge(page, one), two)
    page = rec.merge(page, rec.section(["b", "x"], ["new"], WHEN))
    assert page.startswith("# Benchmarks")
    assert page.count("## `b x`") == 1 and "new" in page and "old" not in page
    assert "other" in page


def test_a_failing_command_leaves_the_page(tmp_path, monkeypatch):
    rec = _record()
    page = tmp_path / "benchmarks.md"
    monkeypatch.setattr(rec, "PAGE", page)
    assert rec.main(["--", sys.executable, "-c", "import sys; sys.exit(3)"]) == 3
    assert not page.exists()
    assert rec.main(["--", sys.executable, "-c", "print('| r | 1.5 |')"]) == 0
    assert "| r | 1.5 |" in page.read_text()
