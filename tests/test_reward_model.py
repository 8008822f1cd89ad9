"""A learned reward model (reward.fn=reward_model, reward.model.path; veRL's reward_model): a sequence-classification
model built here with random weights, scored in the reward actors in batches, alone or as one weighted part."""
import math

import pytest
import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer, Qwen2Config, Qwen2ForSequenceClassification

from rlsys.cli import main
from rlsys.config import DEFAULT_CONFIG, RewardConfig, RewardModelConfig
from rlsys.logger import read_jsonl
from rlsys.models.tiny import build_char_tokenizer
from rlsys.reward import RewardPool
from rlsys.reward.model import RewardModel
from rlsys.startup import load_config, start_problems

PAIRS = [("What is 2+3? ", "5"), ("Add 12 and 30: ", "42"), ("q", "a much longer answer, to pad the others"),
         ("Sum of 1, 2, 3? ", "6"), ("", "x"), ("Say nothing. ", "")]
CHAT = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</{{ m['role'] }}>{% endfor %}")


def build_reward_model(out, chat_template: str | None = None, seed: int = 0):
    """A tiny Qwen2 classifier with one label and random weights, and the char tokenizer, saved as a HF folder."""
    tok = build_char_tokenizer()
    if chat_template:
        tok.chat_template = chat_template
    config = Qwen2Config(vocab_size=len(tok), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=1, intermediate_size=64, max_position_embeddings=256, num_labels=1,
                         pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=None)
    torch.manual_seed(seed)
    model = Qwen2ForSequenceClassification(config)
    with torch.no_grad():  # a score head of some size, so scores differ visibly between texts
        model.score.weight.normal_(0, 1.0)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def rm_dir(tmp_path_factory):
    return build_reward_model(tmp_path_factory.mktemp("rm"))


def direct_scores(path, texts, add_special_tokens=True) -> list[float]:
    """Each text alone through the saved model: no batch, no padding."""
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForSequenceClassification.from_pretrained(path).eval()
    with torch.no_grad():
        return [model(**tok(t, return_tensors="pt", add_special_tokens=add_special_tokens)).logits[0, 0].item()
                for t in texts]


def test_the_pool_scores_as_a_direct_forward_batched_or_not(ray_cluster, rm_dir):
    want = direct_scores(rm_dir, [p + r for p, r in PAIRS])  # no chat template: the prompt and the response joined
    assert len({round(w, 4) for w in want}) == len(want)  # scores that tell the texts apart
    items = [(f"k{i}", response, "", 1, "", None, prompt) for i, (prompt, response) in enumerate(PAIRS)]
    for batch_size in (1, 4):
        pool = RewardPool(RewardConfig(fn="reward_model", valid_range=(-1, 1),
                                       model=RewardModelConfig(path=str(rm_dir), batch_size=batch_size)))
        try:
            results = pool.score_all(items)
        finally:
            pool.shutdown()
        assert [r.error for r in results] == [None] * len(PAIRS)
        assert [r.parts for r in results] == [None] * len(PAIRS)  # one part: reward/mean is its mean
        # a logit is held to no valid_range; padding in a batch changes a score by float32 rounding only
        assert [r.reward for r in results] == pytest.approx(want, rel=1e-5, abs=1e-6)


def test_the_model_is_one_weighted_part_beside_a_rule(ray_cluster, rm_dir):
    cfg = RewardConfig(fn=["exact_match", "reward_model"], weights=[1.0, 0.5],
                       model=RewardModelConfig(path=str(rm_dir), batch_size=3))
    answers = ["5", "41", "x", "6", "x", "1"]
    pool = RewardPool(cfg)
    try:
        results = pool.score_all([(f"k{i}", r, a, 1, "", None, p) for i, ((p, r), a) in enumerate(zip(PAIRS, answers))])
    finally:
        pool.shutdown()
    model_scores = direct_scores(rm_dir, [p + r for p, r in PAIRS])
    for result, (prompt, response), answer, model_score in zip(results, PAIRS, answers, model_scores):
        match = float(response == answer)
        assert result.parts == {"exact_match": match, "reward_model": pytest.approx(model_score, rel=1e-5, abs=1e-6)}
        assert result.reward == pytest.approx(match + 0.5 * model_score, rel=1e-5, abs=1e-6)


def test_a_chat_template_renders_the_prompt_and_the_response(tmp_path):
    path = build_reward_model(tmp_path / "chat", chat_template=CHAT, seed=1)
    model = RewardModel(RewardModelConfig(path=str(path), batch_size=4))
    assert model.text("2+3?", "5") == "<user>2+3?</user><assistant>5</assistant>"
    texts = [model.text(p, r) for p, r in PAIRS]
    assert model.score(PAIRS) == pytest.approx(direct_scores(path, texts, add_special_tokens=False), rel=1e-5,
                                               abs=1e-6)


def test_a_folder_without_safe_weights_is_refused_by_name(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    cfg = load_config(None, ["reward.fn=reward_model", f"reward.model.path={tmp_path}"])
    assert any(p.startswith(f"reward.model.path: {tmp_path} lacks weights") for p in start_problems(cfg))


def test_a_model_on_cuda_needs_a_gpu_the_plan_leaves_free():
    on_cuda = ["reward.fn=reward_model", "reward.model.path=rm", "reward.model.device=cuda"]
    with pytest.raises(ValueError, match=r"reward.model.device: cuda gives each of the reward.num_workers=1 reward "
                                         r"workers a GPU of its own, and the placement leaves 0 of"):
        load_config(None, on_cuda)
    cfg = load_config(None, on_cuda + ["cluster.gpus_per_node=3", "rollout.device=cuda", "rollout.num_workers=1",
                                       "cluster.layout=separate"])
    assert cfg.reward.model.device == "cuda"  # an engine and a trainer rank on two of three GPUs: one is free


@pytest.mark.slow
def test_a_run_trains_on_a_rule_and_the_model_and_logs_each(tmp_path, ray_cluster, rm_dir):
    from helpers import SMALL

    out = tmp_path / "run"
    assert main(["train", str(DEFAULT_CONFIG), "trainer.total_steps=2", f"output_dir={out}", "control.eval_every=0",
                 "control.save_every=0", *SMALL, "reward.fn=[exact_match,reward_model]", "reward.weights=[1.0,0.5]",
                 f"reward.model.path={rm_dir}", "reward.model.batch_size=4"]) == 0
    rows = [r for r in read_jsonl(out / "metrics.jsonl") if "reward/mean" in r]  # the steps' rows
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        assert row["reward/step_errors"] == 0 and math.isfinite(row["train/loss"])
        match, model = row["reward/exact_match/mean"], row["reward/reward_model/mean"]
        assert 0 <= match <= 1 and model != 0
        assert row["reward/mean"] == pytest.approx(match + 0.5 * model, rel=1e-6, abs=1e-9)
