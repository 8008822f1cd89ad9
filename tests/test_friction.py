import pytest
from pydantic import ValidationError

from rlsys.config import Config, FrictionConfig
from rlsys.friction import Friction
from rlsys.types import SamplingParams


def test_friction_picks_its_share_of_samples_the_same_way_every_time():
    friction = Friction(FrictionConfig(reward_flip=0.25, wrong_temperature_share=0.1, wrong_temperature=3.0), seed=7)
    ids = [f"r{i}" for i in range(4000)]
    flipped = [rid for rid in ids if friction.reward(rid, 1.0) == 0.0]
    assert abs(len(flipped) / len(ids) - 0.25) < 0.03
    assert friction.reward(flipped[0], 0.0) == 1.0 and friction.reward(flipped[0], 0.25) == 0.75
    again = Friction(friction.cfg, seed=7)
    assert [rid for rid in ids if again.reward(rid, 1.0) == 0.0] == flipped  # deterministic
    other_seed = Friction(friction.cfg, seed=8)
    assert [rid for rid in ids if other_seed.reward(rid, 1.0) == 0.0] != flipped
    nominal = SamplingParams(96, temperature=1.0)
    lied = [friction.sampling(rid, nominal) for rid in ids]
    wrong = [p for p in lied if p.temperature == 3.0]
    assert abs(len(wrong) / len(ids) - 0.1) < 0.02
    assert all(p.logprob_temperature == 1.0 for p in wrong)
    assert all(p == nominal for p in lied if p.temperature != 3.0)  # the rest untouched
    assert friction.counts == {"friction/flipped_rewards": len(flipped) + 2,
                               "friction/wrong_temperature_samples": len(wrong)}


def test_off_by_default_and_a_lie_needs_the_built_in_engine_and_plain_sampling():
    assert not Config().friction.on
    with pytest.raises(ValidationError, match="friction.wrong_temperature_share"):
        Config(friction=FrictionConfig(wrong_temperature_share=0.1), rollout={"top_p": 0.9})
    with pytest.raises(ValidationError, match="friction.wrong_temperature_share"):
        Config(friction=FrictionConfig(wrong_temperature_share=0.1), rollout={"temperature": 0.0})
    assert Config(friction=FrictionConfig(wrong_temperature_share=0.1)).friction.on


@pytest.mark.slow
def test_a_live_run_trains_on_the_contaminated_samples(tmp_path, ray_cluster):
    """Every reward flipped and every sample drawn hot: the trainer sees 1 - reward (the barely warm model
    gets nearly nothing right) and the counters match the samples trained."""
    import json

    from rlsys.cli import main
    from rlsys.config import DEFAULT_CONFIG

    out = tmp_path / "run"
    assert main(["train", str(DEFAULT_CONFIG), "trainer.total_steps=2", f"output_dir={out}", "control.eval_every=0",
                 "control.prompts_per_step=4", "control.group_size=4", "data.eval_size=8", "rollout.slots=16",
                 "rollout.max_new_tokens=48", "model.warm_start.steps=30", "logging.progress=false",
                 "friction.reward_flip=1.0", "friction.wrong_temperature_share=1.0"]) == 0
    steps = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "timing/train_s" in r]
    assert [r["step"] for r in steps] == [1, 2]
    assert all(r["reward/mean"] >= 0.9 for r in steps), [r["reward/mean"] for r in steps]
    assert steps[-1]["friction/flipped_rewards"] == steps[-1]["friction/wrong_temperature_samples"] == 32
