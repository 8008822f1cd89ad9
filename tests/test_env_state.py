"""An environment's state survives what kills its process: a step past tools.timeout_s, and a conversation cut and
resumed (the partial every scheduler that cuts resumes: sorted's partial mode, async, eval's pause, a scale-down).
A counter environment shows it: each step says how many steps the episode's instance has taken."""
import time
from dataclasses import replace
from pathlib import Path

import pytest

from rlsys.config import ModelConfig, ToolsConfig
from rlsys.models.tiny import build_tiny_model
from rlsys.rollout.engine import read_tokenizer
from rlsys.rollout.worker import RolloutWorker
from rlsys.tools import CALL_CLOSE, CALL_OPEN, ToolBox
from rlsys.types import Completion, Request, SamplingParams

COUNTER = '''
import time


class Counter:
    """Says how many steps this episode took; `hang` never answers, `slow` takes half a second."""

    def reset(self, sample):
        self.n, self.prompt = 0, sample["prompt"]

    def step(self, action):
        if action == "hang":
            time.sleep(60)
        if action == "slow":
            time.sleep(0.5)
        if action == "boom":
            raise ValueError("boom")
        self.n += 1
        return f"step {self.n} of {self.prompt}", 0.0, False
'''


@pytest.fixture(scope="module")
def counter(tmp_path_factory):
    path = tmp_path_factory.mktemp("env") / "counter.py"
    path.write_text(COUNTER)
    return f"{path}:Counter"


def step(box, action, turns, conversation="c", made_at=None):
    result = box.run(f"{CALL_OPEN}{action}{CALL_CLOSE}", conversation, made_at, {"prompt": "p"}, turns)
    turns.append(result.turn)
    return result


def test_a_step_after_a_timed_out_step_continues_the_episode(counter):
    """The timed-out step's process is killed; the next step's new process is reset and replayed to step 4, so it
    says step 5 (the failed steps, told to the model as failures, are not replayed)."""
    box = ToolBox(ToolsConfig(env=counter, timeout_s=1.0))
    try:
        turns = []
        assert [step(box, a, turns).text for a in "abcd"] == [f"step {n} of p" for n in range(1, 5)]
        hung = step(box, "hang", turns)
        assert not hung.ok and "timed out" in hung.error and hung.turn.action is None
        failed = step(box, "boom", turns)
        assert not failed.ok and failed.turn.action is None
        assert step(box, "e", turns).text == "step 5 of p"
        assert [t.action for t in turns] == ["a", "b", "c", "d", None, None, "e"]
    finally:
        box.close()


def test_a_turn_of_several_steps_after_a_timeout_continues_the_episode(counter):
    box = ToolBox(ToolsConfig(env=counter, timeout_s=1.0, max_calls_per_turn=3))
    try:
        turns = []
        first = box.run_turn(f"{CALL_OPEN}a{CALL_CLOSE}{CALL_OPEN}b{CALL_CLOSE}", "c", None, {"prompt": "p"}, turns)
        turns += [r.turn for r in first]
        hung = box.run_turn(f"{CALL_OPEN}hang{CALL_CLOSE}{CALL_OPEN}c{CALL_CLOSE}", "c", None, {"prompt": "p"}, turns)
        assert [r.ok for r in hung] == [False, False]  # one state, stepped in call order: c waited behind hang
        turns += [r.turn for r in hung]
        after = box.run_turn(f"{CALL_OPEN}d{CALL_CLOSE}{CALL_OPEN}e{CALL_CLOSE}", "c", None, {"prompt": "p"}, turns)
        assert [r.text for r in first + after] == [f"step {n} of p" for n in (1, 2, 3, 4)]
    finally:
        box.close()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    cfg = ModelConfig(hidden_size=32, num_heads=2, num_kv_heads=1, intermediate_size=64, max_position_embeddings=256)
    return str(build_tiny_model(cfg, tmp_path_factory.mktemp("m") / "m", seed=3))


def drain(worker, timeout_s=60) -> Completion:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        got = worker.drain(timeout_s=1.0)
        if got:
            [c] = got
            return c
    raise AssertionError("no completion")


