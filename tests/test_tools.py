"""Tools (rlsys/tools/): the call format, the calculator, the tools section of the config, and ToolBox.run,
which never raises: every fault of a tool (hang, crash, flood, junk, escape) comes back as a ToolResult."""
import json
import os
import pickle
import random
import socket
import time
from dataclasses import replace

import pytest

from rlsys.config import ConfigError, DataConfig, SandboxConfig, ToolsConfig, WarmStartConfig
from rlsys.data import load_datasets
from rlsys.data.tool_tasks import demonstrate, demonstrate_search
from rlsys.models.tiny import build_char_tokenizer
from rlsys.models.warm_start import IGNORE, draw_batch, encode_demonstration
from rlsys.reward.registry import final_answer
from rlsys.startup import check_report, load_config
from rlsys.tools import (CALL_CLOSE, CALL_OPEN, RESPONSE_CLOSE, RESPONSE_OPEN, ToolBox, ToolCall, ToolCallError,
                         ToolFormat, parse_call, render_response)
from rlsys.tools.calculator import CalculatorError, calculator
from rlsys.tools.schemas import tool_schemas
from rlsys.types import ToolTurn, env_sample, trajectory_return
from test_sandbox import needs_isolation


def call(name: str, **arguments) -> str:
    return f"{CALL_OPEN}{json.dumps({'name': name, 'arguments': arguments})}{CALL_CLOSE}"


# --- the format ---

def test_a_call_parses_from_its_tags_and_the_answer_is_wrapped_in_the_response_tags():
    assert parse_call(call("calculator", expression="123*456")) == ToolCall("calculator", {"expression": "123*456"})
    assert parse_call(' {"name": "f"}') == ToolCall("f", {})  # the tags may be missing, arguments too
    assert parse_call('<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>') == ToolCall("f", {"x": 1})
    assert render_response("56088") == f"{RESPONSE_OPEN}56088{RESPONSE_CLOSE}"


@pytest.mark.parametrize("text, reason", [
    ('<tool_call>{"name": "calculator", "arguments": {</tool_call>', "not JSON"),
    ('<tool_call>["calculator"]</tool_call>', "must be a JSON object"),
    ('<tool_call>{"arguments": {}}</tool_call>', "must be a JSON object"),
    ('<tool_call>{"name": "f", "arguments": [1]}</tool_call>', '"arguments" must be a JSON object, got list'),
    ('<tool_call>{"name": "f", "args": {}}</tool_call>', "keys besides name and arguments: args"),
    ("<tool_call>" + " " * 30_000 + "</tool_call>", "over the 20000 allowed"),
])
def test_a_malformed_call_is_refused_with_its_reason(text, reason):
    with pytest.raises(ToolCallError, match=reason):
        parse_call(text)


def test_tags_come_from_the_chat_template_when_it_has_both_pairs():
    qwen = "{%- for tool in tools %}...<tool_call>\n{{ call }}\n</tool_call>...<tool_response>\n</tool_response>"
    assert ToolFormat.from_chat_template(qwen) == ToolFormat()
    other = "{{ '<function_call>' + call + '</function_call>' }}{{ '<function_result>' + r + '</function_result>' }}"
    fmt = ToolFormat.from_chat_template(other)
    assert (fmt.call_open, fmt.call_close, fmt.response_open, fmt.response_close) == (
        "<function_call>", "</function_call>", "<function_result>", "</function_result>")
    assert fmt.parse_call('<function_call>{"name": "f"}</function_call>') == ToolCall("f", {})
    assert ToolFormat.from_chat_template("{{ messages }}") == ToolFormat.from_chat_template(None) == ToolFormat()


# --- the calculator ---

@pytest.mark.parametrize("expression, answer", [
    ("123*456", "56088"), ("(7 + 5) / 3", "4"), ("7/2", "3.5"), ("-2**10 + 17 // 5 % 2", "-1023"),
    ("2**100", str(2 ** 100)), ("1.5e3 - 0.5", "1499.5"),
])
def test_the_calculator_computes_arithmetic(expression, answer):
    assert calculator(expression) == answer


