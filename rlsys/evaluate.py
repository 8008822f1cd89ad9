"""Eval accuracy on the held-out split, scored by the reward pool (a prompt's sample counts as solved
when its reward exceeds 0.5):
  eval/accuracy         mean over k samples per prompt at the rollout temperature (avg@k, as DAPO
                        reports): the policy RL trains, and what it is measured by;
  eval/greedy_accuracy  one greedy sample per prompt, when `rollout.eval_greedy` is on;
  <metric>_se           its standard error: prompts are the sampling unit (their k samples are not
                        independent), so it is the standard deviation of the per-prompt means over sqrt(n).
Seeds are fixed per prompt and sample, so two evaluations of the same weights agree exactly (on engines
registered with seeded_eval, the built-in one; vLLM's sampled eval is unseeded, its greedy eval exact)."""
from __future__ import annotations

import math
import statistics
from pathlib import Path

from rlsys.errors import UserError
from rlsys.logger import waiting
from rlsys.rollout.registry import engine_entry
from rlsys.types import Completion, Prompt, Request, SamplingParams, env_sample, reward_item


class Evaluation:
    """One evaluation's requests, tagged by their ids, and the collector of their rewards: a driver may run it
    beside other work, routing to it what comes back for the ids it `owns`."""

    def __init__(self, tokenizer, prompts, rollout_cfg):
        r = rollout_cfg
        temperature = r.temperature if r.eval_temperature is None else r.eval_temperature
        runs = {"eval/accuracy": (temperature, r.eval_samples if temperature > 0 else 1)}  # greedy: k alike
        if r.eval_greedy and temperature > 0:
            runs["eval/greedy_accuracy"] = (0.0, 1)
        seeded = engine_entry(r.engine).seeded_eval
        prompt_ids = tokenizer([p.text for p in prompts])["input_ids"]
        self.asked: dict[str, tuple[str, Prompt]] = {}  # request id -> (metric, prompt)
        self.requests: list[Request] = []
        for name, (temp, k) in runs.items():
            for i, (p, ids) in enumerate(zip(prompts, prompt_ids)):
                for j in range(k):
                    params = SamplingParams(r.max_new_tokens, temp, r.top_p, seed=i * 1009 + j if seeded else None)
                    self.requests.append(Request(f"{name}/{p.uid}/{j}", p.uid, ids, params, on_clock=False,
                                                 sample=env_sample(p)))
                    self.asked[self.requests[-1].request_id] = (name, p)
        # metric -> prompt uid -> solved flags of its samples, in prompt order whatever order rewards come in:
        # the same sums, so two evaluations of the same weights agree to the last bit
        self.solved = {name: {p.uid: [] for p in prompts} for name in runs}
        self.unscored = len(self.requests)

    def owns(self, request_id: str) -> bool:
        return request_id in self.asked

    def to_score(self, completion: Completion) -> tuple:
        """The reward pool's item for one of its completions."""
        return reward_item(completion, self.asked[completion.request_id][1])

    def add(self, key: str, reward: float) -> None:
        name, prompt = self.asked[key]
        self.solved[name][prompt.uid].append(reward > 0.5)
        self.unscored -= 1

    @property
    def done(self) -> bool:
        return self.unscored == 0

    def progress(self) -> str:
        return f"eval: {len(self.requests) - self.unscored} of {len(self.requests)} samples scored"

    def metrics(self) -> dict[str, float]:
        metrics = {}
        for name, by_prompt in self.solved.items():
            metrics[name], metrics[f"{name}_se"] = mean_and_se([sum(v) / len(v) for v in by_prompt.values()])
        return metrics


def eval_accuracy(rollout, rewards, tokenizer, prompts, rollout_cfg) -> dict[str, float]:
    """Evaluate alone (`rlsys eval`): the engines and the reward pool have no other work. The controller runs
    an `Evaluation` through its own pump instead, beside training's requests."""
    evaluation = Evaluation(tokenizer, prompts, rollout_cfg)
    with waiting(f"eval: generating {len(evaluation.requests)} samples for {len(prompts)} prompts"):
        completions = rollout.generate(evaluation.requests)
    with waiting(f"eval: scoring {len(completions)} samples"):
        for result in rewards.score_all([evaluation.to_score(c) for c in completions]):
            evaluation.add(result.key, result.reward)
    return evaluation.metrics()


