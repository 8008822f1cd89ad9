"""The design document the code points to exists and holds every section a docstring cites by name."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DESIGN = ROOT / "docs" / "design.md"


def test_every_design_section_cited_in_the_code_exists():
    headings = {line.lstrip("#").strip() for line in DESIGN.read_text().splitlines() if line.startswith("#")}
    principles = len(re.findall(r"^\d+\. \*\*", DESIGN.read_text(), re.M))
    cited = []
    for path in (ROOT / "rlsys").rglob("*.py"):
        for match in re.finditer(r'docs/design\.md[^"\n]{0,3}((?:"[^"]+"(?:, )?)+|principle \d+)', path.read_text()):
            cited.append((path.name, match.group(1)))
    assert cited, "no docstring cites docs/design.md"
    for name, what in cited:
        if what.startswith("principle"):
            assert int(what.split()[1]) <= principles, f"{name} cites {what}; docs/design.md lists {principles}"
            continue
        for section in re.findall(r'"([^"]+)"', what):
            assert any(h.startswith(section) for h in headings), f"{name} cites docs/design.md \"{section}\""
