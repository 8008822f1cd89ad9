"""Multi-turn rollouts with tools: the conversation as one request, tokens in and tokens out.

Engine-level tests without Ray on one tiny char-level model (one token per byte). A random-init model writes
no `<tool_call>` tags, so the engine's tool-call tags here are short strings its seeded sample is known to
contain: the engine reads calls from its decoded tail whatever the tags are."""
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rlsys.config import ControlConfig, EmulateConfig, ModelConfig, ToolsConfig, TrainerConfig
from rlsys.control import GROUP_SIZERS, SCHEDULERS
from rlsys.control.actions import Abort, Submit, Train
from rlsys.data.cursor import PromptCursor
from rlsys.emulate import Emulation
from rlsys.models.tiny import build_char_tokenizer, build_tiny_model
from rlsys.rollout.builtin_engine import CPUEngine
from rlsys.rollout.engine import read_tokenizer
from rlsys.rollout.worker import RolloutWorker
from rlsys.step_stats import tool_metrics
from rlsys.trainer.backend import TorchBackend
from rlsys.trainer.batching import build_samples, plan_step
from rlsys.trainer.logprobs import Scoring
from rlsys.tools import CALL_CLOSE, CALL_OPEN, ToolFormat
from rlsys.types import Group, Prompt, Request, SamplingParams, ScoredSample, ToolTurn, reward_item

SIZES = dict(hidden_size=32, num_heads=2, num_kv_heads=1, intermediate_size=64, max_position_embeddings=256)
PROMPT = "What is 123*456? "
ANSWER = "<tool_response>56088</tool_response>"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(build_tiny_model(ModelConfig(**SIZES), tmp_path_factory.mktemp("mt") / "m", seed=3))


def engine(model_dir, slots=2, **kw) -> CPUEngine:
    return CPUEngine(model_dir, slots, max_len=256, **kw)


def sampled(n=60):
    return SamplingParams(max_new_tokens=n, temperature=1.0, seed=7)


def run(eng, requests, tool=None, limit=2000, encode=None):
    """Step until every request finished; `tool(call_text) -> answer text` answers each call at once, its ids
    `encode(tokenizer, text)` (by default the text's own)."""
    for r in requests:
        eng.add(r)
    done = {}
    for _ in range(limit):
        for c in eng.step():
            done[c.request_id] = c
        for rid, at, text in eng.take_calls():
            ids = (encode or (lambda tok, t: tok.encode(t, add_special_tokens=False)))(eng.tokenizer, tool(text))
            eng.extend(rid, at, ids, ToolTurn("echo", True, None, 0.0))
        if len(done) == len(requests) and not eng.has_work():
            return done
    raise AssertionError("engine did not finish")


@pytest.fixture(scope="module")
def tags(model_dir):
    """(prompt ids, single-turn tokens, call_open, call_close, first turn's length): call_close (two printable
    characters) first appears in the single-turn sample at a known token, so a conversation's first turn ends
    there; call_open is a printable character before it."""
    eng = engine(model_dir)
    prompt = eng.tokenizer.encode(PROMPT, add_special_tokens=False)
    tokens = run(eng, [Request("r", "p", prompt, sampled())])["r"].token_ids
    chars = [eng.tokenizer.decode([t]) for t in tokens]
    printable = [len(ch) == 1 and ch.isascii() and ch.isprintable() for ch in chars]
    k = next(k for k in range(8, len(tokens) - 2) if printable[k] and printable[k + 1]
             and chars[k] + chars[k + 1] not in eng.tokenizer.decode(tokens[:k + 1]))
    return prompt, tokens, chars[printable.index(True)], chars[k] + chars[k + 1], k + 2


def test_a_turn_ends_at_a_tool_call_and_the_answer_joins_as_masked_tokens(model_dir, tags):
    prompt, single, call_open, call_close, first_turn = tags
    eng = engine(model_dir)
    eng.use_tools(call_open, call_close, max_turns=1)
    calls = []
    c = run(eng, [Request("r", "p", prompt, sampled())], tool=lambda text: calls.append(text) or ANSWER)["r"]
    answer = eng.tokenizer.encode(ANSWER, add_special_tokens=False)
    assert c.token_ids[:first_turn] == single[:first_turn]
    turn = eng.tokenizer.decode(single[:first_turn])
    assert calls == [turn[turn.rfind(call_open):]]  # the call's text, from call_open to call_close
    # the answer's ids once, as tokenized once, masked; logprob 0 there; the model's own tokens after it
    assert c.token_ids[first_turn:first_turn + len(answer)] == answer
    assert c.mask == [1] * first_turn + [0] * len(answer) + [1] * (len(c.token_ids) - first_turn - len(answer))
    assert c.logprobs[first_turn:first_turn + len(answer)] == [0.0] * len(answer)
    assert [t.name for t in c.turns] == ["echo"]
    assert len(c.token_ids) <= 60  # the budget counts the whole conversation, tool tokens included


