"""Several tool calls in one model turn (tools.max_calls_per_turn): read off the turn, run at once, answered in
call order as the chat template renders several tool turns, token for token."""
import json
import time
from dataclasses import replace

import pytest

from rlsys.config import ConfigError, ModelConfig, ToolsConfig
from rlsys.models.tiny import build_tiny_model
from rlsys.rollout.builtin_engine import CPUEngine
from rlsys.rollout.worker import RolloutWorker
from rlsys.startup import load_config
from rlsys.tools import CALL_CLOSE, CALL_OPEN, ToolBox, ToolFormat
from rlsys.trainer.advantages import group_advantages
from rlsys.types import Prompt, Request, SamplingParams, ToolTurn, env_sample, trajectory_return
from test_tools import chat_ids, chat_tokenizer

NAPS = '''
import asyncio
import time


def nap(label, seconds=1.0):
    """When it started and ended: two calls overlapped if each started before the other ended."""
    start = time.time()
    time.sleep(seconds)
    return f"{label} {start!r} {time.time()!r}"


async def anap(label, seconds=1.0):
    start = time.time()
    await asyncio.sleep(seconds)
    return f"{label} {start!r} {time.time()!r}"


class Counter:
    """An environment whose steps report the order they ran in."""
    def reset(self, sample):
        self.steps = []

    def step(self, action):
        self.steps.append(action)
        time.sleep(0.2)
        return ",".join(self.steps), 0.5, False


class Judge:
    """An environment that judges guesses against the sample's reference answer."""
    def reset(self, sample):
        self.sample = sample

    def step(self, action):
        right = action == self.sample["answer"]
        return ("right" if right else "wrong") + " " + self.sample["data_source"], float(right), right
'''


def call(name: str, **arguments) -> str:
    return f"{CALL_OPEN}{json.dumps({'name': name, 'arguments': arguments})}{CALL_CLOSE}"


@pytest.fixture(scope="module")
def naps(tmp_path_factory):
    path = tmp_path_factory.mktemp("naps") / "naps.py"
    path.write_text(NAPS)
    return path


def spans(results):
    """(start, end) of each nap, from its answer."""
    return [tuple(float(x) for x in r.text.split()[1:]) for r in results]


def overlapped(results) -> bool:
    """Every call started before any other ended."""
    times = spans(results)
    return max(start for start, _ in times) < min(end for _, end in times)


# --- the format ---

def test_a_turn_s_calls_are_split_in_order_and_one_call_stays_as_it_was():
    fmt = ToolFormat()
    one = call("a", x=1)
    assert fmt.split_calls(one) == [one]
    assert fmt.split_calls(f"{one}\nand {call('b')}<eos>") == [one, call("b")]
    assert fmt.split_calls("<tool_call>{oops") == ["<tool_call>{oops"]  # no closing tag: one call, unreadable


@pytest.mark.parametrize("specials", [True, False])
def test_several_answers_are_the_chat_template_s_tool_turns_token_for_token(specials):
    """The model's turn (two calls, then its end-of-turn `<|im_end|>`, which it sampled) and the answers' ids
    are the template's whole conversation: only the template's text after the model's turn is tokenized."""
    tok = chat_tokenizer(specials)
    fmt = ToolFormat.of(tok)
    assert fmt.turn_between == "\n</tool_response>\n<tool_response>\n"
    user = [{"role": "user", "content": "What are 6*7 and 2+3?"}]
    model_turn = call("calculator", expression="6*7") + "\n" + call("calculator", expression="2+3")
    model_ids = tok.encode(model_turn + "<|im_end|>", add_special_tokens=False)
    ids = chat_ids(tok, user) + model_ids + fmt.responses_ids(tok, ["42", "5"], model_turn + "<|im_end|>")
    assert ids == chat_ids(tok, user + [{"role": "assistant", "content": model_turn},
                                        {"role": "tool", "content": "42"}, {"role": "tool", "content": "5"}])
    # a turn that ended at its last call allowed (no end-of-turn token): the template's `<|im_end|>` is written
    ids = chat_ids(tok, user) + tok.encode(model_turn, add_special_tokens=False) + fmt.responses_ids(
        tok, ["42", "5"], model_turn)
    assert ids == chat_ids(tok, user + [{"role": "assistant", "content": model_turn},
                                        {"role": "tool", "content": "42"}, {"role": "tool", "content": "5"}])


