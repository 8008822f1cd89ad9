"""Every result table in README.md and docs/ is what benchmarks/readme_tables.py renders from
its results file, and every figure quoted in prose is spelt as its file gives it: a figure cannot drift."""
import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SPEC = importlib.util.spec_from_file_location("readme_tables", ROOT / "benchmarks" / "readme_tables.py")
tables = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(tables)
CITING = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "benchmarks" / "peers" / "README.md"]


@pytest.mark.parametrize("doc", tables.DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_marked_table_has_a_renderer_and_matches_its_results_file(doc):
    text = doc.read_text()
    names = tables.marked_names(text)
    assert names, f"{doc.name} has no marked table"
    assert not set(names) - set(tables.TABLES), f"{doc.name}: tables with no renderer"
    rendered = tables.MARKED.finditer(tables.render(text))
    stale = [m.group(2) for m, new in zip(tables.MARKED.finditer(text), rendered) if m.group(3) != new.group(3)]
    assert not stale, f"{doc.name}: {stale} differ from their files (python benchmarks/readme_tables.py --write)"


def test_a_changed_digit_in_a_table_is_caught():
    text = (ROOT / "README.md").read_text()
    table = next(tables.MARKED.finditer(text)).group(3)
    digit = re.search(r"\d", table.split("\n", 3)[3])  # a digit in the first data row
    changed = table.replace(table.split("\n", 3)[3], table.split("\n", 3)[3].replace(
        digit.group(), str((int(digit.group()) + 1) % 10), 1), 1)
    assert tables.render(text.replace(table, changed, 1)) != text.replace(table, changed, 1)


def test_figures_quoted_in_prose_match_their_files():
    for doc, figures in tables.prose_figures().items():
        text = " ".join((ROOT / doc).read_text().split())  # prose wraps across lines
        missing = [f for f in figures if f not in text]
        assert not missing, f"{doc} should say {missing}, as its results files give it"


@pytest.mark.parametrize("doc", CITING, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_results_file_a_document_cites_exists(doc):
    cited = set(re.findall(r"benchmarks/results/([\w.-]+\.json)", doc.read_text()))
    missing = sorted(name for name in cited if not (tables.RESULTS / name).exists())
    assert not missing, f"{doc.relative_to(ROOT)} cites results files that do not exist: {missing}"