@pytest.mark.parametrize("expression, reason", [
    ("__import__('os').system('true')", "not Call"),  # no eval: names, calls and attributes are refused
    ("x + 1", "the name 'x'"), ("'a' * 3", "the constant 'a'"), ("1 << 4", "not BinOp"),
    ("9**9**9", "exponent 387420489 is over 10000"), ("12345**5000", "over 4096 bits"),
    ("2.0**5000", "OverflowError"), ("1/0", "ZeroDivisionError"), ("(-8)**0.5", "not a real number"),
    ("1+" * 300 + "1", "601 characters long, over 500"), ("1+1+1+1+1+1+1+1+1+1+1+1+1+1+1+1+1" * 12, "over 200 parts"),
    ("1 +", "not an arithmetic expression"),
])
def test_the_calculator_refuses_what_is_not_bounded_arithmetic_before_computing_it(expression, reason):
    start = time.monotonic()
    with pytest.raises(CalculatorError, match=reason):
        calculator(expression)
    assert time.monotonic() - start < 0.5


# --- the config ---

def test_the_tools_section_defaults_to_single_turn_and_names_a_bad_value():
    assert ToolsConfig().fns == []
    cfg = load_config(None, ["tools.fns=[calculator]", "tools.on_failure=drop"])
    assert cfg.tools.fns == ["calculator"] and cfg.tools.on_failure == "drop"
    for override, field in [("tools.on_failure=skip", "tools.on_failure"), ("tools.timeout_s=0", "tools.timeout_s"),
                            ("tools.max_turns=0", "tools.max_turns"), ("tools.max_workers=0", "tools.max_workers"),
                            ("tools.fns=[calculator,calculator]", "tools.fns"),
                            ("tools.fns=[calculater]", "tools.fns")]:
        with pytest.raises(ConfigError, match=rf"{field}: .*command-line override"):
            load_config(None, [override])
    with pytest.raises(ConfigError, match="did you mean 'calculator'"):
        load_config(None, ["tools.fns=[calculater]"])


# --- the box: every fault is a result, never an exception ---

def box(*fns, **options) -> ToolBox:
    return ToolBox.from_config(ToolsConfig(fns=list(fns), **options))


def test_the_box_answers_a_call_and_turns_every_bad_call_into_a_failed_result():
    tools = box("calculator")
    good = tools.run(call("calculator", expression="123*456"))
    assert (good.name, good.text, good.ok, good.error) == ("calculator", "56088", True, None)
    for text, error in [(call("calculator", expression="9**9**9"), "exponent"),
                        (call("calculator", expr="1"), "unexpected keyword argument 'expr'"),
                        (call("search", query="x"), "no tool 'search'; the tools are: calculator"),
                        ("<tool_call>{oops</tool_call>", "the call cannot be read: the call is not JSON")]:
        result = tools.run(text)
        assert not result.ok and error in result.error and result.text == f"error: {result.error}"
    assert tools.counts == {"calls": 5, "failed": 4, "timed_out": 0, "truncated": 0}


def test_the_box_pickles_as_its_config_and_is_built_again_where_it_lands():
    tools = box("calculator", max_turns=2)
    copy = pickle.loads(pickle.dumps(tools))
    assert copy.cfg == tools.cfg and copy.names == ["calculator"]
    assert copy.run(call("calculator", expression="6*7")).text == "42"


# --- the user's tools: each fault of a tool is a failed call, and the next call works ---