def test_without_a_tool_turn_the_answers_follow_in_their_tags():
    tok = chat_tokenizer(False)
    tok.chat_template = None
    fmt = ToolFormat.of(tok)
    assert tok.decode(fmt.responses_ids(tok, ["42", "5"], call("a") + call("b") + "<eos>")) == \
        "<tool_response>42</tool_response><tool_response>5</tool_response>"


def test_max_calls_per_turn_below_one_is_refused_naming_the_field():
    assert ToolsConfig().max_calls_per_turn == 1
    with pytest.raises(ConfigError, match=r"tools.max_calls_per_turn: .*command-line override"):
        load_config(None, ["tools.max_calls_per_turn=0"])


# --- the box: a turn's calls at once ---

@pytest.mark.parametrize("tool", ["nap", "anap"])
def test_a_turn_s_calls_run_at_once_in_the_conversation_s_process_and_answer_in_call_order(naps, tool):
    """Two calls sleeping 1 s each, sync (threads) or async (gathered) tools: both start before either ends."""
    tools = ToolBox.from_config(ToolsConfig(fns=[f"{naps}:{tool}"], max_calls_per_turn=2, timeout_s=10.0))
    try:
        results = tools.run_turn(call(tool, label="first") + call(tool, label="second"), "c")
    finally:
        tools.close()
    assert [r.text.split()[0] for r in results] == ["first", "second"] and all(r.ok for r in results)
    assert overlapped(results)


def test_built_in_and_user_calls_of_one_turn_run_at_once_each_within_its_own_time_limit(naps):
    tools = ToolBox.from_config(ToolsConfig(fns=["calculator", f"{naps}:nap"], max_calls_per_turn=3,
                                            timeout_s=0.5))
    try:
        turn = call("nap", label="slow", seconds=5.0) + call("calculator", expression="6*7") + call("nap", label="quick",
                                                                                                    seconds=0.1)
        start = time.monotonic()
        slow, calc, quick = tools.run_turn(turn, "c")
        spent = time.monotonic() - start
        again = tools.run_turn(call("nap", label="next", seconds=0.0), "c")[0]  # the process, killed, is forked again
    finally:
        tools.close()
    assert not slow.ok and "timed out after 0.5s" in slow.error
    assert (calc.text, calc.ok) == ("42", True) and quick.ok and quick.text.startswith("quick")
    assert again.ok and spent < 5.0  # the hung call was abandoned, not waited for
    assert tools.counts["calls"] == 4 and tools.counts["failed"] == 1


def test_a_turn_makes_at_most_max_calls_per_turn_and_an_environment_steps_in_call_order(naps):
    env = ToolBox.from_config(ToolsConfig(env=f"{naps}:Counter", max_calls_per_turn=2))
    try:
        results = env.run_turn(f"{CALL_OPEN}a{CALL_CLOSE}{CALL_OPEN}b{CALL_CLOSE}{CALL_OPEN}c{CALL_CLOSE}", "e",
                               sample={"prompt": "p"})
    finally:
        env.close()
    assert [(r.text, r.reward) for r in results] == [("a", 0.5), ("a,b", 0.5)]


# --- the engine reads a turn of several calls; the worker answers them ---

SIZES = dict(hidden_size=32, num_heads=2, num_kv_heads=1, intermediate_size=64, max_position_embeddings=512)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(build_tiny_model(ModelConfig(**SIZES), tmp_path_factory.mktemp("calls") / "m", seed=3))


