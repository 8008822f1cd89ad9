"""The task families with tools: `tool_arith` (a calculator) and `guess_number` (an environment, several turns).

The `tool_arith` task family: arithmetic too long for the tiny model to do in its head, with a calculator.

`calculator may help: 47*582=` -> `27354`: a product of a 2-digit and a 3-digit number, or a sum of three
3-digit numbers (the default model's `add`, a 3-digit number and a digit, is already beyond it). Short
numbers, because the model must copy them into its call and copy the tool's answer back. Trained with `tools.fns: [calculator]` (configs/tool_arith.yaml), the
model may call the calculator before it answers; its reward, `final_answer`, is the exact match of what it
writes after the last tool answer. The warm start's demonstrations (`demonstrate`) show the call, so the
policy starts out calling sometimes and guessing otherwise, and RL learns to call.

The `guess_number` family: `guess 1-15, game 4821: ` -> the game's hidden number, which only the environment
(`GuessNumber`, tools.env) knows: the model calls `<tool_call>8</tool_call>` and is told `higher`, `lower` or
`correct`, and then writes the number (reward `final_answer`, what follows its last call). No prompt says the
number, and the games of the eval split are not the training ones, so success needs rounds of feedback: a
binary search finds any number in at most four. The warm start's demonstrations (`demonstrate_search`) are
that search.

Its turns-to-learn variant (configs/tool_guess_turns.yaml): the environment `GuessNumberTurns` scores each turn
by the share of the numbers still possible that its answer rules out, and the warm start (`demonstrate_short_search`)
shows searches of one to three random guesses among those numbers, then a guess when none was confirmed, so the
policy starts below what one round of feedback allows and RL must learn longer searches of better guesses.
"""
from __future__ import annotations

import json
import random
import zlib

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


GUESS_RANGE = (1, 15)


def secret(game: int) -> int:
    """A game's hidden number: a hash, which the model cannot compute from the game's id."""
    low, high = GUESS_RANGE
    return low + zlib.crc32(f"guess-{game}".encode()) % (high - low + 1)


@TASKS.register("guess_number")
def guess_number(rng: random.Random) -> tuple[str, str]:
    game = rng.randint(1000, 9999)
    return f"guess {GUESS_RANGE[0]}-{GUESS_RANGE[1]}, game {game}: ", str(secret(game))


def feedback(guess: int, hidden: int) -> str:
    return "correct" if guess == hidden else "higher" if guess < hidden else "lower"


class GuessNumber:
    """The environment of `guess_number` (tools.env: rlsys.data.tool_tasks:GuessNumber): each step is a guess,
    answered `higher`, `lower` or `correct` against the sample's answer (rlsys.types.env_sample); the reward is
    the final answer's (reward.fn), so steps give none."""

    def reset(self, sample: dict) -> None:
        answer = str(sample.get("answer", ""))
        self.hidden = int(answer) if answer.isdigit() else None

    def step(self, action: str) -> tuple[str, float, bool]:
        if self.hidden is None:
            return "error: the sample has no number to guess", 0.0, True
        if not action.strip().isdigit():
            return "error: guess a whole number", 0.0, False
        return feedback(int(action), self.hidden), 0.0, False


def demonstrate_search(prompt: Prompt) -> list[tuple[str, bool]]:
    """A binary search of the game's number: each guess the model's, each answer the environment's, then the
    number found."""
    hidden, (low, high) = int(prompt.answer), GUESS_RANGE
    parts = []
    while True:
        guess = (low + high) // 2
        said = feedback(guess, hidden)
        parts += [(f"{CALL_OPEN}{guess}{CALL_CLOSE}", True), (render_response(said), False)]
        if said == "correct":
            return parts + [(prompt.answer, True)]
        low, high = (guess + 1, high) if said == "higher" else (low, guess - 1)


class GuessNumberTurns(GuessNumber):
    """GuessNumber whose steps are rewarded: TURN_REWARD x the share of the numbers still possible (given every
    answer so far) that the guess's answer rules out, so a halving guess earns about TURN_REWARD / 2 and a guess
    outside them nothing. The numbers still possible are the conversation's state, rebuilt by replay (user_env)."""
    TURN_REWARD = 0.2

    def reset(self, sample: dict) -> None:
        super().reset(sample)
        self.low, self.high = GUESS_RANGE

    def step(self, action: str) -> tuple[str, float, bool]:
        said, _, done = super().step(action)
        if said not in ("correct", "higher", "lower"):
            return said, 0.0, done
        guess, before = int(action), self.high - self.low + 1
        if said == "correct":
            self.low = self.high = guess
        elif said == "higher":
            self.low = max(self.low, guess + 1)
        else:
            self.high = min(self.high, guess - 1)
        return said, self.TURN_REWARD * (before - (self.high - self.low + 1)) / before, done


SHORT_SEARCH_ROUNDS = {1: 0.7, 2: 0.25, 3: 0.05}  # rounds of a short search's demonstration, and their shares


def demonstrate_short_search(prompt: Prompt) -> list[tuple[str, bool]]:
    """A short random search (model.warm_start.demonstrations for configs/tool_guess_turns.yaml): one to three
    rounds (SHORT_SEARCH_ROUNDS), each guess drawn among the numbers still possible, then the number if one was
    confirmed, else a guess over the whole range. Drawn from the prompt, so a game's demonstration is fixed."""
    rng = random.Random(prompt.text)
    hidden, (low, high) = int(prompt.answer), GUESS_RANGE
    rounds = rng.choices(list(SHORT_SEARCH_ROUNDS), list(SHORT_SEARCH_ROUNDS.values()))[0]
    parts = []
    for _ in range(rounds):
        guess = rng.randint(low, high)
        said = feedback(guess, hidden)
        parts += [(f"{CALL_OPEN}{guess}{CALL_CLOSE}", True), (render_response(said), False)]
        if said == "correct":
            return parts + [(prompt.answer, True)]
        low, high = (guess + 1, high) if said == "higher" else (low, guess - 1)
    return parts + [(str(rng.randint(*GUESS_RANGE)), True)]


# task family -> its tool-use demonstrations for the warm start
DEMONSTRATIONS = {"tool_arith": demonstrate, "guess_number": demonstrate_search}