def test_a_tools_answer_counts_in_the_token_budget_and_is_cut_to_it(model_dir, tags):
    prompt, _, call_open, call_close, first_turn = tags
    eng = engine(model_dir)
    eng.use_tools(call_open, call_close, max_turns=1)
    params = SamplingParams(max_new_tokens=first_turn + 5, temperature=1.0, seed=7)
    c = run(eng, [Request("r", "p", prompt, params)], tool=lambda text: ANSWER)["r"]
    answer = eng.tokenizer.encode(ANSWER, add_special_tokens=False)
    assert c.finish_reason == "length" and c.token_ids[first_turn:] == answer[:5] and c.mask[first_turn:] == [0] * 5
    assert eng.counters.prefilled_tokens == len(prompt)  # nothing left to generate: the answer is never prefilled


def test_a_continuation_prefills_only_the_answer_over_the_kept_kv_cache(model_dir, tags):
    """KV reuse: the turn after the tool prefills the call's last token and the answer, never the prompt or the
    earlier turn, and samples exactly what a full prefill of the whole conversation so far would."""
    prompt, _, call_open, call_close, first_turn = tags
    eng = engine(model_dir)
    eng.use_tools(call_open, call_close, max_turns=1)
    c = run(eng, [Request("r", "p", prompt, sampled())], tool=lambda text: ANSWER)["r"]
    answer = eng.tokenizer.encode(ANSWER, add_special_tokens=False)
    assert eng.counters.prefilled_tokens == len(prompt) + 1 + len(answer)
    # the same conversation resumed from its tokens up to the answer, prefilled whole by a fresh engine
    cut = first_turn + len(answer)
    again = engine(model_dir)
    r = Request("r", "p", prompt, sampled(), resume_ids=c.token_ids[:cut], resume_logprobs=c.logprobs[:cut],
                resume_versions=c.versions[:cut])
    whole = run(again, [r])["r"]
    assert again.counters.prefilled_tokens == len(prompt) + cut
    assert whole.token_ids == c.token_ids
    assert whole.logprobs[cut:] == pytest.approx(c.logprobs[cut:], abs=1e-4)


def test_a_closing_tag_the_model_samples_in_more_tokens_than_the_tokenizer_s_own_ends_its_turn(model_dir):
    """A tokenizer that has `</tool_call>` as one token; the model writes it character by character."""
    eng = engine(model_dir)
    eng.tokenizer.add_tokens(["</tool_call>"])
    assert len(eng.tokenizer.encode(CALL_CLOSE, add_special_tokens=False)) == 1
    eng.use_tools(CALL_OPEN, CALL_CLOSE, max_turns=1)
    ids = [eng.tokenizer.convert_tokens_to_ids(eng.tokenizer.tokenize(ch))[0] for ch in CALL]  # one per character
    assert eng.tokenizer.decode(ids) == CALL
    prompt = eng.tokenizer.encode(PROMPT, add_special_tokens=False)
    eng.add(Request("r", "p", prompt, sampled(200), resume_ids=ids, resume_logprobs=[-1.0] * len(ids),
                    resume_versions=[0] * len(ids)))
    assert eng.take_calls() == [("r", len(ids), CALL)]


def test_rewards_read_the_model_s_own_text_and_token_count_not_the_tool_s(conversation):
    c, answer, first_turn = conversation
    tok = build_char_tokenizer()
    own = [t for t, m in zip(c.token_ids, c.mask) if m]
    assert c.model_tokens == len(own) == len(c.token_ids) - len(answer)
    assert c.model_text == tok.decode(own, skip_special_tokens=True) and "56088" not in c.model_text
    _, response, _, num_tokens, *_ = reward_item(c, Prompt("p", PROMPT, "x"))
    assert (response, num_tokens) == (c.model_text, c.model_tokens)
    plain = replace(c, model_text=None, model_tokens=None)  # a single-turn completion: its text, its tokens
    assert reward_item(plain, Prompt("p", PROMPT, "x"))[1:4] == (c.text, "x", len(c.token_ids))