def resumed(tok, text, eos=False, rid="r", n=400):
    """A conversation whose model turn so far is `text` (and its EOS): what the engine reads on admission."""
    ids = tok.encode(text, add_special_tokens=False) + ([tok.eos_token_id] if eos else [])
    return Request(rid, "p", tok.encode("Q? ", add_special_tokens=False),
                   SamplingParams(max_new_tokens=n, temperature=1.0, seed=7), resume_ids=ids,
                   resume_logprobs=[-1.0] * len(ids), resume_versions=[0] * len(ids), resume_mask=[1] * len(ids))


def test_a_turn_ends_at_its_eos_after_a_call_or_at_its_last_call_allowed(model_dir):
    eng = CPUEngine(model_dir, 4, max_len=256)
    eng.use_tools(CALL_OPEN, CALL_CLOSE, max_turns=2, max_calls=2)
    tok, a, b = eng.tokenizer, call("a"), call("b")
    eng.add(resumed(tok, "x " + a + " " + b, rid="two"))  # the second call allowed ends the turn
    eng.add(resumed(tok, "x " + a, eos=True, rid="eos"))  # the model ended its turn after one call
    eng.add(resumed(tok, "x " + a, rid="open"))  # it may write another call: the turn goes on
    eng.add(resumed(tok, "no call", eos=True, rid="done"))  # an EOS with no call ends the conversation
    calls = {rid: (at, text) for rid, at, text in eng.take_calls()}
    assert calls == {"two": (len(tok.encode("x " + a + " " + b)), a + " " + b),
                     "eos": (len(tok.encode("x " + a)) + 1, a + "<eos>")}
    assert eng.waits_on_tool("two") and eng.waits_on_tool("eos") and not eng.waits_on_tool("open")
    assert [(c.request_id, c.finish_reason) for c in eng.step()] == [("done", "stop")]
    # both answers of a turn: one turn of two calls, so with max_turns=1 the next turn's calls get no answer
    eng.extend("two", calls["two"][0], tok.encode("<tool_response>1</tool_response>"),
               [ToolTurn("a", True), ToolTurn("b", True)])
    record = eng.running.get("two") or eng.waiting["two"]
    assert [t.call for t in record.turns] == [0, 1] and not record.held


def test_the_worker_runs_a_turn_s_calls_at_once_and_appends_the_answers_in_call_order(model_dir, naps):
    worker = RolloutWorker(model_dir, 2, engine_kwargs={"max_len": 512},
                           tools=ToolsConfig(fns=[f"{naps}:nap"], max_calls_per_turn=2, max_turns=1, timeout_s=10.0))
    try:
        tok = worker.engine.tokenizer
        turn = call("nap", label="first") + call("nap", label="second")
        request = resumed(tok, turn, eos=True)
        worker.submit([request])
        got = {}
        deadline = time.time() + 60
        while not got and time.time() < deadline:
            got.update((c.request_id, c) for c in worker.drain(timeout_s=1.0))
    finally:
        worker.stop()
    c, n = got["r"], len(request.resume_ids)
    answer = tok.decode(c.token_ids[n:n + c.mask[n:].index(1)] if 1 in c.mask[n:] else c.token_ids[n:])
    first, second = answer.split("</tool_response><tool_response>")
    assert first.startswith("<tool_response>first ") and second.startswith("second ")
    times = [tuple(float(x) for x in part.split()[1:3]) for part in (first, second.removesuffix("</tool_response>"))]
    assert max(s for s, _ in times) < min(e for _, e in times)  # they overlapped
    assert [(t.name, t.call) for t in c.turns] == [("nap", 0), ("nap", 1)]


# --- an environment's reset gets the sample: its prompt and reference answer ---

def test_the_sample_an_environment_is_reset_with_holds_the_prompt_and_its_reference_answer():
    prompt = Prompt("train-3", "guess: ", "7", data_source="guess_number", index=3, extra_info={"level": 2})
    assert env_sample(prompt) == {"prompt": "guess: ", "answer": "7", "data_source": "guess_number",
                                  "uid": "train-3", "extra_info": {"level": 2}}


