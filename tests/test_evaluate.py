import math
from types import SimpleNamespace

import pytest

from rlsys.config import RolloutConfig
from rlsys.evaluate import Evaluation, eval_accuracy, mean_and_se
from rlsys.models.tiny import build_char_tokenizer
from rlsys.types import Completion, Prompt


def test_mean_and_se_match_the_textbook_formula():
    assert mean_and_se([]) == (0.0, 0.0)
    assert mean_and_se([0.5]) == (0.5, 0.0)
    values = [1.0, 0.0, 0.5, 0.25]
    mean = sum(values) / 4
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / 3)
    assert mean_and_se(values) == pytest.approx((mean, sd / 2))


class Scripted:
    """A rollout manager whose answers are scripted per (prompt, sample) and a reward pool scoring exact match."""
    def __init__(self, right):
        self.right = right  # (prompt uid, sample index) -> answered right

    def generate(self, requests):
        out = []
        for r in requests:
            _, uid, j = r.request_id.rsplit("/", 2)
            text = "yes" if self.right(uid, int(j), r.params.temperature) else "no"
            out.append(Completion(r.request_id, r.prompt_uid, [], [], [], [], "stop", text=text))
        return out

    def score_all(self, items):
        return [SimpleNamespace(key=key, reward=float(text == answer)) for key, text, answer, *_ in items]


def test_eval_standard_error_counts_prompts_not_samples():
    """Two samples of a prompt always agree here: the error is that of 4 prompts, not of 8 samples."""
    prompts = [Prompt(uid=f"p{i}", text="q", answer="yes") for i in range(4)]
    scripted = Scripted(lambda uid, j, temp: uid in ("p0", "p1") if temp > 0 else uid == "p0")
    cfg = RolloutConfig(eval_samples=2, temperature=1.0)
    metrics = eval_accuracy(scripted, scripted, build_char_tokenizer(), prompts, cfg)
    assert metrics["eval/accuracy"] == 0.5
    assert metrics["eval/accuracy_se"] == pytest.approx(math.sqrt((4 * 0.25) / 3 / 4))  # per-prompt 1,1,0,0
    assert metrics["eval/greedy_accuracy"] == 0.25
    assert metrics["eval/greedy_accuracy_se"] == pytest.approx(math.sqrt((0.75 ** 2 + 3 * 0.25 ** 2) / 3 / 4))


def test_an_evaluation_gives_the_same_figures_whatever_order_its_rewards_come_in():
    """The controller's pump hands rewards over as they are scored: the per-prompt means must still be summed in
    prompt order, or two evaluations of the same weights could differ in the last bit."""
    solved = [3, 3, 0, 2, 3, 3, 2]  # of 3 samples per prompt; these means sum differently in another order
    prompts = [Prompt(uid=f"p{i}", text="q", answer="yes") for i in range(len(solved))]
    cfg = RolloutConfig(eval_samples=3, temperature=1.0, eval_greedy=False)

    def metrics(order):
        evaluation = Evaluation(build_char_tokenizer(), prompts, cfg)
        ids = [r.request_id for r in evaluation.requests]
        assert all(evaluation.owns(i) for i in ids) and not evaluation.owns("p0#0")  # a training request's id
        for i in order(ids):
            evaluation.add(i, float(int(i.rsplit("/", 1)[1]) < solved[int(i.split("/")[2][1:])]))
        assert evaluation.done
        return evaluation.metrics()

    in_order = metrics(list)
    assert in_order["eval/accuracy"] == pytest.approx(16 / 21)
    assert metrics(lambda ids: sorted(ids, key=lambda i: "p0 p1 p4 p5 p3 p6 p2".index(i.split("/")[2]))) == in_order


def test_eval_requests_are_seeded_only_on_engines_where_a_seed_is_cheap():
    """vLLM runs a generator per seeded row per step: its eval requests carry none; the built-in engine's do."""
    prompts = [Prompt(uid=f"p{i}", text="q", answer="yes") for i in range(3)]

    def seeds(engine):
        cfg = RolloutConfig(engine=engine, eval_samples=2, temperature=1.0)
        return [r.params.seed for r in Evaluation(build_char_tokenizer(), prompts, cfg).requests]

    assert seeds("vllm") == [None] * 9  # 3 x 2 sampled, 3 greedy
    built_in = seeds("cpu")
    assert None not in built_in and len(set(built_in)) == len(built_in) - 3  # greedy repeats the sampled seeds