# --- the trainer: tokens in, tokens out; a tool's tokens carry no gradient ---------------------------------
@pytest.fixture(scope="module")
def conversation(model_dir, tags):
    """A conversation of the engine (first turn, tool answer, second turn) and the answer's ids."""
    prompt, _, call_open, call_close, first_turn = tags
    eng = engine(model_dir)
    eng.use_tools(call_open, call_close, max_turns=1)
    c = run(eng, [Request("r", "p", prompt, sampled())], tool=lambda text: ANSWER)["r"]
    return c, eng.tokenizer.encode(ANSWER, add_special_tokens=False), first_turn


def group_of(*completions):
    samples = [ScoredSample(c, reward) for c, reward in zip(completions, (1.0, 0.0))]
    return Group(Prompt("p", PROMPT, ""), samples)


def test_the_trainer_scores_exactly_the_ids_the_engine_sampled(model_dir, conversation):
    c, answer, first_turn = conversation
    other = replace(c, request_id="o", token_ids=c.token_ids[:first_turn], logprobs=c.logprobs[:first_turn],
                    versions=c.versions[:first_turn], mask=[], turns=[])
    sample = build_samples([group_of(c, other)], "grpo")[0]
    assert sample.input_ids == c.prompt_ids + c.token_ids  # never re-tokenized from the text
    tool_run = sample.input_ids[len(c.prompt_ids) + first_turn:][:len(answer)]
    assert tool_run == answer and sample.mask == c.mask
    scored = TorchBackend(TrainerConfig(backend="torch"), model_dir, Scoring(1.0)).compute_logprobs([sample])[0]
    model_tokens = [i for i, m in enumerate(c.mask) if m]
    assert [scored[i] for i in model_tokens] == pytest.approx([c.logprobs[i] for i in model_tokens], abs=2e-4)


def test_a_tools_tokens_carry_no_gradient_loss_kl_or_count(model_dir, conversation):
    """A conversation cut right after the tool's answer trains exactly as its first turn alone: the answer adds
    nothing to the gradient (policy loss, KL, entropy bonus) nor to the token count the loss divides by."""
    c, answer, first_turn = conversation
    n = first_turn + len(answer)
    with_answer = replace(c, token_ids=c.token_ids[:n], logprobs=c.logprobs[:n], versions=c.versions[:n],
                          mask=c.mask[:n], finish_reason="length")
    alone = replace(c, token_ids=c.token_ids[:first_turn], logprobs=c.logprobs[:first_turn],
                    versions=c.versions[:first_turn], mask=[], turns=[])
    other = replace(c, request_id="o", token_ids=c.token_ids[:3], logprobs=c.logprobs[:3], versions=c.versions[:3],
                    mask=[], turns=[])
    cfg = TrainerConfig(backend="torch", loss="grpo", kl={"estimator": "k3", "coef": 0.1}, entropy_coeff=0.01)
    backend = TorchBackend(cfg, model_dir, Scoring(1.0))

    def gradients(completion):
        samples = build_samples([group_of(completion, other)], cfg.advantage)
        _, totals = plan_step(samples, 1, cfg.micro_batch_tokens)
        backend.accumulate_gradients(samples, totals)
        grads = {k: p.grad.clone() for k, p in backend.model.named_parameters() if p.grad is not None}
        backend.model.zero_grad(set_to_none=True)
        return totals.tokens, grads

    tokens, grads = gradients(with_answer)
    tokens_alone, grads_alone = gradients(alone)
    assert tokens == tokens_alone == first_turn + 3
    assert grads.keys() == grads_alone.keys() and grads
    for k in grads:
        assert torch.allclose(grads[k], grads_alone[k], atol=1e-7, rtol=1e-5), k


# --- the rollout worker: real tools on threads beside the generation thread (no Ray) --------------------------
CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "123*456"}}</tool_call>'
SLOW_TOOL = "import time\n\ndef slow(seconds):\n    time.sleep(seconds)\n    return 'done'\n"


def worker_with(model_dir, fns, slots=2, pacer=None, **tools):
    return RolloutWorker(model_dir, slots, engine_kwargs={"max_len": 256, "pacer": pacer},
                         tools=ToolsConfig(fns=fns, **tools))


