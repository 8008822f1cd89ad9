"""trainer.lr_schedule: the rate at every step against transformers' and torch's schedulers and veRL's formulas, taken
once per train step, logged, and resumed mid-warm-up from a real checkpoint (torch and DeepSpeed)."""
import math

import pytest
import torch
from test_trainer import SCORING, make_groups, max_diff, model_dir, run_steps, trainer_config  # noqa: F401

from rlsys.config import Config, ConfigError
from rlsys.startup import load_config
from rlsys.trainer.backend import TorchBackend
from rlsys.trainer.batching import build_samples, plan_step
from rlsys.trainer.schedule import lr_scheduler
from rlsys.trainer.worker import TrainerGroup

from helpers import train_step, trainer_weights

TOTAL, LR = 12, 1e-3


def rates(scheduler, steps: int = TOTAL) -> list[float]:
    """The rate of each step, stepping after each as the trainer does."""
    out = []
    for _ in range(steps):
        out.append(scheduler.get_last_lr()[0])
        scheduler.optimizer.step()
        scheduler.step()
    return out


def optimizer() -> torch.optim.Optimizer:
    return torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=LR)


def ours(**fields) -> list[float]:
    return rates(lr_scheduler(optimizer(), trainer_config(lr=LR, total_steps=TOTAL, **fields)))


def verl_cosine(step: int, warmup: int, floor: float, total: int = TOTAL) -> float:
    """veRL's get_cosine_schedule_with_warmup (num_cycles 0.5, its warm-up from min_lr_ratio), written out."""
    if step < warmup:
        return LR * (floor + (1 - floor) * step / max(1, warmup))
    progress = (step - warmup) / max(1, total - warmup)
    return LR * max(floor, math.cos(math.pi * 0.5 * 2.0 * progress) * (1 - floor) * 0.5 + (1 + floor) * 0.5)


def verl_constant(step: int, warmup: int) -> float:
    return LR * (step / max(1, warmup) if step < warmup else 1.0)


@pytest.mark.parametrize("schedule", ["constant", "cosine", "linear"])
@pytest.mark.parametrize("warmup", [0, 1, 4])
def test_every_step_equals_transformers_schedulers(schedule, warmup):
    transformers = pytest.importorskip("transformers")
    make = {"constant": lambda o: transformers.get_constant_schedule_with_warmup(o, warmup),
            "cosine": lambda o: transformers.get_cosine_schedule_with_warmup(o, warmup, TOTAL),
            "linear": lambda o: transformers.get_linear_schedule_with_warmup(o, warmup, TOTAL)}[schedule]
    assert ours(lr_schedule=schedule, lr_warmup_steps=warmup) == pytest.approx(rates(make(optimizer())), abs=1e-15)


@pytest.mark.parametrize("warmup, floor", [(0, 0.0), (3, 0.0), (3, 0.1), (5, 0.5)])
def test_cosine_equals_verl_and_torch_cosine_annealing_to_the_floor(warmup, floor):
    found = ours(lr_schedule="cosine", lr_warmup_steps=warmup, min_lr_ratio=floor)
    assert found == pytest.approx([verl_cosine(s, warmup, floor) for s in range(TOTAL)], abs=1e-15)
    assert found[0] == pytest.approx((floor if warmup else 1.0) * LR) and min(found) >= floor * LR - 1e-15
    # After the warm-up: torch's own cosine annealing from lr to the floor over the remaining steps.
    annealing = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer(), T_max=TOTAL - warmup, eta_min=floor * LR)
    assert found[warmup:] == pytest.approx(rates(annealing, TOTAL - warmup), rel=1e-9)


def test_constant_warmup_equals_verl_and_a_ratio_rounds_down_as_verl():
    assert ours(lr_warmup_steps=5) == pytest.approx([verl_constant(s, 5) for s in range(TOTAL)], abs=1e-15)
    assert ours(lr_warmup_ratio=0.45) == ours(lr_warmup_steps=5)  # int(0.45 x 12) = 5
    assert ours() == [LR] * TOTAL  # no warm-up: the constant rate from the first step


