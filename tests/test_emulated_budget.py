"""benchmarks/emulated_budget.py's results file: processes filling other seeds of one matrix keep each other's runs."""
import importlib.util
import json
import multiprocessing
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def budget_module():
    spec = importlib.util.spec_from_file_location("emulated_budget", ROOT / "benchmarks" / "emulated_budget.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# real runs, one per seed: sync's five on cot_sum at two modelled GPUs
STORED = json.loads((ROOT / "benchmarks" / "results" / "emulated_budget_longcot_2gpu.json").read_text())["runs"]["sync"]


def record_seeds(path: str, seeds: list[int]) -> None:
    module = budget_module()
    for seed in seeds:
        module.record(Path(path), {"gpus": 2}, "sync", next(r for r in STORED if r["seed"] == seed), "cmd")


def test_two_processes_recording_other_seeds_of_one_file_keep_every_run(tmp_path):
    path = tmp_path / "emulated_budget_x_2gpu.json"
    ctx = multiprocessing.get_context("spawn")
    writers = [ctx.Process(target=record_seeds, args=(str(path), seeds)) for seeds in ([0, 2, 4], [1, 3])]
    for w in writers:
        w.start()
    for w in writers:
        w.join(timeout=120)
        assert w.exitcode == 0
    report = json.loads(path.read_text())
    assert sorted(r["seed"] for r in report["runs"]["sync"]) == [0, 1, 2, 3, 4]
    assert report["results"]["sync"]["repeats"] == 5
