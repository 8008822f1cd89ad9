"""Tools (rlsys/tools/): the call format, the calculator, the tools section of the config, and ToolBox.run,
which never raises: every fault of a tool (hang, crash, flood, junk, escape) comes back as a ToolResult."""
import json
import pickle
import time

import pytest

from rlsys.config import ConfigError, ToolsConfig
from rlsys.startup import load_config
from rlsys.tools import (CALL_CLOSE, CALL_OPEN, RESPONSE_CLOSE, RESPONSE_OPEN, ToolBox, ToolCall, ToolCallError,
                         ToolFormat, parse_call, render_response)
from rlsys.tools.calculator import CalculatorError, calculator


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
