"""guess_number needs at least two rounds of feedback: the best policy allowed k rounds, found exactly by
search over the real environment's answers, on the shipped config's eval games."""
from __future__ import annotations

from collections import Counter
from functools import lru_cache

from rlsys.data import load_datasets
from rlsys.data.tool_tasks import GUESS_RANGE, GuessNumber
from rlsys.startup import load_config

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


def test_the_turns_variant_pays_each_guess_for_what_it_rules_out_and_its_warm_start_wins_less_than_one_round():
    """configs/tool_guess_turns.yaml: a halving guess earns most, a guess among the numbers already ruled out
    nothing (the state survives a replay: user_env); its demonstrations (short random searches) win fewer of the
    benchmark's 500 eval games than the best one-round policy, so RL must improve the turns to pass it."""
    from rlsys.data.tool_tasks import GuessNumberTurns, demonstrate_short_search

    env = GuessNumberTurns()
    env.reset({"answer": "11"})
    rewards = [env.step(g)[1] for g in ("8", "3", "12", "10", "11")]
    assert rewards == [0.2 * 8 / 15, 0.0, 0.2 * 4 / 7, 0.2 * 2 / 3, 0.0]  # 11 was the one number left
    cfg = load_config("configs/tool_guess_turns.yaml", ["data.eval_size=500"])
    train, evals = load_datasets(cfg.data)
    weights = Counter(int(p.answer) for p in evals)
    demonstrated = sum(demonstrate_short_search(p)[-1][0] == p.answer for p in train) / len(train)
    assert demonstrated < 0.19 < best_share(weights, 1) == 0.244