def cut_at_call(eng_tokenizer, prompt, call=CALL, rid="r", n=180):
    """A conversation cut while its tool ran: its tokens end with the model's call (resumed, it is made again)."""
    ids = eng_tokenizer.encode(call, add_special_tokens=False)
    return Request(rid, "p", prompt, sampled(n), resume_ids=ids, resume_logprobs=[-1.0] * len(ids),
                   resume_versions=[0] * len(ids), resume_mask=[1] * len(ids))


def drain_all(worker, n, timeout_s=60):
    got, deadline = {}, time.time() + timeout_s
    while len(got) < n and time.time() < deadline:
        got.update((c.request_id, c) for c in worker.drain(timeout_s=1.0))
    assert len(got) == n, f"{len(got)} of {n} completions"
    return got


def test_a_conversation_cut_during_its_tool_call_resumes_with_the_calculators_answer(model_dir):
    worker = worker_with(model_dir, ["calculator"])
    try:
        tok = worker.engine.tokenizer
        prompt = tok.encode(PROMPT, add_special_tokens=False)
        r = cut_at_call(tok, prompt)
        worker.submit([r])
        c = drain_all(worker, 1)["r"]
    finally:
        worker.stop()
    answer = tok.encode("<tool_response>56088</tool_response>", add_special_tokens=False)
    n = len(r.resume_ids)
    assert c.token_ids[:n] == r.resume_ids and c.token_ids[n:n + len(answer)] == answer
    assert c.mask == [1] * n + [0] * len(answer) + [1] * (len(c.token_ids) - n - len(answer))
    assert [(t.name, t.ok) for t in c.turns] == [("calculator", True)]
    assert worker.engine.counters.prefilled_tokens == len(prompt) + n + len(answer)  # once, on admission


def test_a_call_the_tools_cannot_read_is_answered_with_its_error_over_the_kept_kv_cache(model_dir, tags):
    """The worker's path for a call the model wrote (tags as in `tags`): the ToolBox cannot read it, so its
    error is the answer (tools.on_failure=keep), appended over the slot's KV cache, and the model goes on."""
    prompt, single, call_open, call_close, first_turn = tags
    worker = worker_with(model_dir, ["calculator"])
    worker.engine.use_tools(call_open, call_close, max_turns=1)  # before any request: the thread is idle
    try:
        worker.submit([Request("r", "p", prompt, sampled(200))])  # room for the error after the first turn
        c = drain_all(worker, 1)["r"]
    finally:
        worker.stop()
    [turn] = c.turns
    assert not turn.ok and "cannot be read" in turn.error
    n = c.mask.index(1, first_turn) if 1 in c.mask[first_turn:] else len(c.mask)
    answer = worker.engine.tokenizer.decode(c.token_ids[first_turn:n])
    assert c.token_ids[:first_turn] == single[:first_turn] and answer.startswith("<tool_response>error: the call")
    assert n < len(c.mask)  # the model went on after the answer
    assert worker.engine.counters.prefilled_tokens == len(prompt) + 1 + n - first_turn


def test_a_slow_tool_takes_the_conversations_time_while_other_sequences_decode(model_dir, tmp_path):
    """On the emulated clock: tool latency is the run's wall time; the engine keeps stepping meanwhile."""
    (tmp_path / "slow.py").write_text(SLOW_TOOL)
    pacer = Emulation(EmulateConfig(gpu="h100", model="qwen2.5-7b")).engine_pacer()
    worker = worker_with(model_dir, [f"{tmp_path / 'slow.py'}:slow"], pacer=pacer)
    try:
        tok = worker.engine.tokenizer
        prompt = tok.encode(PROMPT, add_special_tokens=False)
        slow = cut_at_call(tok, prompt, '<tool_call>{"name": "slow", "arguments": {"seconds": 1.0}}</tool_call>',
                           "slow", n=150)
        worker.submit([slow, Request("other", "p", prompt, sampled(200))])
        done = drain_all(worker, 2)
    finally:
        worker.stop()
    c, turn = done["slow"], done["slow"].turns[0]
    assert turn.ok and turn.elapsed_s >= 1.0
    assert c.start_time - c.submit_time >= 1.0  # it waited on its tool, in the run's own time
    assert c.end_time - c.submit_time >= turn.elapsed_s
    # the other sequence decoded, paced, while the tool ran
    assert worker.engine.counters.decode_steps_within(c.submit_time + 0.05, c.submit_time + 0.5) > 0
    assert pacer.held > 0