@pytest.mark.parametrize("overrides, field", [
    (["trainer.lr_warmup_steps=2", "trainer.lr_warmup_ratio=0.1"], "trainer.lr_warmup_ratio"),
    (["trainer.min_lr_ratio=0.1"], "trainer.min_lr_ratio"),
    (["trainer.advantage=gae", "trainer.critic.lr_schedule=linear", "trainer.critic.min_lr_ratio=0.1"],
     "trainer.critic.min_lr_ratio"),
    (["trainer.lr_schedule=step"], "trainer.lr_schedule"),
])
def test_contradicting_schedule_fields_are_named(overrides, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        load_config(None, overrides)


SCHEDULED = dict(lr_schedule="cosine", lr_warmup_steps=4, min_lr_ratio=0.1, total_steps=8)


def torch_steps(model_dir, seeds, save_before=None, folder=None, load=None,  # noqa: F811
                **overrides) -> tuple[list[dict], list[dict]]:
    """Train steps through `train_mini_batches` (where the schedule steps) on a torch backend; saved into `folder`
    before step `save_before`, or resumed from `load`."""
    backend = TorchBackend(trainer_config(**overrides), model_dir, SCORING)
    if load:
        backend.load(load)
    metrics, weights = [], []
    for i, seed in enumerate(seeds):
        if i == save_before:
            backend.save(folder)
        samples = build_samples(make_groups(seed), "grpo")
        plan = plan_step(samples, 1, backend.cfg.micro_batch_tokens)
        metrics.append(backend.train_mini_batches([(plan[0][0], plan[1])], fresh=False))
        weights.append(backend.state_dict_for_rollout())
    return metrics, weights


def test_each_step_takes_its_rate_and_a_checkpoint_mid_warmup_resumes_the_sequence(model_dir, tmp_path):  # noqa: F811
    seeds = [0, 1, 2, 3, 4, 5]
    metrics, weights = torch_steps(model_dir, seeds, 2, str(tmp_path / "ckpt"), **SCHEDULED)
    expected = [verl_cosine(s, 4, 0.1, total=8) * 1e-2 / LR for s in range(len(seeds))]  # trainer_config's lr is 1e-2
    assert [m["lr"] for m in metrics] == pytest.approx(expected, abs=1e-15)
    # The rate held at the warm-up's first value, 0.1 x lr: the same first update, another second one.
    _, held = torch_steps(model_dir, [0, 1], lr=1e-3)
    assert max_diff(held[0], weights[0]) == 0.0 and max_diff(held[1], weights[1]) > 1e-6
    # Saved two steps into the four of warm-up: the resumed run takes the same rates and weights.
    resumed, resumed_weights = torch_steps(model_dir, seeds[2:], load=str(tmp_path / "ckpt"), **SCHEDULED)
    assert [m["lr"] for m in resumed] == [m["lr"] for m in metrics[2:]]
    assert max_diff(resumed_weights[-1], weights[-1]) == 0.0


def test_warmup_from_zero_leaves_the_first_update_still(model_dir):  # noqa: F811
    initial = TorchBackend(trainer_config(), model_dir, SCORING).state_dict_for_rollout()
    metrics, weights = torch_steps(model_dir, [0, 1], lr_warmup_steps=2)
    assert [m["lr"] for m in metrics] == [0.0, 0.5e-2]
    assert max_diff(weights[0], initial) == 0.0 and max_diff(weights[1], initial) > 0


@pytest.mark.slow
def test_deepspeed_takes_the_rate_and_resumes_mid_warmup(ray_cluster, model_dir, tmp_path):  # noqa: F811
    def group():
        cfg = trainer_config(backend="deepspeed", world_size=2, zero_stage=2, lr_warmup_steps=3, total_steps=6)
        return TrainerGroup(Config(trainer=cfg), model_dir, SCORING)

    trainer = group()
    try:
        initial = trainer_weights(trainer)
        metrics, weights = run_steps(trainer, [0, 1, 2], str(tmp_path / "ckpt"))
    finally:
        trainer.shutdown()
    assert [m["lr"] for m in metrics] == pytest.approx([0.0, 1e-2 / 3, 2e-2 / 3], abs=1e-15)
    assert max_diff(weights[0], initial) == 0.0 and max_diff(weights[1], initial) > 0  # the engine took rate 0
    trainer = group()
    try:
        trainer.load(str(tmp_path / "ckpt"))  # two steps into the warm-up
        resumed = train_step(trainer, make_groups(2))
        assert resumed["lr"] == metrics[2]["lr"]
        assert max_diff(trainer_weights(trainer), weights[2]) == 0.0
    finally:
        trainer.shutdown()