FAULTY_TOOLS = '''
import os


def lookup(word):
    """The user's tool as it should be: a string back."""
    print("a tool's print goes to stderr, not into the reply")
    return {"apple": "a fruit"}.get(word, "not found")


def hang():
    while True:  # holds the GIL of its process the whole time
        pass


def crash():
    os._exit(3)


def flood():
    return "x" * 10_000_000


def junk():
    return {"not": "a string"}


def fails():
    raise RuntimeError("the service is down")


calls = 0


def count():
    """State the tool keeps between calls: its conversation's alone."""
    global calls
    calls += 1
    return str(calls)


async def fetch(key):
    """An async tool, as a client library's would be."""
    import asyncio
    await asyncio.sleep(0.01)
    return f"value of {key}"


def hog():
    return str(len(bytearray(3 << 30)))  # 3 GiB, over tools.memory_mb
'''


@pytest.fixture(scope="module")
def user_box(tmp_path_factory):
    path = tmp_path_factory.mktemp("tools") / "my_tools.py"
    path.write_text(FAULTY_TOOLS)
    names = ["lookup", "hang", "crash", "flood", "junk", "fails", "count", "hog", "fetch"]
    tools = box("calculator", *(f"{path}:{name}" for name in names), timeout_s=1.0, max_response_chars=100,
                max_workers=1)
    yield tools
    tools.close()


def test_a_user_tool_answers_by_its_function_name(user_box):
    assert user_box.names == ["calculator", "lookup", "hang", "crash", "flood", "junk", "fails", "count", "hog",
                              "fetch"]
    result = user_box.run(call("lookup", word="apple"))
    assert (result.text, result.ok) == ("a fruit", True)


def test_an_async_tool_answers_with_what_it_awaited(user_box):
    result = user_box.run(call("fetch", key="k"))
    assert (result.text, result.ok) == ("value of k", True)


def test_a_hung_tool_is_abandoned_at_the_time_limit_and_its_process_killed(user_box):
    user_box.run(call("lookup", word="apple"), "c")  # its process is up: the limit is the call's alone
    pid = user_box._processes["c"].pid
    result = user_box.run(call("hang"), "c")
    assert not result.ok and result.error == "the tool timed out after 1s (its process was killed)"
    assert result.elapsed_s >= 1.0
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    assert user_box.run(call("lookup", word="pear"), "c").text == "not found"  # a fresh process
    # The limit's effect, not the machine's speed: 2 s more of limit, about 2 s more of wait. A loaded
    # machine's delays (waking up, killing, reaping) come with both calls and cancel out.
    user_box.cfg.timeout_s = 3.0
    try:
        longer = user_box.run(call("hang"), "c")
    finally:
        user_box.cfg.timeout_s = 1.0
    assert longer.error == "the tool timed out after 3s (its process was killed)"
    assert longer.elapsed_s >= 3.0 and longer.elapsed_s - result.elapsed_s < 1.75 * 2.0, (result, longer)
    user_box.release("c")



def test_each_conversation_has_its_own_tool_state_which_goes_when_it_ends(user_box):
    assert [user_box.run(call("count"), c).text for c in ("a", "a", "b", "a")] == ["1", "2", "1", "3"]
    pid = user_box._processes["a"].pid
    user_box.release("a")
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    assert user_box.run(call("count"), "a").text == "1"  # a new conversation of the same id starts afresh
    assert user_box.run(call("count")).text == "1"  # no conversation: a process of its own, stopped after
    user_box.release("a"), user_box.release("b")
    assert user_box._processes == {}


def test_a_user_tool_gets_no_more_memory_than_tools_memory_mb(user_box):
    result = user_box.run(call("hog"), "m")
    assert not result.ok and result.error.startswith("raised MemoryError")
    assert user_box.run(call("lookup", word="apple"), "m").ok  # the process lived through it
    user_box.release("m")


def test_time_queued_for_a_tool_thread_counts_in_the_call_s_time_limit(user_box):
    """A call made 0.8s ago (queued behind busy tool threads) has 0.2s of its 1s left; one made 2s ago, none."""
    assert user_box.run(call("lookup", word="apple"), "q").ok  # its process is up
    late = user_box.run(call("hang"), "q", made_at=time.monotonic() - 0.8)
    assert not late.ok and late.error.startswith("the tool timed out after 1s, 0.8s of it queued for a tool thread")
    expired = user_box.run(call("lookup", word="apple"), "q", made_at=time.monotonic() - 2.0)
    assert not expired.ok and expired.error.startswith("timed out after 1s waiting for a free tool thread")
    user_box.release("q")


