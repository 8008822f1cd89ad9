"""Issue 51, item 2: PPO with a value model (trainer.advantage=gae). GAE against a case computed by hand, the value
loss against a transcription of veRL's compute_value_loss (values and gradients, micro-batches summing to the step),
the critic on DeepSpeed ranks (its loss falls, the warm-up leaves the policy alone, resume is exact, the export
leaves it out), a live async run, and the combinations refused."""
import pytest
import torch
from safetensors.torch import load_file

from rlsys.config import ConfigError, TrainerConfig
from rlsys.startup import load_config
from rlsys.trainer.batching import TrainSample, build_samples
from rlsys.trainer.critic import CRITIC_DIR, gae, set_advantages, value_loss

from test_losses_round3 import masked_mean, masked_whiten
from test_trainer import SCORING, make_groups, model_dir, trainer_config  # noqa: F401

GAMMA, LAM = 0.9, 0.8


# --- GAE ------------------------------------------------------------------------------------------------------------
# Three responses of 3, 5 and 1 tokens; the second's third token is a tool's (mask 0), which GAE steps over.
VALUES = [[0.5, -0.2, 0.3], [0.1, 0.4, 9.0, -0.5, 0.2], [0.25]]
MASKS = [[1, 1, 1], [1, 1, 0, 1, 1], [1]]
REWARDS = [1.0, -1.0, 0.5]  # on each response's last token
# By hand, gamma 0.9, lam 0.8 (gamma lam 0.72), from the last token back: delta_t = r_t + 0.9 V_next - V_t,
# A_t = delta_t + 0.72 A_next; the tool token is skipped, so the token before it takes the value and advantage
# after it.
#   first:  A2 = 1 - 0.3 = 0.7;  A1 = (0.27 + 0.2) + 0.72 x 0.7 = 0.974;  A0 = (-0.18 - 0.5) + 0.72 x 0.974 = 0.02128
#   second: A4 = -1 - 0.2 = -1.2;  A3 = (0.18 + 0.5) - 0.864 = -0.184;  A1 = (-0.45 - 0.4) + 0.72 x -0.184 = -0.98248;
#           A0 = (0.36 - 0.1) + 0.72 x -0.98248 = -0.4473856
#   third:  A0 = 0.5 - 0.25 = 0.25
BY_HAND = [[0.02128, 0.974, 0.7], [-0.4473856, -0.98248, None, -0.184, -1.2], [0.25]]


def padded(rows, fill=0.0):
    width = max(len(r) for r in rows)
    return torch.tensor([list(r) + [fill] * (width - len(r)) for r in rows], dtype=torch.float64)


def test_gae_equals_the_case_computed_by_hand():
    rewards = padded([[0.0] * (len(v) - 1) + [r] for v, r in zip(VALUES, REWARDS)])
    values, mask = padded(VALUES), padded(MASKS)
    advantages, returns = gae(rewards, values, mask, GAMMA, LAM)
    for row, want in enumerate(BY_HAND):
        for t, a in enumerate(want):
            if a is not None:
                assert advantages[row, t].item() == pytest.approx(a, abs=1e-12)
                assert returns[row, t].item() == pytest.approx(a + VALUES[row][t], abs=1e-12)


def test_a_steps_advantages_are_gae_whitened_over_every_token_as_veRL():
    samples = [TrainSample([1, 2] + [3] * len(v), 2, 0.0, [-1.0] * len(v), [0] * len(v), mask=m, reward=r)
               for v, m, r in zip(VALUES, MASKS, REWARDS)]
    set_advantages(samples, VALUES, TrainerConfig(advantage="gae", gae={"gamma": GAMMA, "lam": LAM}).gae,
                   lambda sums: sums)
    mask = padded(MASKS)
    want = masked_whiten(padded([[a or 0.0 for a in row] for row in BY_HAND]), mask)  # veRL's, transcribed
    for row, sample in enumerate(samples):
        for t, on in enumerate(MASKS[row]):
            if on:
                assert sample.token_advantages[t] == pytest.approx(want[row, t].item(), rel=1e-9)
        assert sample.returns[-1] == pytest.approx(REWARDS[row])  # gamma^0: the last token's return is its reward
        assert sample.values == VALUES[row]


