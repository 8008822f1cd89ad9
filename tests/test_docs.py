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


def documented_sim_fields() -> set[str]:
    """The field paths of docs/performance.md's simulator table (`.x` after `a.b.c` stands for `a.b.x`)."""
    text = (ROOT / "docs" / "performance.md").read_text()
    table = text.split("### The simulator's config", 1)[1].split("\n\n", 2)[2].split("\n\n", 1)[0]
    fields = set()
    for line in table.splitlines()[2:]:
        parent = ""
        for name in re.findall(r"`([\w.]+)`", line.split("|")[1]):
            if name.startswith("."):
                name = parent + name
            parent = name.rsplit(".", 1)[0] if "." in name else ""
            fields.add(name)
    return fields


def test_every_simulator_config_field_is_documented():
    from rlsys.config import Section
    from rlsys.sim.config import ElasticTPConfig, SimConfig

    expected = set()
    for name, field in SimConfig.model_fields.items():
        kind = field.annotation
        if name == "control":  # the live section's fields are documented with the live config
            expected |= {f"control.elastic_tp.{f}" for f in ElasticTPConfig.model_fields}
        elif isinstance(kind, type) and issubclass(kind, Section):
            expected |= {f"{name}.{f}" for f in kind.model_fields}
        else:
            expected.add(name)
    documented = documented_sim_fields()
    assert expected - documented == set(), "undocumented"
    assert documented - expected == set(), "documented but not a field"