def test_abort_while_the_tool_runs_then_resume_goes_on_as_if_never_cut(model_dir, tags, conversation):
    """Cut while its tool runs (it holds its slot): the partial carries its tokens and mask; resumed from them, the
    call is made again and the conversation ends exactly as the uninterrupted one (seeded sampling)."""
    prompt, _, call_open, call_close, first_turn = tags
    uninterrupted = conversation[0]
    eng = engine(model_dir)
    eng.use_tools(call_open, call_close, max_turns=1)
    eng.add(Request("r", "p", prompt, sampled()))
    calls = []
    while not calls:
        assert not eng.step()
        calls = eng.take_calls()
    eng.step()  # the engine steps on while the tool runs; the held conversation gains no token
    [cut] = eng.abort(["r"])
    assert cut.finish_reason == "abort" and len(cut.token_ids) == first_turn and cut.mask == []
    eng.extend("r", first_turn, [5, 6], ToolTurn("late", True))  # the cut call's answer, come too late: ignored
    assert not eng.has_work()
    resumed = Request("r", "p", prompt, sampled(), **cut.resume_fields())
    c = run(eng, [resumed], tool=lambda text: ANSWER)["r"]
    assert c.token_ids == uninterrupted.token_ids and c.mask == uninterrupted.mask
    assert c.logprobs == pytest.approx(uninterrupted.logprobs, abs=1e-4)
    assert [t.name for t in c.turns] == ["echo"]


def test_a_tool_printing_special_tokens_gives_their_text_not_the_tokens(model_dir, tmp_path):
    (tmp_path / "t.py").write_text("def specials():\n    return '<eos><pad>'\n")
    worker = worker_with(model_dir, [f"{tmp_path / 't.py'}:specials"])
    try:
        tok = worker.engine.tokenizer
        call = '<tool_call>{"name": "specials", "arguments": {}}</tool_call>'
        r = cut_at_call(tok, tok.encode(PROMPT, add_special_tokens=False), call)
        worker.submit([r])
        c = drain_all(worker, 1)["r"]
    finally:
        worker.stop()
    n = len(r.resume_ids)
    answer = c.token_ids[n:n + c.mask[n:].index(1)] if 1 in c.mask[n:] else c.token_ids[n:]
    assert tok.decode(answer) == "<tool_response><eos><pad></tool_response>"
    assert not {tok.eos_token_id, tok.pad_token_id} & set(answer)  # as characters, one token each
    assert len(answer) == len("<tool_response><eos><pad></tool_response>")


ENV = """
class Guess:
    def reset(self, sample):
        self.secret = len(sample["prompt"])

    def step(self, action):
        n = int(action)
        return ("correct", 1.0, True) if n == self.secret else ("higher" if n < self.secret else "lower", -0.25, False)
"""


def test_an_environment_s_feedback_joins_the_conversation_and_its_done_ends_it(model_dir, tmp_path):
    """tools.env: reset with the conversation's prompt, stepped with the model's action; a wrong guess's feedback is
    appended and the model goes on, a right one ends the conversation there ("stop") with the turn's reward."""
    (tmp_path / "guess.py").write_text(ENV)
    worker = RolloutWorker(model_dir, 2, engine_kwargs={"max_len": 256},
                           tools=ToolsConfig(env=f"{tmp_path / 'guess.py'}:Guess"))
    try:
        tok = worker.engine.tokenizer
        prompt = tok.encode(PROMPT, add_special_tokens=False)
        right = cut_at_call(tok, prompt, f"<tool_call>{len(PROMPT)}</tool_call>", "right")
        wrong = cut_at_call(tok, prompt, "<tool_call>3</tool_call>", "wrong")
        worker.submit([right, wrong])
        done = drain_all(worker, 2)
    finally:
        worker.stop()
    c = done["right"]
    answer = tok.encode("<tool_response>correct</tool_response>", add_special_tokens=False)
    assert c.finish_reason == "stop" and c.token_ids == right.resume_ids + answer
    assert [(t.name, t.ok, t.reward) for t in c.turns] == [("env", True, 1.0)]
    w, n = done["wrong"], len(wrong.resume_ids)
    feedback = tok.encode("<tool_response>higher</tool_response>", add_special_tokens=False)
    assert w.token_ids[n:n + len(feedback)] == feedback and len(w.token_ids) > n + len(feedback)  # it went on
    assert w.turns[0].reward == -0.25