def test_the_reward_lands_on_the_last_trained_token():
    """A response ending in a tool's tokens: the reward is the model's last token's (veRL's last valid token)."""
    sample = TrainSample([1, 2, 3, 3, 3], 2, 0.0, [-1.0] * 3, [0] * 3, mask=[1, 1, 0], reward=2.0)
    set_advantages([sample], [[0.0, 0.0, 0.0]], TrainerConfig(advantage="gae").gae, lambda sums: sums)
    assert sample.returns[:2] == [2.0, 2.0]  # gamma 1, lam 1, zero values: every trained token's return is 2


def test_build_samples_carries_each_samples_reward_for_gae():
    groups = make_groups(0)
    samples = build_samples(groups, "gae")
    assert [s.reward for s in samples] == [s.reward for g in groups for s in g.samples if s.completion.token_ids]
    assert all(s.advantage == 0.0 for s in samples)


# --- the value loss, against veRL's -----------------------------------------------------------------------------
def verl_value_loss(vpreds, returns, values, mask, cliprange_value):
    """veRL's compute_value_loss with loss_agg_mode token-mean (dp 1), and its clip fraction."""
    vpredclipped = torch.max(torch.min(vpreds, values + cliprange_value), values - cliprange_value)  # clip_by_value
    vf_losses1 = (vpreds - returns) ** 2
    vf_losses2 = (vpredclipped - returns) ** 2
    clipped_vf_losses = torch.max(vf_losses1, vf_losses2)
    return 0.5 * masked_mean(clipped_vf_losses, mask), masked_mean(torch.gt(vf_losses2, vf_losses1).float(), mask)


def test_the_value_loss_and_its_clip_match_veRL_in_value_and_gradient():
    torch.manual_seed(0)
    mask = padded([[1] * 7, [1, 1, 0, 1], [1] * 2, [1] * 5])
    old = torch.randn(mask.shape, dtype=torch.float64)
    returns = torch.randn(mask.shape, dtype=torch.float64)
    moved = old + 1.5 * torch.randn(mask.shape, dtype=torch.float64)  # many beyond the 0.5 clip, on both sides
    theirs_at, ours_at = moved.clone().requires_grad_(), moved.clone().requires_grad_()
    theirs, fraction = verl_value_loss(theirs_at, returns, old, mask, 0.5)
    theirs.backward()
    tokens = mask.sum().item()
    ours, stats = 0.0, {"value_clip_fraction": 0.0}
    for rows in (slice(0, 2), slice(2, 4)):  # two micro-batches, each its share of the step's tokens
        part, part_stats = value_loss(ours_at[rows], returns[rows], old[rows], mask[rows], 0.5, tokens)
        part.backward()
        ours += part.item()
        stats["value_clip_fraction"] += part_stats["value_clip_fraction"]
    assert 0.2 < fraction.item() < 0.8  # the clip decides some tokens and not others
    assert ours == pytest.approx(theirs.item(), rel=1e-7)  # veRL's masked_mean adds 1e-8 to the count
    assert stats["value_clip_fraction"] == pytest.approx(fraction.item(), rel=1e-7)
    assert torch.allclose(ours_at.grad, theirs_at.grad, rtol=1e-7, atol=1e-12)
    assert (ours_at.grad[mask == 0] == 0).all()


# --- the critic on DeepSpeed ranks ----------------------------------------------------------------------------------
def critic_weights(trainer) -> dict:
    """Rank 0's full critic weights; every rank takes part."""
    import ray

    def weights(worker):
        return worker.critic.state_dict_for_rollout(keep=worker.rank == 0)
    return ray.get([w.__ray_call__.remote(weights) for w in trainer.workers])[0]


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


