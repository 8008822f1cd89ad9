"""benchmarks/loss_sweep.py: repeat r runs seed r, an existing report is topped up rather than redone, and a
cell keeps its runs. The runs are replaced by a stand-in (each is a whole training run); the friction and
async paths they drive have live tests, and the error over repeats its own in test_bench.py."""
import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "loss_sweep.py"


@pytest.fixture()
def sweep():
    spec = importlib.util.spec_from_file_location("loss_sweep", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def fake_run(calls):
    def run_cell(condition, loss, seed, steps, out_dir):
        calls.append((condition, loss, seed))
        return {"seed": seed, "eval_every": steps, "initial_accuracy": 0.1, "final_accuracy": 0.2 + 0.01 * seed,
                "final_accuracy_se": 0.01, "samples": 128 * steps, "wall_s": 1.0, "staleness_mean": None}
    return run_cell


def test_repeats_run_one_seed_each_and_a_rerun_tops_up(sweep, tmp_path, monkeypatch):
    calls, out = [], tmp_path / "sweep.json"
    monkeypatch.setattr(sweep, "run_cell", fake_run(calls))
    assert sweep.main(["--steps", "4", "--repeats", "2", "--conditions", "eta1,all", "--output", str(out)]) == 0
    cells = [("eta1", loss) for loss in sweep.GRID["eta1"]] + [("all", loss) for loss in sweep.GRID["all"]]
    assert calls == [(c, loss, seed) for seed in (0, 1) for c, loss in cells]  # seed outer, every cell once per seed

    calls.clear()
    assert sweep.main(["--steps", "4", "--repeats", "3", "--conditions", "eta1,all", "--output", str(out)]) == 0
    assert calls == [(c, loss, 2) for c, loss in cells]  # only the seed each cell lacks
    report = json.loads(out.read_text())
    assert [r["seed"] for r in report["results"]["all/dg"]["runs"]] == [0, 1, 2]
    assert len(report["machines"]) == 2
    with pytest.raises(SystemExit, match="not --steps 5"):  # runs of another length never join a cell
        sweep.main(["--steps", "5", "--repeats", "4", "--conditions", "eta1", "--output", str(out)])


def test_a_cell_keeps_its_runs_their_mean_and_its_staleness(sweep):
    runs = [{"final_accuracy": a, "final_accuracy_se": 0.01, "staleness_mean": s}
            for a, s in ((0.2, 1.0), (0.3, None), (0.25, 3.0))]
    cell = sweep.cell_summary(runs)
    assert cell["runs"] == runs and cell["n"] == 3 and cell["final_accuracy_range"] == [0.2, 0.3]
    assert cell["final_accuracy"] == pytest.approx(0.25) and cell["final_accuracy_se"] == pytest.approx(0.05 / 3 ** 0.5)
    assert cell["staleness_mean"] == pytest.approx(2.0)  # a run that did not record it does not count as 0