def test_no_busy_spin_while_every_slot_waits_on_a_tool(model_dir, tags, tmp_path):
    """Both slots hold conversations waiting on their calls (queued behind a slow call on the one tool thread) and
    a third request waits for a slot: the generation thread sleeps until an answer comes, taking under 10% of a
    core, measured as this process's CPU time over the wall time."""
    prompt, _, call_open, call_close, first_turn = tags
    (tmp_path / "slow.py").write_text(SLOW_TOOL)
    worker = worker_with(model_dir, [f"{tmp_path / 'slow.py'}:slow"], max_workers=1, timeout_s=10.0)
    worker.engine.use_tools(call_open, call_close, max_turns=1)  # before any request: the thread is idle
    try:
        slow = '<tool_call>{"name": "slow", "arguments": {"seconds": 3.0}}</tool_call>'
        worker._tool_pool.submit(worker.tools.run, slow)  # another conversation's call holds the tool thread
        worker.submit([Request(f"r{i}", "p", prompt, sampled()) for i in range(3)])
        deadline = time.time() + 2
        while len(worker.engine.waiting) + len(worker.engine.running) < 3 or not all(
                e.held for e in worker.engine.running.values()) and time.time() < deadline:
            time.sleep(0.01)
        assert len(worker.engine.running) == 2 and all(e.held for e in worker.engine.running.values())
        wake_ups, can_step = [], worker._can_step  # the loop asks it at each wake-up: counted, still answered
        worker._can_step = lambda: wake_ups.append(1) or can_step()
        cpu, wall = time.process_time(), time.monotonic()
        time.sleep(1.5)
        share = (time.process_time() - cpu) / (time.monotonic() - wall)
        woken = len(wake_ups)
        assert len(worker.engine.waiting) == 1  # still queued: the tools still hold both slots
        assert share < 0.10, f"the process used {share:.0%} of a core while every slot waited on a tool"
        assert woken <= 5, f"the generation thread woke {woken} times in 1.5 s with nothing to do"  # polling 1 ms: 3000
        done = drain_all(worker, 3)
    finally:
        worker.stop()
    assert all(len(done[f"r{i}"].turns) == 1 for i in range(3))


# --- the manager: workers as Ray actors, each building its tools from the config ------------------------------
def test_suspend_while_a_tool_runs_then_resume_finishes_the_conversation(ray_cluster, model_dir, tmp_path):
    """RolloutManager.suspend (eval's pause) cuts a conversation waiting on its tool once the tool has answered:
    the cut keeps its tokens and the answer; resume() gives it back and the model goes on from the answer (the
    call is never made again) to its end."""
    import ray

    from rlsys.rollout.manager import RolloutManager

    (tmp_path / "slow.py").write_text(SLOW_TOOL)
    manager = RolloutManager(model_dir, num_workers=1, slots=2, torch_threads=1, drain_timeout_s=0.5,
                             engine_kwargs={"max_len": 256}, tools=ToolsConfig(fns=[f"{tmp_path / 'slow.py'}:slow"]))
    try:
        tok = read_tokenizer(Path(model_dir))
        prompt = tok.encode(PROMPT, add_special_tokens=False)
        call = '<tool_call>{"name": "slow", "arguments": {"seconds": 0.5}}</tool_call>'
        r = cut_at_call(tok, prompt, call, "c", n=150)
        manager.submit([r])
        time.sleep(0.2)  # its tool runs
        manager.suspend()
        while not manager.suspended:
            ready, _ = ray.wait(manager.refs(), num_returns=1, timeout=1.0)
            assert manager.collect(ready) == []  # the partial is held for resume, not delivered
        [held] = manager.suspended
        answer = tok.encode("<tool_response>done</tool_response>", add_special_tokens=False)
        assert held.resume_ids == r.resume_ids + answer and [t.name for t in held.resume_turns] == ["slow"]
        manager.resume()
        deadline, got = time.time() + 60, []
        while not got and time.time() < deadline:
            ready, _ = ray.wait(manager.refs(), num_returns=1, timeout=1.0)
            got = manager.collect(ready)
    finally:
        manager.shutdown()
    [c] = got
    n = len(r.resume_ids)
    assert c.token_ids[:n + len(answer)] == r.resume_ids + answer and c.mask[n:n + len(answer)] == [0] * len(answer)
    assert [(t.name, t.ok) for t in c.turns] == [("slow", True)]