def torch_ppo_steps(model_dir, seeds, **overrides) -> list[dict]:  # noqa: F811
    """The same steps on one torch rank, as TrainerGroup plans them (its mini-batches, micro-batch counts)."""
    from rlsys.trainer.backend import TorchBackend
    from rlsys.trainer.batching import pack_micro_batches, plan_step, split_mini_batches
    from rlsys.trainer.critic import TorchCritic, critic_config, train_ppo_step

    cfg = trainer_config(**overrides)
    actor, critic = TorchBackend(cfg, model_dir, SCORING), TorchCritic(critic_config(cfg), model_dir, SCORING)
    out = []
    for seed in seeds:
        samples = build_samples(make_groups(seed), "gae")
        parts = [(per_rank[0], totals) for per_rank, totals in
                 (plan_step(part, 1, cfg.micro_batch_tokens) for part in split_mini_batches(samples, cfg.mini_batches))]
        out.append(train_ppo_step(actor, critic, samples, parts, parts, False, 0, None,
                                  len(pack_micro_batches(samples, cfg.micro_batch_tokens))))
    return out


PPO = dict(backend="deepspeed", world_size=2, advantage="gae", mini_batches=2,
           critic={"lr": 1e-3, "warmup_steps": 3}, gae={"gamma": 0.9, "lam": 0.95})
COMPARED = ("value_loss", "value_clip_fraction", "critic_grad_norm", "loss", "grad_norm")


@pytest.mark.slow
@pytest.mark.parametrize("zero_stage", [2, 3])
def test_the_critic_learns_after_its_warm_up_resumes_exactly_and_stays_out_of_the_export(
        model_dir, ray_cluster, tmp_path, zero_stage):  # noqa: F811
    from helpers import train_step, trainer_weights

    from rlsys.config import Config
    from rlsys.trainer.worker import TrainerGroup

    def group():
        return TrainerGroup(Config(trainer=trainer_config(zero_stage=zero_stage, **PPO)), model_dir, SCORING)

    trainer = group()
    try:
        initial = trainer_weights(trainer)
        steps = [train_step(trainer, make_groups(0))]
        trainer.save(str(tmp_path / "ckpt"))  # inside the warm-up
        steps += [train_step(trainer, make_groups(seed)) for seed in (1, 2)]
        after_resumed_steps = trainer_weights(trainer), critic_weights(trainer)
        steps += [train_step(trainer, make_groups(0)) for _ in range(4)]
        trainer.export_hf(str(tmp_path / "export"), model_dir)
    finally:
        trainer.shutdown()
    # Two ranks whiten over the whole step as one does: the same steps on one torch rank.
    alone = torch_ppo_steps(model_dir, (0, 1, 2), **{**PPO, "backend": "torch", "world_size": 1})
    for ours, theirs in zip(steps[:3], alone):
        for key in COMPARED:
            assert (key in ours) == (key in theirs)
            if key in ours:
                assert ours[key] == pytest.approx(theirs[key], rel=1e-4, abs=1e-6), key
    # Warm-up of 3, as veRL counts it (from step 1): two steps train the critic alone; the third trains the policy too.
    assert "loss" not in steps[0] and "loss" not in steps[1] and "loss" in steps[2]
    assert all(s["value_loss"] > 0 and s["critic_grad_norm"] > 0 for s in steps)
    # The critic's loss falls on a batch it has seen (steps 0, 3, 4, 5, 6 are all make_groups(0)).
    assert steps[-1]["value_loss"] < 0.5 * steps[0]["value_loss"], [s["value_loss"] for s in steps]

    trainer = group()
    try:
        trainer.load(str(tmp_path / "ckpt"))
        assert max_diff(trainer_weights(trainer), initial) == 0.0  # the policy untouched by the warm-up
        resumed = [train_step(trainer, make_groups(seed)) for seed in (1, 2)]
        assert "loss" not in resumed[0] and "loss" in resumed[1]  # the warm-up's count went on from the checkpoint
        assert max_diff(trainer_weights(trainer), after_resumed_steps[0]) == 0.0
        assert max_diff(critic_weights(trainer), after_resumed_steps[1]) == 0.0
    finally:
        trainer.shutdown()
    for ours, theirs in zip(resumed, steps[1:3]):
        assert {k: ours[k] for k in COMPARED if k in theirs} == {k: theirs[k] for k in COMPARED if k in theirs}

    exported = load_file(str(tmp_path / "export" / "model.safetensors"))
    assert set(exported) <= set(load_file(str(tmp_path / "ckpt" / "model.safetensors")))  # the policy's alone
    assert not any(k.startswith("score") for k in exported)  # the critic's head is not in the export
    assert "score.weight" in load_file(str(tmp_path / "ckpt" / CRITIC_DIR / "model.safetensors"))
    assert not (tmp_path / "export" / CRITIC_DIR).exists()


