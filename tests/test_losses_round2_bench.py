"""benchmarks/losses_round2.py: each new loss runs with its recipe's trainer section over the default config,
repeat r with seed r, and an existing report is topped up. The runs are replaced by a stand-in (each is a
whole training run); the recipes' own loading is tested in test_losses_extra.py."""
import importlib.util
import json
from pathlib import Path

import pytest

from rlsys.config import read_yaml_mapping
from rlsys.startup import load_config

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "losses_round2.py"


@pytest.fixture()
def bench():
    spec = importlib.util.spec_from_file_location("losses_round2", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("loss", ["cispo", "gmpo", "clip_cov", "kl_cov"])
def test_each_loss_runs_its_recipe_over_the_default_config(bench, loss):
    recipe = load_config(bench.RECIPES / f"{loss}.yaml").trainer
    cfg = load_config(None, bench.recipe_overrides(loss))
    keys = read_yaml_mapping(bench.RECIPES / f"{loss}.yaml")[0]["trainer"]
    assert {k: getattr(cfg.trainer, k) for k in keys} == {k: getattr(recipe, k) for k in keys}
    assert cfg.trainer.loss == loss
    assert cfg.model.warm_start.steps == load_config(None).model.warm_start.steps  # the default task's model
    assert bench.recipe_overrides("dapo") == []


def test_repeats_run_one_seed_each_and_a_rerun_tops_up(bench, tmp_path, monkeypatch):
    calls, out = [], tmp_path / "round2.json"

    def run_loss(loss, seed, steps, out_dir):
        calls.append((loss, seed))
        return {"seed": seed, "initial_accuracy": 0.1, "final_accuracy": 0.2 + 0.02 * seed,
                "final_accuracy_se": 0.01, "samples": 128 * steps, "wall_s": 1.0}
    monkeypatch.setattr(bench, "run_loss", run_loss)
    assert bench.main(["--steps", "4", "--repeats", "2", "--losses", "dapo,cispo", "--output", str(out)]) == 0
    assert calls == [("dapo", 0), ("cispo", 0), ("dapo", 1), ("cispo", 1)]
    calls.clear()
    assert bench.main(["--steps", "4", "--repeats", "2", "--losses", "dapo,cispo", "--output", str(out)]) == 0
    assert calls == []
    report = json.loads(out.read_text())
    assert f"--steps 4 --repeats 2 --output {out}" in report["command"]
    assert len(report["machines"]) == 1  # the second invocation ran nothing, so wrote nothing
    cell = report["results"]["cispo"]
    assert cell["n"] == 2 and cell["final_accuracy"] == pytest.approx(0.21)
    assert cell["final_accuracy_se"] == pytest.approx(0.01)  # the spread's 0.01 and the eval's 0.01


def test_each_feature_of_round_four_loads_over_the_default_config(bench):
    features = {name: load_config(None, bench.recipe_overrides(name)) for name in bench.FEATURES}
    assert features["cosine_warmup"].trainer.lr_schedule == "cosine"
    assert features["ppo_epochs2"].trainer.ppo_epochs == 2
    assert features["weighted_format"].reward.weights == [1.0, 0.2]
    assert features["reward_model"].reward.names == ["exact_match", "reward_model"]
    kl = features["kl_token_reinforce_pp"].trainer
    assert (kl.advantage, kl.kl.in_reward, kl.kl.reward_level) == ("reinforce_pp", True, "token")
    assert {f.trainer.loss for name, f in features.items() if name != "kl_token_reinforce_pp"} == {"dapo"}
    assert bench.recipe_overrides("kl_token_reinforce_pp")[:-1] == bench.recipe_overrides("reinforce_pp")


def test_the_built_reward_model_loads_and_scores_texts_apart(bench, tmp_path):
    from rlsys.config import RewardModelConfig
    from rlsys.reward.model import RewardModel

    bench.build_reward_model(tmp_path / "rm")
    scores = RewardModel(RewardModelConfig(path=str(tmp_path / "rm"))).score([("What is 2+3? ", "5"), ("q", "6\n7")])
    assert len(scores) == 2 and all(abs(s) < 10 for s in scores) and scores[0] != scores[1]


def test_each_loss_is_paired_with_dapo_by_seed(bench):
    runs = lambda accs, step_s: [{"seed": s, "final_accuracy": a, "step_time_s": step_s}  # noqa: E731
                                 for s, a in enumerate(accs)]
    results = {"dapo": {"runs": runs([0.20, 0.22, 0.24], 1.0)},
               "ppo_epochs2": {"runs": runs([0.21, 0.24, 0.27], 2.0)},
               "late": {"runs": runs([0.30], 0.5)}}  # one seed so far: a difference, no interval
    bench.versus_dapo(results)
    versus = results["ppo_epochs2"]["final_accuracy_vs_dapo"]
    half = 4.303 * 0.01 / 3 ** 0.5  # t(2) x the differences' (0.01, 0.02, 0.03) standard error
    assert versus["diff"] == pytest.approx(0.02) and versus["pairs"] == 3
    assert versus["ci95"] == pytest.approx([0.02 - half, 0.02 + half])
    assert results["ppo_epochs2"]["step_time_dapo_over_this"] == pytest.approx(0.5)
    assert results["late"]["final_accuracy_vs_dapo"] == {"diff": pytest.approx(0.10), "ci95": None, "pairs": 1}
    assert "final_accuracy_vs_dapo" not in results["dapo"]