def test_a_conversation_dropped_for_a_failed_call_trains_nothing_but_counts_in_its_group(conversation):
    """tools.on_failure=drop: the sample leaves training (counted) and still sets its group's advantages."""
    c, _, first_turn = conversation
    failed = replace(c, turns=[ToolTurn("calculator", False, "timed out", 5.0, reward=0.25)])
    failed.drop_from_training()
    other = replace(c, request_id="o", token_ids=c.token_ids[:3], logprobs=c.logprobs[:3], versions=c.versions[:3],
                    mask=[], turns=[])
    [trained] = build_samples([group_of(failed, other)], "grpo")  # rewards 1 (the dropped one) and 0
    assert trained.input_ids == other.prompt_ids + other.token_ids and trained.advantage < 0
    assert tool_metrics([failed, other]) == {"rollout/tool_calls": 1, "rollout/tool_failures": 1,
                                             "rollout/tool_dropped": 1, "rollout/turns": 0.5,
                                             "rollout/turn_reward": 0.25}


# --- the schedulers: a conversation is one request to tail and async -------------------------------------------
class Driver:
    """Applies a scheduler's actions to one engine, as the controller does, with the tool under the test's
    control: a call is answered at once unless its request is in `hold` (its tool still running)."""

    def __init__(self, sched, eng):
        self.sched, self.eng, self.hold, self.waiting, self.trains, self.uids = sched, eng, set(), {}, [], {}
        self.answer = eng.tokenizer.encode(ANSWER, add_special_tokens=False)

    def apply(self, actions):
        for a in actions:
            if isinstance(a, Submit):
                prompt = self.eng.tokenizer.encode(a.prompt.text, add_special_tokens=False)
                for rid in a.request_ids:
                    self.uids[rid] = a.prompt.uid
                    self.eng.add(Request(rid, a.prompt.uid, prompt, sampled()))
            elif isinstance(a, Abort):
                for c in self.eng.abort(a.request_ids):
                    self.apply(self.sched.on_abort(c, 0.0))
            elif isinstance(a, Train):
                self.trains.append(a.groups)

    def reply(self, rid):
        self.eng.extend(rid, self.waiting.pop(rid), self.answer, ToolTurn("echo", True, None, 0.0))

    def until(self, done, limit=2000):
        """Step the engine, delivering finished samples, until `done()`."""
        for _ in range(limit):
            if done():
                return
            for c in self.eng.step():
                self.apply(self.sched.on_sample(ScoredSample(c, float(len(c.turns))), 0.0))
            for rid, at, _ in self.eng.take_calls():
                self.waiting[rid] = at
                if rid not in self.hold:
                    self.reply(rid)
        raise AssertionError("the engine never got there")


def scheduler(name, **control):
    cfg = ControlConfig(scheduler=name, prompts_per_step=1, group_size=2, **control)
    prompts = [Prompt(f"q{i}", PROMPT, "56088", index=i) for i in range(8)]
    return SCHEDULERS.get(name)(cfg, PromptCursor(prompts, seed=0), GROUP_SIZERS.get("fixed")(cfg))


def test_tail_defers_a_conversation_waiting_on_its_tool_then_runs_it_whole_in_a_long_round(model_dir, tags):
    """A short round draws two prompts; the second's tool hangs, so the first completes the round: the second's
    conversations are cut mid-conversation, queued, and regenerated from scratch in the next (long) round."""
    _, _, call_open, call_close, first_turn = tags
    eng = engine(model_dir, slots=4)
    eng.use_tools(call_open, call_close, max_turns=1)
    sched = scheduler("tail", tail={"eta_p": 2.0})
    d = Driver(sched, eng)
    first = sched.start(0.0)
    slow = first[1].prompt.uid
    d.hold = set(first[1].request_ids)
    d.apply(first)
    d.until(lambda: d.trains)
    [[group]] = d.trains
    assert group.prompt.uid != slow and all(len(s.completion.turns) == 1 for s in group.samples)
    assert [d.prompt.uid for d in sched.queue] == [slow] and not eng.has_work()  # cut while waiting on its tool
    assert sched.counts["wasted_tokens"] == 2 * first_turn
    sched.on_trained(1, d.trains[0])
    d.hold, second = set(), sched.start(0.0)
    assert sched.long_round and [a.prompt.uid for a in second] == [slow]
    assert not set(second[0].request_ids) & set(first[1].request_ids)  # fresh requests, nothing resumed
    d.apply(second)
    d.until(lambda: len(d.trains) == 2)
    [[deferred]] = d.trains[1:]
    assert deferred.prompt.uid == slow
    for s in deferred.samples:
        c = s.completion
        assert len(c.turns) == 1 and c.mask[first_turn:first_turn + len(d.answer)] == [0] * len(d.answer)