# --- a live run under the asynchronous scheduler ----------------------------------------------------------------
def test_ppo_runs_under_async_with_stale_samples(tmp_path, ray_cluster):
    from helpers import SMALL
    from test_end_to_end import rows

    from rlsys.cli import main
    from rlsys.config import DEFAULT_CONFIG

    out = tmp_path / "run"
    assert main(["train", str(DEFAULT_CONFIG), "trainer.total_steps=3", f"output_dir={out}", "control.eval_every=0",
                 "control.save_every=0", "control.scheduler=async", "trainer.advantage=gae", "trainer.loss=grpo",
                 "trainer.critic.warmup_steps=2", *SMALL]) == 0  # veRL's count: one step alone
    steps = [r for r in rows(out) if "timing/train_s" in r]
    assert len(steps) == 3 and max(r["staleness/max"] for r in steps) == 1  # a stale batch was trained
    assert all(r["train/value_loss"] > 0 for r in steps)
    assert "train/loss" not in steps[0] and all("train/loss" in r for r in steps[1:])


# --- what is refused ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("overrides, named", [
    (["trainer.lora.rank=8"], "trainer.lora"),
    (["control.scheduler=tail", "trainer.streamed=true"], "trainer.streamed"),
    (["trainer.loss=gmpo"], "trainer.loss=gmpo"),
    (["trainer.off_policy_mask=0.5"], "trainer.off_policy_mask"),
])
def test_gae_refuses_what_it_cannot_run_with(overrides, named):
    with pytest.raises(ConfigError, match=rf"trainer.advantage=gae cannot run with {named}"):
        load_config(None, ["trainer.advantage=gae", *overrides])


def test_all_refused_options_are_named_in_one_message():
    with pytest.raises(ConfigError, match=r"cannot run with trainer.lora, trainer.loss=gmpo: "):
        load_config(None, ["trainer.advantage=gae", "trainer.lora.rank=8", "trainer.loss=gmpo"])


@pytest.mark.parametrize("option", ["trainer.critic.lr=1e-4", "trainer.gae.lam=0.95"])
def test_critic_and_gae_settings_need_gae(option):
    with pytest.raises(ConfigError, match=r"trainer.critic and trainer.gae configure PPO's value model: they need "
                                          r"trainer.advantage=gae \(got grpo\)"):
        load_config(None, [option])


def test_the_recipe_loads():
    from pathlib import Path

    cfg = load_config(Path(__file__).parent.parent / "configs" / "recipes" / "ppo_gae.yaml")
    assert cfg.trainer.advantage == "gae" and cfg.trainer.gae.gamma == 1.0 and cfg.trainer.critic.value_clip == 0.5


def test_a_saved_config_holds_the_defaults_and_loads_again(tmp_path):
    """A run's config.yaml holds every key, trainer.critic and trainer.gae at their defaults among them."""
    from rlsys.config import save_config

    save_config(load_config(None), tmp_path / "config.yaml")
    assert load_config(tmp_path / "config.yaml").trainer.advantage == "grpo"
