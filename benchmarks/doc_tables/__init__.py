"""The parts every document table shares: the registry benchmarks/readme_tables.py renders from, the results files,
and the cells that tables and prose spell alike (a median with its range, an accuracy ± its error, a difference
± its error, a ratio with its range). One module per kind of measurement registers its tables here."""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # rlsys, when run as a script from anywhere
RESULTS = ROOT / "benchmarks" / "results"
TABLES: dict[str, Callable[[], str]] = {}


def table(name: str):
    def register(fn: Callable[[], str]) -> Callable[[], str]:
        TABLES[name] = fn
        return fn
    return register


def load(name: str) -> dict:
    return json.loads((RESULTS / f"{name}.json").read_text())


def rows(header: list[str], body: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in body]
    return "\n".join(lines) + "\n"


def num(x, digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def spread(r: dict, key: str, digits: int = 3) -> str:
    """A median with its [min, max] over repeats."""
    lo_hi = r.get(f"{key}_spread")
    text = num(r[key], digits)
    return f"{text} [{num(lo_hi[0], digits)}, {num(lo_hi[1], digits)}]" if lo_hi else text


def diff_cell(d: dict, beyond: str = "") -> str:
    """An accuracy difference ± its error, `beyond` appended where it exceeds two of them."""
    return f"{d['diff']:+.3f} ± {d['se']:.3f}" + (beyond if d["beyond_error"] else "")


def ratio_cell(x: float, lo_hi) -> str:
    """A ratio with its [low, high]: a spread over pairs or an interval."""
    return f"{x:.2f}x [{lo_hi[0]:.2f}, {lo_hi[1]:.2f}]"


def acc_se(r: dict) -> str:
    """A final accuracy with its eval standard error."""
    return f"{r['final_accuracy']:.3f} ± {r['final_accuracy_se']:.3f}"


def versus_sync(j: dict, preset: str) -> str:
    """The preset's final accuracy minus sync's, ± the difference's error; starred beyond two of them."""
    d = j["speedup_vs_sync"][preset]["final_accuracy_vs_sync"]
    return "" if preset == "sync" else diff_cell(d, " *")