def mean_and_se(values: list[float]) -> tuple[float, float]:
    """Mean and its standard error (sample standard deviation over sqrt(n); 0 for fewer than 2 values)."""
    if not values:
        return 0.0, 0.0
    se = statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else 0.0
    return statistics.fmean(values), se


# The run's config inside its export/, so an export copied elsewhere keeps its task: JSON, which is YAML too and
# keeps the export to safetensors and JSON
RUN_CONFIG = "rlsys_config.json"


def resolve_model(path: Path) -> tuple[Path | None, Path | None]:
    """(model dir, run config or None) for a run folder, its export/ folder or any HF model dir.
    A checkpoint folder gives no model dir: its weights load into the run's base model."""
    if (path / "controller.json").exists() and (path / "trainer" / "model.safetensors").exists():
        return None, path.parent.parent / "config.yaml"
    if (path / "config.yaml").exists() and (path / "export" / "config.json").exists():
        return path / "export", path / "config.yaml"
    if (path / "config.json").exists():
        found = [c for c in (path.parent / "config.yaml", path / RUN_CONFIG) if c.exists()]
        return path, found[0] if found else None
    if (path / "config.yaml").exists():  # a run stopped before its end: no export, perhaps a checkpoint
        from rlsys.checkpoint import CheckpointManager

        latest = CheckpointManager(path / "checkpoints").latest()
        raise UserError(f"{path} is a run folder without export/ (it was stopped before its end); "
                        + (f"evaluate its last checkpoint: rlsys eval {latest}" if latest else "it has no checkpoint"))
    raise UserError(f"{path}: expected a run folder with export/, a checkpoints/step_N folder, or a Hugging Face "
                    "model directory (config.json + weights + tokenizer)")


def names_task(overrides: list[str]) -> bool:
    return any(o.startswith("data.task=") for o in overrides)


def resolve_task_model(path: Path, overrides: list[str]) -> tuple[Path | None, Path | None]:
    """resolve_model, refusing a model without its run's config when no data.task is given: the default task would
    be evaluated without a word."""
    model_dir, run_cfg = resolve_model(path)
    if run_cfg is None and not names_task(overrides):
        raise UserError(f"{path} carries no run config (no config.yaml beside it, no {RUN_CONFIG} in it), so its "
                        "task is unknown: name it, e.g. data.task=synthetic, or data.task=files "
                        "data.eval_path=FILE")
    return model_dir, run_cfg


def task_source(path: str, overrides: list[str]) -> str:
    """Which task `rlsys eval PATH OVERRIDES` evaluates and where that comes from (resolve_task_model's refusal)."""
    from rlsys.config import read_config

    _, run_cfg = resolve_task_model(Path(path), overrides)
    task = read_config(run_cfg, overrides)[0].data.task
    return f"task {task!r} (" + ("data.task given" if names_task(overrides) else f"from {run_cfg}") + ")"


def evaluate_path(path: str, overrides: list[str]) -> tuple[dict[str, float], int]:
    from rlsys.cluster import init_ray
    from rlsys.data import load_prompts
    from rlsys.models import load_tokenizer, prepare_model
    from rlsys.reward.pool import RewardPool
    from rlsys.rollout.manager import RolloutManager
    from rlsys.startup import load_config
    from rlsys.tools.schemas import tool_schemas

    checkpoint = Path(path)
    model_dir, run_cfg = resolve_task_model(checkpoint, overrides)
    cfg = load_config(run_cfg, overrides)
    init_ray(cfg.cluster)
    model_dir = model_dir or prepare_model(cfg)
    tokenizer = load_tokenizer(model_dir)
    _, prompts, _ = load_prompts(cfg.data, tokenizer, tool_schemas(cfg.tools))  # the tokenizer renders templates
    with waiting("eval: starting the rollout engine"):
        rollout = RolloutManager.from_config(cfg, model_dir)
    if (checkpoint / "controller.json").exists():
        from safetensors.torch import load_file
        rollout.load_weights(load_file(str(checkpoint / "trainer" / "model.safetensors")), version=1)
    rewards = RewardPool(cfg.reward)
    try:
        return eval_accuracy(rollout, rewards, tokenizer, prompts, cfg.rollout), len(prompts)
    finally:
        rollout.shutdown()
        rewards.shutdown()
