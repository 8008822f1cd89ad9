"""Eval accuracy on the held-out split: one greedy (by default) sample per prompt, scored by the reward
pool; a prompt counts as solved when its reward exceeds 0.5."""
from __future__ import annotations

from pathlib import Path

from rlsys.types import Request, SamplingParams


def eval_accuracy(rollout, rewards, tokenizer, prompts, rollout_cfg) -> float:
    params = SamplingParams(rollout_cfg.max_new_tokens, rollout_cfg.eval_temperature, 1.0, seed=0)
    requests = [Request(f"eval/{p.uid}", p.uid, tokenizer(p.text)["input_ids"], params) for p in prompts]
    answers = {r.request_id: p.answer for r, p in zip(requests, prompts)}
    completions = rollout.generate(requests)
    results = rewards.score_all([(c.request_id, c.text, answers[c.request_id], c.num_tokens) for c in completions])
    return sum(r.reward > 0.5 for r in results) / max(len(results), 1)


def resolve_model(path: Path) -> tuple[Path | None, Path | None]:
    """(model dir, run config or None) for a run folder, its export/ folder or any HF model dir.
    A checkpoint folder gives no model dir: its weights load into the run's base model."""
    if (path / "controller.json").exists() and (path / "trainer" / "model.safetensors").exists():
        return None, path.parent.parent / "config.yaml"
    if (path / "config.yaml").exists() and (path / "export" / "config.json").exists():
        return path / "export", path / "config.yaml"
    if (path / "config.json").exists():
        run_cfg = path.parent / "config.yaml"
        return path, run_cfg if run_cfg.exists() else None
    raise FileNotFoundError(f"{path}: expected a run folder with export/, a checkpoints/step_N folder, or a "
                            "Hugging Face model directory (config.json + weights + tokenizer)")


def evaluate_path(path: str, overrides: list[str]) -> tuple[float, int]:
    from rlsys.cluster import init_ray
    from rlsys.config import load_config
    from rlsys.data import filter_long_prompts, load_datasets
    from rlsys.models import load_tokenizer, prepare_model
    from rlsys.reward.pool import RewardPool
    from rlsys.rollout.manager import RolloutManager

    checkpoint = Path(path)
    model_dir, run_cfg = resolve_model(checkpoint)
    cfg = load_config(run_cfg, overrides)
    init_ray(cfg.cluster)
    model_dir = model_dir or prepare_model(cfg)
    tokenizer = load_tokenizer(model_dir)
    _, prompts = load_datasets(cfg.data)
    prompts, _ = filter_long_prompts(prompts, tokenizer, cfg.data.max_prompt_tokens)
    rollout = RolloutManager(str(model_dir), cfg.rollout.num_workers, cfg.rollout.slots,
                             torch_threads=cfg.cluster.torch_threads)
    if (checkpoint / "controller.json").exists():
        from safetensors.torch import load_file
        rollout.update_weights(load_file(str(checkpoint / "trainer" / "model.safetensors")), version=1)
    rewards = RewardPool(cfg.reward)
    try:
        return eval_accuracy(rollout, rewards, tokenizer, prompts, cfg.rollout), len(prompts)
    finally:
        rollout.shutdown()
        rewards.shutdown()
