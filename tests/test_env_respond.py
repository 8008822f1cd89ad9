"""An environment that answers any model turn, as verifiers' env_response and veRL's interaction do: its
respond(messages) sees the conversation, answers a turn that ended without a call as the user, gives the turn a
reward and may end the episode; tools answer the calls beside it in one run; a model without a chat template gets
one from model.chat_template."""
import time

import pytest

from rlsys.config import ConfigError, ModelConfig, ToolsConfig
from rlsys.models import ModelDirError, load_tokenizer, prepare_model
from rlsys.models.tiny import build_tiny_model
from rlsys.rollout.worker import RolloutWorker
from rlsys.startup import load_config
from rlsys.tools import CALL_CLOSE, CALL_OPEN, ToolBox
from rlsys.tools.format import ToolFormat
from rlsys.tools.schemas import tool_schemas
from rlsys.types import Completion, Request, SamplingParams, ToolTurn

TUTOR = '''
class Tutor:
    """Answers each turn without a call with what it saw; the second such turn ends the episode."""
    tools = [{"type": "function", "function": {"name": "hint", "description": "a hint", "parameters": {}}}]

    def reset(self, sample):
        self.turns = 0

    def respond(self, messages):
        self.turns += 1
        seen = " | ".join(f"{m['role']}:{m['content']}" for m in messages[1:])
        return f"turn {self.turns} saw {seen}", 0.25 * self.turns, self.turns == 2
'''
TEMPLATE = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}</s>{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")


@pytest.fixture(scope="module")
def tutor(tmp_path_factory):
    path = tmp_path_factory.mktemp("env") / "tutor.py"
    path.write_text(TUTOR)
    return f"{path}:Tutor"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    cfg = ModelConfig(hidden_size=32, num_heads=2, num_kv_heads=1, intermediate_size=64, max_position_embeddings=256)
    return str(build_tiny_model(cfg, tmp_path_factory.mktemp("m") / "m", seed=3))


def finished(worker, request: Request, timeout_s: float = 60) -> Completion:
    worker.submit([request])
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        got = worker.drain(timeout_s=1.0)
        if got:
            [c] = got
            return c
    raise AssertionError("no completion")


def forced(tok, ids: list[int], mask: list[int] | None = None, turns: list[ToolTurn] = ()) -> Request:
    """A request whose model has already written `ids` (`mask`: 0 for answers' tokens, `turns` their records): the
    engine goes on from their end."""
    return Request("r", "p", tok.encode("talk: ", add_special_tokens=False),
                   SamplingParams(max_new_tokens=200, temperature=1.0, seed=5), resume_ids=ids,
                   resume_logprobs=[-1.0] * len(ids), resume_versions=[0] * len(ids),
                   resume_mask=mask or [1] * len(ids), resume_turns=list(turns))


def own(tok, text: str) -> list[int]:
    """The model's turn: `text` and its end-of-turn token."""
    return tok.encode(text, add_special_tokens=False) + [tok.eos_token_id]


def test_the_environment_answers_a_turn_without_a_call_sees_the_messages_and_ends_the_episode(model_dir, tutor):
    """A turn that ends at EOS without a call is answered as the user (before: it ended the conversation); a
    resumed conversation's second answer comes from an environment replayed through its first (turn 2), which
    ends the episode with the answer, each turn's reward recorded."""
    worker = RolloutWorker(model_dir, 2, engine_kwargs={"max_len": 256}, tools=ToolsConfig(env=tutor))
    try:
        tok = worker.engine.tokenizer
        hello, later = own(tok, "hello"), own(tok, "again")
        answer = "turn 1 saw assistant:hello"
        answer_ids = ToolFormat.of(tok).user_ids(tok, answer, "hello")
        n, ids = len(hello), hello + answer_ids + later
        done = finished(worker, forced(tok, ids, [1] * n + [0] * len(answer_ids) + [1] * len(later),
                                       [ToolTurn("respond", True, reward=0.25, answer=answer)]))
        single = finished(worker, forced(tok, hello))
    finally:
        worker.stop()
    assert single.turns[0].name == "respond" and single.turns[0].reward == 0.25
    assert single.token_ids[n:n + len(answer_ids)] == answer_ids, tok.decode(single.token_ids[n:])
    assert done.finish_reason == "stop"
    [second] = done.turns[1:]
    assert (second.reward, second.answer) == (0.5, f"turn 2 saw assistant:hello | user:{answer} | assistant:again")
    assert done.token_ids[len(ids):] == ToolFormat.of(tok).user_ids(tok, second.answer, "again")


def test_tools_and_an_environment_answer_one_conversation(model_dir, tutor):
    """The calculator answers the call; the environment answers the turn after it, seeing the tool's message; the
    model is shown both's schemas."""
    tools = ToolsConfig(fns=["calculator"], env=tutor, max_turns=3)
    assert [s["function"]["name"] for s in tool_schemas(tools)] == ["calculator", "hint"]
    worker = RolloutWorker(model_dir, 2, engine_kwargs={"max_len": 256}, tools=tools)
    try:
        tok = worker.engine.tokenizer
        call = f'{CALL_OPEN}{{"name": "calculator", "arguments": {{"expression": "2*3"}}}}{CALL_CLOSE}'
        call_ids = tok.encode(call, add_special_tokens=False)
        answer_ids = ToolFormat.of(tok).responses_ids(tok, ["6"], call)
        said = own(tok, "six")
        done = finished(worker, forced(tok, call_ids + answer_ids + said,
                                       [1] * len(call_ids) + [0] * len(answer_ids) + [1] * len(said),
                                       [ToolTurn("calculator", True, answer="6")]))
    finally:
        worker.stop()
    assert [t.name for t in done.turns[:2]] == ["calculator", "respond"]
    assert done.turns[1].answer == f"turn 1 saw assistant:{call} | tool:6 | assistant:six"


def test_beside_tools_the_calls_go_to_the_tools_and_the_other_turns_to_the_environment(tutor):
    box = ToolBox(ToolsConfig(fns=["calculator"], env=tutor))
    try:
        calc = box.run(f'{CALL_OPEN}{{"name": "calculator", "arguments": {{"expression": "2*3"}}}}{CALL_CLOSE}', "c")
        said = box.respond([{"role": "user", "content": "p"}, {"role": "assistant", "content": "6"}], "c")
    finally:
        box.close()
    assert (calc.name, calc.text) == ("calculator", "6")
    assert (said.name, said.text, said.reward, said.done) == ("respond", "turn 1 saw assistant:6", 0.25, False)


def test_a_chat_template_from_the_config_is_the_model_s(model_dir, tmp_path):
    """model.chat_template (a file here) makes the run's model folder: the model's files and the template, which
    the tokenizer and the tool format read; the model folder itself is left as it was."""
    path = tmp_path / "chat.jinja"
    path.write_text(TEMPLATE)
    cfg = load_config(None, [f"model.path={model_dir}", f"model.chat_template={path}",
                             f"model.cache_dir={tmp_path / 'cache'}"])
    templated = prepare_model(cfg)
    assert prepare_model(cfg) == templated != model_dir
    tok = load_tokenizer(templated)
    assert tok.chat_template == TEMPLATE and not load_tokenizer(model_dir).chat_template
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert text == "<|user|>hi</s><|assistant|>"
    assert ToolFormat.of(tok).user_open == "</s><|user|>"
    text_cfg = load_config(None, [f"model.path={model_dir}", f"model.cache_dir={tmp_path / 'cache'}"])
    text_cfg.model.chat_template = TEMPLATE  # the template's text serves as well as its file
    assert load_tokenizer(prepare_model(text_cfg)).chat_template == TEMPLATE


def test_a_bad_chat_template_in_the_config_fails_at_check_naming_the_field(model_dir, tmp_path):
    with pytest.raises(ConfigError, match=r"model.chat_template.*neither a Jinja template .* nor a file"):
        load_config(None, [f"model.chat_template={tmp_path / 'missing.jinja'}"])
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for m in messages %}{{ m.content }}")
    with pytest.raises(ConfigError, match=r"model.chat_template.*broken.jinja is not a Jinja template: line 1"):
        load_config(None, [f"model.chat_template={broken}"])
    templated = tmp_path / "templated"
    templated.mkdir()
    (templated / "chat_template.jinja").write_text(TEMPLATE)
    with pytest.raises(ModelDirError, match=r"model.chat_template: .* has a chat template of its own"):
        from rlsys.models import with_chat_template
        with_chat_template(templated, TEMPLATE, tmp_path / "cache")
