"""benchmarks/sim_calibration.py on a reduced run: the JSON has the issue's schema (figures are not checked)."""
import importlib.util
import json
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "sim_calibration.py"


def test_quick_calibration_writes_the_issue_schema(tmp_path):
    spec = importlib.util.spec_from_file_location("sim_calibration", SCRIPT)
    calibration = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(calibration)
    out = tmp_path / "sub" / "calibration.json"
    assert calibration.main(["--quick", "--output", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["rows"] and all({"name", "published", "simulated", "ratio"} <= set(r) for r in report["rows"])
    assert all("note" in r for r in report["rows"] if not r["within"])  # every miss says why
    best = report["best_128"]
    assert set(best) == {"schedule", "speedup_vs_sync"} and best["schedule"] != "veRL-sync"
    ranked = report["search_128"]["ranked"]
    assert [e["speedup_vs_sync"] for e in ranked] == sorted((e["speedup_vs_sync"] for e in ranked), reverse=True)
    assert ranked[0]["schedule"] == best["schedule"] and len(ranked) == 1 + 3 * 2
    assert {v["schedule"] for v in report["search_128"]["sagc"]} == {"sync", "tail", "async-eta1"}
    assert {"cpus", "python", "load_average_at_start"} <= set(report["machine"]) and report["wall_s"] > 0