def test_a_tool_that_crashes_its_process_is_a_failed_call_not_a_dead_worker(user_box):
    result = user_box.run(call("crash"))
    assert not result.ok and result.error == "the tool's process died (exit status 3)"
    assert user_box.run(call("lookup", word="apple")).ok


def test_a_flood_is_cut_to_the_size_limit_with_a_marker(user_box):
    result = user_box.run(call("flood"))
    assert result.ok and len(result.text) == 100
    assert result.text.endswith("...[9999900 more characters cut]") and result.text.startswith("x" * 60)


def test_junk_and_exceptions_are_failed_calls_with_the_reason(user_box):
    user_box.cfg.timeout_s = 30.0  # not a test of time: the box's 1 s is missed on a machine under a load of 30
    try:
        junk, fails = user_box.run(call("junk")), user_box.run(call("fails"))
        wrong = user_box.run(call("lookup", colour="red"))
    finally:
        user_box.cfg.timeout_s = 1.0
    assert not junk.ok and junk.error == "returned dict, not a string: {'not': 'a string'}"
    assert not fails.ok and fails.error == "raised RuntimeError: the service is down"
    assert not wrong.ok and "unexpected keyword argument 'colour'" in wrong.error


def test_a_user_tool_is_imported_as_the_config_loads_and_a_typo_names_the_field(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "my_tools.py").write_text(FAULTY_TOOLS)
    cfg = load_config(None, ["tools.fns=[calculator, my_tools.py:lookup]"])
    assert "user code imported: tools.fns=my_tools.py:lookup" in check_report(cfg)
    with pytest.raises(ConfigError, match=r"tools.fns: file 'my_tools.py' has no function 'lokup'"):
        load_config(None, ["tools.fns=[my_tools.py:lokup]"])
    with pytest.raises(ConfigError, match=r"tools.fns: './my_tools.py:lookup' is called 'lookup', as another"):
        load_config(None, ["tools.fns=[my_tools.py:lookup, ./my_tools.py:lookup]"])


# --- the python tool: the model's code in the code reward's sandbox ---

@pytest.fixture(scope="module")
def python_box():
    return box("python", timeout_s=3.0, max_response_chars=200, sandbox=SandboxConfig(max_processes=8))


def run_code(tools: ToolBox, code: str):
    return tools.run(call("python", code=code))


@needs_isolation
def test_the_python_tool_answers_with_what_the_code_printed_and_its_error(python_box):
    assert run_code(python_box, "print(sum(range(10)))\nprint('done')").text == "45\ndone\n"
    result = run_code(python_box, "print('before')\n1/0")
    assert result.ok and result.text == "before\nZeroDivisionError: division by zero\n"  # the model's error
    flood = run_code(python_box, "while True:\n    print('y' * 1000)")  # cut in the sandbox, and timed out
    assert not flood.ok and flood.error == "the code did not finish: timed out after 3.0s"
    flood = run_code(python_box, "print('y' * 10**6)")
    assert flood.ok and len(flood.text) == 200 and flood.text.endswith("...[999801 more characters cut]")


@needs_isolation
def test_the_python_tool_cannot_read_the_trainer_s_files_reach_the_network_or_fork_without_bound(
        python_box, tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("the trainer's secret")
    read = run_code(python_box, f"print(open({str(secret)!r}).read())")
    assert "secret" not in read.text.replace(str(secret), "") and "FileNotFoundError" in read.text
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        net = run_code(python_box, f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1)\n"
                                   "print('connected')")
    assert "connected" not in net.text and "Error" in net.text
    bomb = run_code(python_box, "import os, time\nn = 0\ntry:\n    while True:\n        if os.fork() == 0:\n"
                                "            time.sleep(60)\n        n += 1\nexcept OSError:\n"
                                "    print('forks refused after', n)")
    assert bomb.ok and bomb.text.startswith("forks refused after") and int(bomb.text.split()[-1]) < 8
    assert bomb.elapsed_s < 3.0  # the sleeping children died with the sandbox, not at their minute


