"""The `tool_arith` task family: arithmetic too long for the tiny model to do in its head, with a calculator.

`calculator may help: 47*582=` -> `27354`: a product of a 2-digit and a 3-digit number, or a sum of three
3-digit numbers (the default model's `add`, a 3-digit number and a digit, is already beyond it). Short
numbers, because the model must copy them into its call and copy the tool's answer back. Trained with `tools.fns: [calculator]` (configs/tool_arith.yaml), the
model may call the calculator before it answers; its reward, `final_answer`, is the exact match of what it
writes after the last tool answer. The warm start's demonstrations (`demonstrate`) show the call, so the
policy starts out calling sometimes and guessing otherwise, and RL learns to call.
"""
from __future__ import annotations

import json
import random

from rlsys.data.synthetic import TASKS
from rlsys.tools.calculator import calculator
from rlsys.tools.format import CALL_CLOSE, CALL_OPEN, render_response
from rlsys.types import Prompt

HINT = "calculator may help: "


@TASKS.register("tool_arith")
def tool_arith(rng: random.Random) -> tuple[str, str]:
    if rng.random() < 0.5:
        expression = f"{rng.randint(10, 99)}*{rng.randint(100, 999)}"
    else:
        expression = "+".join(str(rng.randint(100, 999)) for _ in range(3))
    return f"{HINT}{expression}=", calculator(expression)


def demonstrate(prompt: Prompt) -> list[tuple[str, bool]]:
    """The conversation that answers `prompt` with the calculator, as (text, whether it is the model's) parts:
    the call, the tool's answer (not the model's: no loss on it), the final answer."""
    expression = prompt.text.removeprefix(HINT).removesuffix("=")
    call = CALL_OPEN + json.dumps({"name": "calculator", "arguments": {"expression": expression}}) + CALL_CLOSE
    return [(call, True), (render_response(calculator(expression)), False), (prompt.answer, True)]


DEMONSTRATIONS = {"tool_arith": demonstrate}  # task family -> its tool-use demonstrations for the warm start