def test_async_a_conversation_spanning_a_weight_publish_records_each_tokens_version(model_dir, tags, conversation):
    """Async (eta=1): the second prompt's conversations wait on their tool while the first prompt trains and
    version 1 is published; their first turns keep version 0, the tool's answer and the turn after it are 1,
    and the Train that takes them is within the staleness bound."""
    _, _, call_open, call_close, first_turn = tags
    eng = engine(model_dir, slots=4)
    eng.use_tools(call_open, call_close, max_turns=1)
    sched = scheduler("async", staleness={"eta": 1})
    d = Driver(sched, eng)
    admitted = sched.start(0.0)
    assert len(admitted) == 2  # eta=1: a second batch is admitted ahead of the first train
    d.hold = set(admitted[1].request_ids)
    d.apply(admitted)
    d.until(lambda: d.trains)
    assert d.waiting.keys() == d.hold  # the second prompt's conversations wait on their tool
    eng.load_weights(load_file(Path(model_dir) / "model.safetensors"), 1)  # version 1's publish, while they wait
    sched.on_trained(1, d.trains[0])
    d.apply(sched.start(0.0))
    for rid in sorted(d.hold):
        d.reply(rid)
    d.until(lambda: len(d.trains) == 2)
    [[group]] = d.trains[1:]
    n = len(d.answer)
    for s in group.samples:
        c = s.completion
        assert c.token_ids == conversation[0].token_ids  # the same weights: the same conversation
        assert c.versions == [0] * first_turn + [1] * (len(c.token_ids) - first_turn)
        assert c.mask[first_turn:first_turn + n] == [0] * n
    sched.ledger.check(sched.in_flight_prompts())


# --- the vLLM engine: the same conversation code, a continuation served from the prefix cache ------------------
def test_the_vllm_engine_continues_a_conversation_over_its_prefix_cache(model_dir, monkeypatch):
    """On the vLLM stand-in (tests/vllm_standin.py): the turn ends at the call, the answer's ids join masked, and
    the next turn is a new vLLM request on the ids so far whose only uncached tokens are the answer's."""
    import vllm_standin
    from rlsys.rollout.vllm_engine import VLLMEngine

    vllm_standin.install(monkeypatch)
    eng = VLLMEngine(model_dir, 2, max_len=256)
    assert eng.llm.args.enable_prefix_caching
    prompt = eng.tokenizer.encode(PROMPT, add_special_tokens=False)
    single = run(eng, [Request("s", "p", prompt, sampled())])["s"].token_ids
    chars = [eng.tokenizer.decode([t]) for t in single]
    k = next(k for k in range(4, 40) if all(len(c) == 1 and c.isascii() and c.isprintable() for c in chars[k:k + 2])
             and chars[k] + chars[k + 1] not in eng.tokenizer.decode(single[:k + 1]))
    eng.use_tools(chars[0], chars[k] + chars[k + 1], max_turns=1)
    eng.llm.reset_prefix_cache()
    fmt = ToolFormat.of(eng.tokenizer)
    c = run(eng, [Request("r", "p", prompt, sampled())], tool=lambda text: "42", encode=fmt.response_ids)["r"]
    answer = fmt.response_ids(eng.tokenizer, "42")
    first = k + 2
    assert c.token_ids[:first] == single[:first] and c.token_ids[first:first + len(answer)] == answer
    assert c.mask == [1] * first + [0] * len(answer) + [1] * (len(c.token_ids) - first - len(answer))
    assert len(c.token_ids) <= 60 and [t.name for t in c.turns] == ["echo"]
    assert [n for rid, n in eng.llm.computed if rid == "r"] == [len(prompt), len(answer)]
