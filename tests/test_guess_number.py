"""guess_number needs at least two rounds of feedback: the best policy allowed k rounds, found exactly by
search over the real environment's answers, on the shipped config's eval games."""
from __future__ import annotations

import random
from collections import Counter
from functools import lru_cache

import pytest

from rlsys.data import load_datasets
from rlsys.data.tool_tasks import (GUESS_RANGE, SEARCH_REWARD, TRUNCATED_SEARCH_ROUNDS, GuessNumber,
                                   GuessNumberTurns, demonstrate_truncated_search, feedback, halving_search,
                                   narrowed, potential)
from rlsys.startup import load_config
from rlsys.tools.format import CALL_CLOSE, CALL_OPEN, RESPONSE_CLOSE, RESPONSE_OPEN

NUMBERS = range(GUESS_RANGE[0], GUESS_RANGE[1] + 1)


def said(guess: int, hidden: int) -> str:
    env = GuessNumber()
    env.reset({"answer": str(hidden)})
    observation, _, _ = env.step(str(guess))
    return observation


def best_share(weights: Counter, rounds: int) -> float:
    """The largest share of games any policy wins with at most `rounds` guesses answered, then one written number.
    A policy knows only the answers it was given, so the games it cannot tell apart form one candidate set; a
    random policy is a mixture of these deterministic ones and wins no more than the best of them."""
    total = sum(weights.values())

    @lru_cache(maxsize=None)
    def wins(candidates: frozenset, left: int) -> int:
        answer_now = max(weights[h] for h in candidates)
        if left == 0:
            return answer_now
        best = answer_now
        for guess in NUMBERS:
            groups: dict[str, set] = {}
            for hidden in candidates:
                groups.setdefault(said(guess, hidden), set()).add(hidden)
            best = max(best, sum(sum(weights[h] for h in group) if observation == "correct"  # it writes the guess
                                 else wins(frozenset(group), left - 1) for observation, group in groups.items()))
        return best

    return wins(frozenset(weights), rounds) / total


def test_one_round_of_feedback_wins_at_most_three_numbers_of_fifteen_and_four_rounds_win_all():
    uniform = Counter({h: 1 for h in NUMBERS})
    assert [round(best_share(uniform, k) * 15) for k in range(5)] == [1, 3, 7, 15, 15]


def test_on_the_shipped_eval_games_an_accuracy_over_0_504_takes_three_rounds_of_feedback():
    """The ceilings an eval accuracy of configs/tool_guess.yaml is read against: answering at once wins at most
    0.075 of its 1,000 eval games, one round of feedback 0.222, two 0.504; one call per turn, so a round is a
    turn."""
    cfg = load_config("configs/tool_guess.yaml", [])
    assert cfg.tools.max_calls_per_turn == 1  # fifteen calls in one turn would find any number in one round
    _, evals = load_datasets(cfg.data)
    weights = Counter(int(p.answer) for p in evals)
    assert len(evals) == 1000 and set(weights) == set(NUMBERS)
    ceilings = [round(best_share(weights, k) * 1000) for k in range(5)]
    assert ceilings == [75, 222, 504, 1000, 1000]  # games won of 1,000 with 0-4 rounds


def test_the_turns_variants_eval_games_have_the_same_ceilings():
    """configs/tool_guess_turns.yaml's 1,000 eval games are tool_guess's: one round of feedback wins at most
    0.222 of them, two 0.504, three all."""
    cfg = load_config("configs/tool_guess_turns.yaml", [])
    assert cfg.tools.max_calls_per_turn == 1
    _, evals = load_datasets(cfg.data)
    weights = Counter(int(p.answer) for p in evals)
    assert [round(best_share(weights, k) * 1000) for k in range(4)] == [75, 222, 504, 1000]


def test_a_truncated_search_halves_then_answers_among_the_numbers_left():
    """demonstrate_truncated_search (the turns variant's warm start): the binary search's first rounds, each
    guess the middle of the numbers still possible, then a number among those left, so k rounds win
    (2^(k+1) - 1) / 15 of uniform games, the ceiling k rounds allow, and the demonstrations less than one round's."""
    cfg = load_config("configs/tool_guess_turns.yaml", [])
    train, _ = load_datasets(cfg.data)
    rounds = Counter()
    for prompt in train:
        parts = demonstrate_truncated_search(prompt)
        low, high = GUESS_RANGE
        for (call, mine), (answer, theirs) in zip(parts[:-1:2], parts[1::2]):
            guess = int(call.removeprefix(CALL_OPEN).removesuffix(CALL_CLOSE))
            assert mine and not theirs and guess == (low + high) // 2
            said = answer.removeprefix(RESPONSE_OPEN).removesuffix(RESPONSE_CLOSE)
            assert said == feedback(guess, int(prompt.answer))
            low, high = narrowed(low, high, guess, said)
        final, mine = parts[-1]
        assert mine and low <= int(final) <= high and low <= int(prompt.answer) <= high
        rounds[len(parts) // 2] += 1
    assert set(rounds) == set(TRUNCATED_SEARCH_ROUNDS) and max(rounds, key=rounds.get) == 1  # mostly one
    left = lambda hidden, k: ([GUESS_RANGE] + [r for *_, r in halving_search(hidden)])[:k + 1][-1]  # noqa: E731
    wins = {k: sum(1 / (high - low + 1) for low, high in (left(h, k) for h in NUMBERS))
            for k in TRUNCATED_SEARCH_ROUNDS}  # of the 15 numbers, answering among those left after k rounds
    assert {k: round(w) for k, w in wins.items()} == {0: 1, 1: 3, 2: 7, 3: 15}
    assert sum(share * wins[k] / 15 for k, share in TRUNCATED_SEARCH_ROUNDS.items()) < 3 / 15  # one round's


def test_the_turns_variants_rewards_telescope_whatever_the_turns():
    """GuessNumberTurns: potential-based shaping, so a search's per-turn rewards sum to potential(end) -
    potential(start) however many turns it took, a guess that rules nothing out (repeated, or among numbers
    already excluded) earns 0, and any search that finds the number earns SEARCH_REWARD in all."""
    rng = random.Random(0)
    for _ in range(300):
        hidden = rng.choice(NUMBERS)
        env = GuessNumberTurns()
        env.reset({"answer": str(hidden)})
        low, high, total = *GUESS_RANGE, 0.0
        for _ in range(rng.randint(1, 8)):
            guess = rng.choice(NUMBERS)
            said, reward, done = env.step(str(guess))
            assert not done and said == feedback(guess, hidden)
            again, repeated, _ = env.step(str(guess))
            assert again == said and repeated == 0.0
            low, high = narrowed(low, high, guess, said)
            total += reward
        assert total == pytest.approx(potential(low, high) - potential(*GUESS_RANGE))
    env = GuessNumberTurns()
    env.reset({"answer": "11"})
    rewards = [env.step(g)[1] for g in ("8", "3", "12", "10", "11")]
    assert rewards[1] == 0.0 and sum(rewards) == pytest.approx(SEARCH_REWARD)  # 3 was ruled out by "higher"
