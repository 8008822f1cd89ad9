"""benchmarks/warm_start_cpu_kernels.py: each build in its own process and cache, its fingerprint reported."""
import importlib.util
import json
import re
from pathlib import Path

from helpers import SMALL_MODEL_OVERRIDES

ROOT = Path(__file__).resolve().parent.parent


def test_two_builds_with_the_same_kernels_give_the_same_weights(tmp_path):
    spec = importlib.util.spec_from_file_location("kernels", ROOT / "benchmarks" / "warm_start_cpu_kernels.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    out = tmp_path / "report.json"
    small = [*SMALL_MODEL_OVERRIDES, "model.warm_start.steps=3", "model.warm_start.batch_size=8", "data.train_size=40",
             "data.eval_size=4"]
    assert script.main(["--config", str(ROOT / "configs" / "tiny.yaml"), "--kernels", "default,default",
                        "--output", str(out), *small]) == 0
    builds = json.loads(out.read_text())["builds"]
    assert [b["kernels"] for b in builds] == ["default", "default"] and builds[0]["capability"]
    assert re.fullmatch(r"[0-9a-f]{16}", builds[0]["fingerprint"])
    assert builds[0]["fingerprint"] == builds[1]["fingerprint"]  # repeatable on one machine: nothing left to chance
    assert builds[0]["cache_key"] == builds[1]["cache_key"] and 0 <= builds[0]["eval_greedy_accuracy"] <= 1