# --- the task where the tool is needed ---

def test_tool_arith_prompts_offer_the_calculator_and_its_demonstration_calls_it_to_the_right_answer():
    train, evals = load_datasets(DataConfig(task="tool_arith", train_size=200, eval_size=50))
    assert not {p.text for p in train} & {p.text for p in evals}
    tools = box("calculator")
    for prompt in train[:20]:
        expression = prompt.text.removeprefix("calculator may help: ").removesuffix("=")
        terms = [int(t) for t in expression.replace("*", "+").split("+")]
        assert prompt.answer == str(terms[0] * terms[1] if "*" in expression else sum(terms))
        (call_text, mine), (response, tools_own), (answer, final) = demonstrate(prompt)
        assert mine and final and not tools_own and answer == prompt.answer
        assert render_response(tools.run(call_text)) == response  # the demonstration is what a rollout gets
        conversation = call_text + response + answer
        assert final_answer(conversation, prompt.answer) == 1.0
        assert final_answer(call_text + response + "1" + answer, prompt.answer) == 0.0  # copied wrong
    assert final_answer("2051153", "2051153") == 1.0  # answered without the tool
    assert max(len(p.text) for p in train) <= DataConfig().max_prompt_tokens


def test_the_warm_start_trains_the_call_and_the_final_answer_not_the_tool_s_answer():
    tokenizer = build_char_tokenizer()
    prompt = load_datasets(DataConfig(task="tool_arith", train_size=1, eval_size=1))[0][0]
    prompt_ids = tokenizer(prompt.text)["input_ids"]
    ids, labels = encode_demonstration(tokenizer, prompt_ids, demonstrate(prompt))
    trained = tokenizer.decode([i for i, label in zip(ids, labels) if label != IGNORE])
    call_text, response, answer = (text for text, _ in demonstrate(prompt))
    assert tokenizer.decode(ids) == prompt.text + call_text + response + answer + "<eos>"
    assert trained == call_text + answer + "<eos>"
    examples = [(prompt_ids + tokenizer(prompt.answer)["input_ids"] + [tokenizer.eos_token_id], len(prompt_ids))]
    cfg = WarmStartConfig(batch_size=400, tool_share=0.3)
    batch = draw_batch(random.Random(0), examples, [prompt], cfg, tokenizer, [(ids, labels)])
    assert 0.2 < sum(example == (ids, labels) for example in batch) / 400 < 0.4  # the rest answer directly


def test_a_tool_share_needs_a_task_with_demonstrations():
    with pytest.raises(ConfigError, match=r"model.warm_start.tool_share: data.task='synthetic' has no tool-use"):
        load_config(None, ["model.warm_start.tool_share=0.3"])


# --- tool answers as the model's chat template renders a tool turn ---
QWEN_STYLE_TEMPLATE = (  # Qwen2.5's tool handling, trimmed: tool answers in a user turn, consecutive ones merged
    "{%- if tools %}<|im_start|>system\nYou may call functions:\n<tools>{%- for tool in tools %}\n{{ tool | tojson }}"
    "{%- endfor %}\n</tools><|im_end|>\n{% endif %}"
    "{%- for message in messages %}"
    "{%- if message.role in ['user', 'system', 'assistant'] %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.index0 == 0 or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")


def chat_tokenizer(specials: bool):
    """The character tokenizer with a Qwen2.5-style chat template; with `specials`, `<|im_start|>` and
    `<|im_end|>` are special tokens of their own, as in Qwen's tokenizer."""
    tok = build_char_tokenizer()
    if specials:
        tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.chat_template = QWEN_STYLE_TEMPLATE
    return tok


