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

Its turns-to-learn variant (configs/tool_guess_turns.yaml): the warm start (`demonstrate_truncated_search`)
shows that binary search cut after none to three rounds (mostly one or none), then a guess among the numbers
still possible, so the policy knows how to halve and how to use what it was told but stops early, below one
round's ceiling; RL must learn to search longer. Its environment `GuessNumberTurns` rewards each turn by potential-based shaping of the numbers
still possible (Ng, Harada & Russell 1999), which adding turns cannot game.
"""
from __future__ import annotations

import json
import math
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


def narrowed(low: int, high: int, guess: int, said: str) -> tuple[int, int]:
    """The numbers still possible, low..high, once `guess` was answered `said`."""
    if said == "correct":
        return guess, guess
    return (max(low, guess + 1), high) if said == "higher" else (low, min(high, guess - 1))


def halving_search(hidden: int):
    """The binary search of `hidden`, round by round: (guess, the environment's answer, the numbers still
    possible after it as (low, high)); four rounds at most, the last one `correct`."""
    low, high = GUESS_RANGE
    while low <= high:
        guess = (low + high) // 2
        said = feedback(guess, hidden)
        low, high = narrowed(low, high, guess, said)
        yield guess, said, (low, high)
        if said == "correct":
            return


def guess_parts(guess: int, said: str) -> list[tuple[str, bool]]:
    """A round of the conversation: the model's call, then the environment's answer (no loss on it)."""
    return [(f"{CALL_OPEN}{guess}{CALL_CLOSE}", True), (render_response(said), False)]


def demonstrate_search(prompt: Prompt) -> list[tuple[str, bool]]:
    """A binary search of the game's number: each guess the model's, each answer the environment's, then the
    number found."""
    return [part for guess, said, _ in halving_search(int(prompt.answer)) for part in guess_parts(guess, said)] \
        + [(prompt.answer, True)]


SEARCH_REWARD = 0.2  # a search's per-turn rewards in all, once it knows the number: a fifth of a win's


def potential(low: int, high: int) -> float:
    """Phi of the shaping (GuessNumberTurns): -log of the numbers still possible, scaled so that a search from
    the whole range to one number earns SEARCH_REWARD in all."""
    return -SEARCH_REWARD * math.log(high - low + 1) / math.log(GUESS_RANGE[1] - GUESS_RANGE[0] + 1)


class GuessNumberTurns(GuessNumber):
    """GuessNumber whose steps are rewarded by potential-based shaping (Ng, Harada & Russell 1999):
    potential(after) - potential(before), over the numbers still possible given every answer so far. The rewards
    of an episode's steps telescope to potential(end) - potential(start), however many turns it took: a turn
    that rules nothing out (a repeated guess, one among numbers already excluded) earns 0, every path to one
    number earns SEARCH_REWARD, and the policy that always wins still earns most. The numbers still possible are
    the conversation's state, rebuilt by replay (user_env)."""

    def reset(self, sample: dict) -> None:
        super().reset(sample)
        self.low, self.high = GUESS_RANGE

    def step(self, action: str) -> tuple[str, float, bool]:
        said, _, done = super().step(action)
        if said not in ("correct", "higher", "lower"):
            return said, 0.0, done
        before = potential(self.low, self.high)
        self.low, self.high = narrowed(self.low, self.high, int(action), said)
        return said, potential(self.low, self.high) - before, done


# Rounds a demonstration searches, and their shares: k rounds win (2^(k+1) - 1) / 15 of the games, so these
# demonstrations win 0.19, below what one round allows (0.2), and 10% of them show the rounds after the first
TRUNCATED_SEARCH_ROUNDS = {0: 0.35, 1: 0.55, 2: 0.08, 3: 0.02}


def demonstrate_truncated_search(prompt: Prompt) -> list[tuple[str, bool]]:
    """The binary search cut short (model.warm_start.demonstrations for configs/tool_guess_turns.yaml): its first
    rounds, none to three (TRUNCATED_SEARCH_ROUNDS), then a number drawn among those still possible (the one
    found, if a guess was right). Drawn from the prompt, so a game's demonstration is fixed."""
    rng = random.Random(prompt.text)
    rounds = rng.choices(list(TRUNCATED_SEARCH_ROUNDS), list(TRUNCATED_SEARCH_ROUNDS.values()))[0]
    parts, (low, high) = [], GUESS_RANGE
    for _, (guess, said, (low, high)) in zip(range(rounds), halving_search(int(prompt.answer))):
        parts += guess_parts(guess, said)
    return parts + [(str(rng.randint(low, high)), True)]


# task family -> its tool-use demonstrations for the warm start
DEMONSTRATIONS = {"tool_arith": demonstrate, "guess_number": demonstrate_search}
