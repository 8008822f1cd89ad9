"""The `code` task family: write a small Python function; the answer holds the tests that score it.

The answer is JSON, {"fn": name, "cases": [[args, expected], ...]}, which the `code_tests` reward runs
in the sandbox (rlsys/reward/code.py). Not in the default mix: select it with data.task=code and
reward.fn=code_tests.
"""
from __future__ import annotations

import json
import random
import string
from dataclasses import dataclass

from rlsys.data.synthetic import TASKS


@dataclass
class Problem:
    fn: str
    text: str  # the prompt
    solution: str  # a reference solution, which computes the expected values
    args: list[list]  # one argument list per test case

    def answer(self) -> str:
        namespace: dict = {}
        exec(self.solution, namespace)  # our own reference code, never the model's
        return json.dumps({"fn": self.fn, "cases": [[a, namespace[self.fn](*a)] for a in self.args]})


# Four test cases of one argument each.
def _ints(rng: random.Random) -> list[list]:
    return [[rng.randint(-100, 100)] for _ in range(4)]


def _lists(rng: random.Random) -> list[list]:
    return [[[rng.randint(-20, 20) for _ in range(rng.randint(0, 9))]] for _ in range(4)]


def _words(rng: random.Random, letters: str = string.ascii_lowercase) -> list[list]:
    return [["".join(rng.choice(letters) for _ in range(rng.randint(0, 8)))] for _ in range(4)]


def _add(rng):
    k = rng.randint(1, 999)
    return "add", f"`add(x)` that returns x + {k}", f"def add(x):\n    return x + {k}\n", _ints(rng)


def _mul(rng):
    k = rng.randint(2, 999)
    return "mul", f"`mul(x)` that returns x times {k}", f"def mul(x):\n    return x * {k}\n", _ints(rng)


def _clip(rng):
    lo = rng.randint(-50, 40)
    hi = rng.randint(lo + 1, 50)
    return ("clip", f"`clip(x)` that returns x limited to the range [{lo}, {hi}]",
            f"def clip(x):\n    return min(max(x, {lo}), {hi})\n", _ints(rng))


def _repeat(rng):
    k = rng.randint(2, 9)
    return ("repeat", f"`repeat(s)` that returns the string s repeated {k} times",
            f"def repeat(s):\n    return s * {k}\n", _words(rng))


def _count(rng):
    c = rng.choice(string.ascii_lowercase)
    letters = c * 4 + "abcde"  # so the letter occurs often
    return ("count", f"`count(s)` that returns how many times the letter '{c}' occurs in the string s",
            f"def count(s):\n    return s.count('{c}')\n", _words(rng, letters))


def _rev(rng):
    c = rng.choice(string.ascii_lowercase)
    return ("rev", f"`rev(s)` that returns the string s reversed, followed by '{c}'",
            f"def rev(s):\n    return s[::-1] + '{c}'\n", _words(rng))


def _every(rng):
    k = rng.randint(2, 5)
    return ("every", f"`every(xs)` that returns every {k}-th element of the list xs, starting with the first",
            f"def every(xs):\n    return xs[::{k}]\n", _lists(rng))


def _total(rng):
    k = rng.randint(2, 99)
    return ("total", f"`total(xs)` that returns the sum of the list xs modulo {k}",
            f"def total(xs):\n    return sum(xs) % {k}\n", _lists(rng))


MAKERS = [_add, _mul, _clip, _repeat, _count, _rev, _every, _total]


def draw_problem(rng: random.Random) -> Problem:
    fn, what, solution, args = rng.choice(MAKERS)(rng)
    return Problem(fn, f"Write a Python function {what}. Reply with the code only.", solution, args)


@TASKS.register("code")
def code_task(rng: random.Random) -> tuple[str, str]:
    problem = draw_problem(rng)
    return problem.text, problem.answer()