def test_the_worker_resets_a_conversation_s_environment_with_its_request_s_sample(model_dir, naps):
    worker = RolloutWorker(model_dir, 2, engine_kwargs={"max_len": 512}, tools=ToolsConfig(env=f"{naps}:Judge"))
    try:
        tok = worker.engine.tokenizer
        sample = env_sample(Prompt("p-0", "Q? ", "7", data_source="judged"))
        right = resumed(tok, f"{CALL_OPEN}7{CALL_CLOSE}", rid="right")
        wrong = resumed(tok, f"{CALL_OPEN}5{CALL_CLOSE}", rid="wrong")
        worker.submit([replace(right, sample=sample), replace(wrong, sample=sample)])
        got, deadline = {}, time.time() + 60
        while len(got) < 2 and time.time() < deadline:
            got.update((c.request_id, c) for c in worker.drain(timeout_s=1.0))
    finally:
        worker.stop()
    c = got["right"]
    assert c.finish_reason == "stop" and tok.decode(c.token_ids[len(right.resume_ids):]) == \
        "<tool_response>right judged</tool_response>" and c.turns[0].reward == 1.0
    w = got["wrong"]
    assert tok.decode(w.token_ids[len(wrong.resume_ids):]).startswith("<tool_response>wrong judged</tool_response>")


# --- per-turn rewards folded into the return (tools.return_rule) ---

THREE_TURNS = [ToolTurn("env", True, reward=-0.1), ToolTurn("env", True, reward=0.2),
               ToolTurn("env", True, reward=-0.1, call=1), ToolTurn("env", True, reward=0.5)]  # turn 1: two calls


def test_a_three_turn_episode_s_return_under_each_rule_is_the_hand_computed_one():
    assert trajectory_return(1.0, THREE_TURNS) == pytest.approx(1.0 - 0.1 + 0.2 - 0.1 + 0.5, abs=1e-12)
    # t = 0, 1, 2 for the three turns (the second's two calls both at t = 1), the final reward at T = 3
    discounted = -0.1 + 0.5 * (0.2 - 0.1) + 0.25 * 0.5 + 0.125 * 1.0
    assert trajectory_return(1.0, THREE_TURNS, "discounted", 0.5) == pytest.approx(discounted, abs=1e-12)
    assert trajectory_return(1.0, THREE_TURNS, "discounted", 1.0) == pytest.approx(1.5, abs=1e-12)
    assert trajectory_return(0.7, [], "discounted", 0.5) == 0.7  # one turn: the reward itself


@pytest.mark.parametrize("estimator", ["grpo", "rloo"])
def test_discounting_changes_what_an_estimator_sees(estimator):
    """Two samples of a group earn the same undiscounted return, one early (a turn's reward), one late (the final
    answer after a turn): summed they tie, discounted the early one is ahead."""
    early, late = (0.0, [ToolTurn("env", True, reward=0.5)]), (0.5, [ToolTurn("env", True, reward=0.0)])
    summed = [trajectory_return(r, turns) for r, turns in (early, late)]
    discounted = [trajectory_return(r, turns, "discounted", 0.5) for r, turns in (early, late)]
    assert summed == [0.5, 0.5] and discounted == [0.5, 0.25]
    assert group_advantages(summed, estimator) == [0.0, 0.0]
    high, low = group_advantages(discounted, estimator)
    assert high > 0 > low


def test_a_bad_return_rule_or_gamma_is_refused_naming_the_field():
    cfg = load_config(None, ["tools.return_rule=discounted", "tools.gamma=0.9"])
    assert (cfg.tools.return_rule, cfg.tools.gamma) == ("discounted", 0.9)
    for override, field in [("tools.return_rule=mean", "tools.return_rule"), ("tools.gamma=0", "tools.gamma"),
                            ("tools.gamma=1.5", "tools.gamma")]:
        with pytest.raises(ConfigError, match=rf"{field}: .*command-line override"):
            load_config(None, [override])