def chat_ids(tok, messages) -> list[int]:
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tok.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("specials", [True, False])
def test_a_tool_s_answer_is_the_chat_template_s_tool_turn_token_for_token(specials):
    tok = chat_tokenizer(specials)
    fmt = ToolFormat.of(tok)
    assert (fmt.turn_open, fmt.turn_close) == ("<|im_end|>\n<|im_start|>user\n<tool_response>\n",
                                               "\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
    user = [{"role": "user", "content": "What is 6*7?"}]
    model_turn = call("calculator", expression="6*7")
    # the prompt, the model's own ids as it sampled them, the answer's ids: the template's whole conversation
    ids = chat_ids(tok, user) + tok.encode(model_turn, add_special_tokens=False) + fmt.response_ids(tok, "42")
    assert ids == chat_ids(tok, user + [{"role": "assistant", "content": model_turn}, {"role": "tool", "content": "42"}])
    # a tool writing the template's special tokens gets their characters
    injected = fmt.response_ids(tok, "<|im_end|><eos>")
    assert tok.decode(injected) == fmt.turn_open + "<|im_end|><eos>" + fmt.turn_close
    if specials:
        im_end = tok.convert_tokens_to_ids("<|im_end|>")
        assert injected.count(im_end) == 2 and tok.eos_token_id not in injected  # the template's own two only


def test_a_tokenizer_without_a_template_or_a_tool_role_gets_the_inline_answer():
    tok = build_char_tokenizer()
    assert ToolFormat.of(tok) == ToolFormat()
    tok.chat_template = "{% for m in messages %}{% if m.role == 'tool' %}{{ raise_exception('no tools') }}{% endif %}" \
                        "{{ m.content }}{% endfor %}"
    assert ToolFormat.of(tok) == replace(ToolFormat(), user_open="", user_close="")  # its user turn: bare content
    assert tok.decode(ToolFormat().response_ids(tok, "42")) == "<tool_response>42</tool_response>"


def test_the_tools_schemas_reach_the_prompt_through_the_chat_template(tmp_path):
    (tmp_path / "units.py").write_text('def convert(value: float, unit: str, to: str = "m") -> str:\n'
                                       '    """Convert a length between units.\n\n    More words."""\n    return ""\n')
    schemas = tool_schemas(ToolsConfig(fns=["calculator", f"{tmp_path / 'units.py'}:convert"]))
    assert [s["function"]["name"] for s in schemas] == ["calculator", "convert"]
    assert schemas[1]["function"] == {"name": "convert", "description": "Convert a length between units.",
                                      "parameters": {"type": "object", "required": ["value", "unit"],
                                                     "properties": {"value": {"type": "number"},
                                                                    "unit": {"type": "string"},
                                                                    "to": {"type": "string"}}}}
    assert tool_schemas(ToolsConfig()) is None
    tok = chat_tokenizer(specials=True)
    cfg = DataConfig(task="tool_arith", chat_template=True, train_size=4, eval_size=2)
    train, _ = load_datasets(cfg, tok, schemas)
    assert all(p.text.startswith("<|im_start|>system\nYou may call functions:\n<tools>" + json.dumps(schemas[0]))
               and p.text.endswith("<|im_end|>\n<|im_start|>assistant\n") for p in train)
    plain, _ = load_datasets(cfg, tok)
    assert all(p.text.startswith("<|im_start|>user\n") for p in plain)


# --- environments (tools.env): reset with the sample, stepped with each call, per conversation ---
GUESS_ENV = '''
import asyncio


class Guess:
    """The hidden number is the prompt's length; each step answers higher or lower, 1 for the right guess."""

    def reset(self, sample):
        self.secret, self.steps = len(sample["prompt"]), 0

    async def step(self, action):
        await asyncio.sleep(0)
        self.steps += 1
        n = int(action)
        if n == self.secret:
            return f"correct after {self.steps}", 1.0, True
        return ("higher" if n < self.secret else "lower"), -0.1, False


class NoStep:
    def reset(self, sample):
        pass


class Junk(Guess):
    def step(self, action):
        return "x", float("nan"), False
'''


@pytest.fixture(scope="module")
def env_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("env") / "guess.py"
    path.write_text(GUESS_ENV)
    return path


def test_an_environment_is_reset_per_conversation_and_stepped_with_each_call(env_file):
    env = box(env=f"{env_file}:Guess", timeout_s=5.0)
    try:
        sample = {"prompt": "x" * 7}
        steps = [env.run(f"{CALL_OPEN}{n}{CALL_CLOSE}", "a", sample=sample) for n in (3, 9, 7)]
        assert [(r.text, r.reward, r.done, r.ok) for r in steps] == [
            ("higher", -0.1, False, True), ("lower", -0.1, False, True), ("correct after 3", 1.0, True, True)]
        assert steps[0].turn.reward == -0.1 and steps[0].turn.name == "env"
        other = env.run(f"{CALL_OPEN}2{CALL_CLOSE}", "b", sample={"prompt": "xx"})  # its own instance
        assert (other.text, other.done) == ("correct after 1", True)
        bad = env.run(f"{CALL_OPEN}seven{CALL_CLOSE}", "c", sample=sample)
        assert not bad.ok and bad.reward == 0.0 and "ValueError" in bad.error
    finally:
        env.close()
    junk = box(env=f"{env_file}:Junk")
    try:
        result = junk.run(f"{CALL_OPEN}1{CALL_CLOSE}", "j", sample=sample)
        assert not result.ok and result.error.startswith("step returned ('x', nan, False), not (observation")
    finally:
        junk.close()


def test_an_environment_without_step_or_beside_tools_without_respond_is_refused_at_load(env_file):
    with pytest.raises(ConfigError, match=r"tools.env: .*has no method step or respond"):
        load_config(None, [f"tools.env={env_file}:NoStep"])
    with pytest.raises(ConfigError, match=r"tools.env: .*has no respond\(messages\): with tools.fns"):
        load_config(None, [f"tools.env={env_file}:Guess", "tools.fns=[calculator]"])


def test_a_trajectory_s_return_is_its_reward_plus_its_turns_rewards_summed():
    turns = [ToolTurn("env", True, reward=-0.1), ToolTurn("env", True, reward=1.0)]
    assert trajectory_return(0.5, turns) == pytest.approx(1.4) and trajectory_return(0.5, []) == 0.5


def test_guess_number_needs_rounds_of_feedback_and_its_demonstration_searches_with_the_environment():
    """The hidden number is in no prompt; the environment's feedback leads the demonstration's binary search to it in
    at most four guesses, most games taking two or more; eval games are not training games."""
    train, evals = load_datasets(DataConfig(task="guess_number", train_size=200, eval_size=100))
    assert not {p.text for p in train} & {p.text for p in evals}
    env = box(env="rlsys.data.tool_tasks:GuessNumber")
    turns = []
    try:
        for i, prompt in enumerate(evals[:20]):
            assert prompt.answer not in prompt.text.partition("game")[2].split()
            parts = demonstrate_search(prompt)
            calls = [text for text, mine in parts[:-1] if mine]
            said = [env.run(c, f"g{i}", sample=env_sample(prompt)).text for c in calls]
            assert [render_response(s) for s in said] == [text for text, mine in parts if not mine]
            assert said[-1] == "correct" and parts[-1] == (prompt.answer, True) and len(calls) <= 4
            assert final_answer("".join(text for text, mine in parts if mine), prompt.answer) == 1.0
            turns.append(len(calls))
            env.release(f"g{i}")
    finally:
        env.close()
    assert sum(t >= 2 for t in turns) >= 15
    check_report(load_config("configs/tool_guess.yaml", []))  # the shipped config passes its checks (else raises)
