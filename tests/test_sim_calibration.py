"""benchmarks/sim_calibration.py on a reduced run: the JSON has the issue's schema (figures are not checked)."""
import importlib.util
import json
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "sim_calibration.py"


def test_quick_calibration_writes_the_issue_schema(tmp_path, monkeypatch):
    spec = importlib.util.spec_from_file_location("sim_calibration", SCRIPT)
    calibration = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "sim_calibration", calibration)  # its parts go to worker processes by name
    spec.loader.exec_module(calibration)
    out = tmp_path / "sub" / "calibration.json"
    assert calibration.main(["--quick", "--output", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["rows"] and all({"name", "published", "simulated", "ratio"} <= set(r) for r in report["rows"])
    assert all("note" in r for r in report["rows"] if not r["within"])  # every miss says why
    best = report["best_128"]
    assert set(best) == {"schedule", "speedup_vs_sync"} and best["schedule"] != "veRL-sync"
    found = report["search_128"]
    screened, ranked = found["screened"], found["ranked"]
    assert len(screened) == 1 + 3 * 2 and {e["schedule"] for e in ranked} <= {e["schedule"] for e in screened}
    for table in (screened, ranked):
        assert [e["speedup_vs_sync"] for e in table] == sorted((e["speedup_vs_sync"] for e in table), reverse=True)
    assert best == next({"schedule": e["schedule"], "speedup_vs_sync": e["speedup_vs_sync"]} for e in ranked
                        if e["schedule"] != "veRL-sync" and e["complete"] and e["equal_samples"])
    reference = next(e["samples_per_step"] for e in screened if e["schedule"] == "veRL-sync")
    assert all(e["equal_samples"] == (abs(e["samples_per_step"] - reference) <= 0.05 * reference) for e in screened)
    assert {v["schedule"] for v in found["sagc"]} == {"sync", "tail", "async-eta1-T32"}
    assert found["config"] == "qwen32b_32k" and report["search_128_16k"]["config"] == "qwen14b_16k"
    hits = report["hit_rate"]  # predictions only: neither fitted rows nor rows equal to another by construction
    assert hits["predicted"] == sum(not r["fitted"] and "same_as" not in r for r in report["rows"])
    assert any(r.get("same_as", "").startswith("the normalisation") for r in report["rows"])
    assert {"cpus", "python", "load_average_at_start"} <= set(report["machine"]) and report["wall_s"] > 0
