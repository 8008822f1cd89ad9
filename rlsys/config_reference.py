"""docs/config.md, the reference of every config key, generated from the schema (rlsys/config.py): each section's
docstring, and each key's type, default and the comments written beside it there. A test keeps the page equal to
what this prints: `python -m rlsys.config_reference > docs/config.md` after changing the schema."""
from __future__ import annotations

import ast
import io
import json
import tokenize
from pathlib import Path

from pydantic import BaseModel

from rlsys import config

HEADER = """# Config reference

Every key of a run's config (`rlsys train CONFIG key=value ...`), section by section, with its type, default and
what it does. Generated from the schema in `rlsys/config.py` by `python -m rlsys.config_reference > docs/config.md`;
a test fails when the two differ. Simulator configs (`rlsys simulate`) have their own schema, `rlsys/sim/config.py`.
"""


def source_notes() -> dict[tuple[str, str], str]:
    """(class name, field name) -> the comments above the field's line and beside it, in rlsys/config.py."""
    text = Path(config.__file__).read_text()
    comments = {tok.start[0]: tok.string.lstrip("#").strip()
                for tok in tokenize.generate_tokens(io.StringIO(text).readline) if tok.type == tokenize.COMMENT}
    lines = text.splitlines()
    notes = {}
    for cls in (n for n in ast.parse(text).body if isinstance(n, ast.ClassDef)):
        for field in (n for n in cls.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)):
            above, line = [], field.lineno - 1
            while line >= 1 and lines[line - 1].strip().startswith("#"):
                above.insert(0, comments[line])
                line -= 1
            beside = [comments[n] for n in range(field.lineno, field.end_lineno + 1) if n in comments]
            notes[(cls.name, field.target.id)] = " ".join(above + beside)
    return notes


def annotations() -> dict[tuple[str, str], str]:
    """(class name, field name) -> its type as written in rlsys/config.py."""
    tree = ast.parse(Path(config.__file__).read_text())
    return {(cls.name, f.target.id): ast.unparse(f.annotation)
            for cls in tree.body if isinstance(cls, ast.ClassDef)
            for f in cls.body if isinstance(f, ast.AnnAssign) and isinstance(f.target, ast.Name)}


def bounds(field) -> list[str]:
    """A field's numeric bounds as the schema checks them: ">= 0", "<= 1"."""
    signs = (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<"))
    return [f"{sign} {getattr(m, name)}" for m in field.metadata for name, sign in signs if hasattr(m, name)]


def is_section(annotation) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def section(model: type[BaseModel], prefix: str, notes: dict, types: dict) -> list[str]:
    """The markdown of one section, then of the sections nested in it."""
    title = f"`{prefix}`" if prefix else "Top level"
    out = [f"## {title}", ""]
    doc = (model.__doc__ or "").strip() if model.__doc__ != BaseModel.__doc__ else ""
    if doc and model is not config.Config:
        out += [" ".join(doc.split()), ""]
    out += ["| key | type | default | notes |", "| --- | --- | --- | --- |"]
    nested = []
    for name, field in model.model_fields.items():
        if is_section(field.annotation):
            nested.append((name, field.annotation))
            continue
        default = json.dumps(field.default)
        note = notes.get((model.__name__, name), "").replace("|", "\\|")
        kind = " ".join([f"`{types.get((model.__name__, name), '')}`", *bounds(field)]).replace("|", "\\|")
        out.append(f"| `{prefix + '.' if prefix else ''}{name}` | {kind} | `{default}` | {note} |")
    out.append("")
    for name, sub in nested:
        out += section(sub, f"{prefix}.{name}" if prefix else name, notes, types)
    return out


def reference() -> str:
    return "\n".join([HEADER, *section(config.Config, "", source_notes(), annotations())]).rstrip() + "\n"


if __name__ == "__main__":
    print(reference(), end="")