def test_a_conversation_cut_and_resumed_on_the_worker_continues_its_episode(model_dir, counter):
    """Cut (abort: the eval pause's suspend, sorted's and async's partials) while its slow step runs, the partial
    carries the answer; its process goes with the cut. Resumed from the partial's fields with the model's next call,
    the environment in the new process is replayed to where it was: the next step is the second."""
    worker = RolloutWorker(model_dir, 2, engine_kwargs={"max_len": 256}, tools=ToolsConfig(env=counter))
    try:
        tok = worker.engine.tokenizer
        prompt = tok.encode("count: ", add_special_tokens=False)
        call = tok.encode(f"{CALL_OPEN}slow{CALL_CLOSE}", add_special_tokens=False)
        params = SamplingParams(max_new_tokens=150, temperature=1.0, seed=7)
        worker.submit([Request("r", "p", prompt, params, resume_ids=call, resume_logprobs=[-1.0] * len(call),
                               resume_versions=[0] * len(call), resume_mask=[1] * len(call))])
        time.sleep(0.2)  # the step runs
        assert worker.abort(["r"]) == ["r"]
        cut = drain(worker)
        first = tok.encode("<tool_response>step 1 of count: </tool_response>", add_special_tokens=False)
        assert cut.finish_reason == "abort" and cut.token_ids == call + first
        assert [t.ok for t in cut.turns] == [True]
        assert worker.tools._processes == {}  # the cut took its process, and the instance with it
        nxt = tok.encode(f"{CALL_OPEN}next{CALL_CLOSE}", add_special_tokens=False)
        fields = cut.resume_fields()
        fields.update(resume_ids=cut.token_ids + nxt, resume_logprobs=cut.logprobs + [-1.0] * len(nxt),
                      resume_versions=cut.versions + [0] * len(nxt), resume_mask=fields["resume_mask"] + [1] * len(nxt))
        worker.submit([Request("r2", "p", prompt, params, **fields)])
        done = drain(worker)
    finally:
        worker.stop()
    second = tok.encode("<tool_response>step 2 of count: </tool_response>", add_special_tokens=False)
    n = len(call + first + nxt)
    assert done.token_ids[n:n + len(second)] == second, tok.decode(done.token_ids[n:])
    assert [t.action for t in done.turns] == ["slow", "next"]


def test_eval_s_pause_through_the_ray_manager_keeps_the_episode(ray_cluster, model_dir, counter):
    """RolloutManager.suspend (eval's pause) on a worker actor: the held request carries the answered action; given
    back with the model's next call, the environment of the resumed conversation goes on from step 1."""
    from rlsys.rollout.manager import RolloutManager

    manager = RolloutManager(model_dir, num_workers=1, slots=2, torch_threads=1, drain_timeout_s=0.5,
                             engine_kwargs={"max_len": 256}, tools=ToolsConfig(env=counter))
    try:
        tok = read_tokenizer(Path(model_dir))
        prompt = tok.encode("count: ", add_special_tokens=False)
        call = tok.encode(f"{CALL_OPEN}slow{CALL_CLOSE}", add_special_tokens=False)
        manager.submit([Request("c", "p", prompt, SamplingParams(max_new_tokens=150, seed=7), resume_ids=call,
                                resume_logprobs=[-1.0] * len(call), resume_versions=[0] * len(call),
                                resume_mask=[1] * len(call))])
        time.sleep(0.2)  # its step runs
        manager.suspend()
        while not manager.suspended:
            ready, _ = ray_cluster.wait(manager.refs(), num_returns=1, timeout=1.0)
            assert manager.collect(ready) == []
        [held] = manager.suspended
        assert [t.action for t in held.resume_turns] == ["slow"]
        nxt = tok.encode(f"{CALL_OPEN}next{CALL_CLOSE}", add_special_tokens=False)
        manager.suspended[0] = replace(held, resume_ids=held.resume_ids + nxt,
                                       resume_logprobs=held.resume_logprobs + [-1.0] * len(nxt),
                                       resume_versions=held.resume_versions + [0] * len(nxt),
                                       resume_mask=held.resume_mask + [1] * len(nxt))
        manager.resume()
        deadline, got = time.time() + 60, []
        while not got and time.time() < deadline:
            ready, _ = ray_cluster.wait(manager.refs(), num_returns=1, timeout=1.0)
            got = manager.collect(ready)
    finally:
        manager.shutdown()
    [c] = got
    n = len(held.resume_ids + nxt)
    second = "<tool_response>step 2 of count: </tool_response>"
    assert tok.decode(c.token_ids[n:]).startswith(second) and [t.action for t in c.turns] == ["slow", "next"]
