"""An example reward function of the user's own, outside rlsys: the configs here name it as
`reward.fn: examples/own_reward/my_reward.py:score` (a file path, relative to where rlsys runs), or, once
this folder is an installed package or on PYTHONPATH, as `my_reward:score`.

rlsys calls it as score(response, answer) -> float in its reward actors, one completion at a time: the
model's decoded response and the row's ground truth, both strings. A value outside reward.valid_range
([-1, 1] by default), an exception or a hang past reward.timeout_s gets reward.fallback instead and is
counted in reward/errors. It reaches the actors pickled by value, so the modules it imports must be
importable there (the standard library here).
"""
import re

BOXED = re.compile(r"\\boxed\{([^{}]*)\}")
NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def score(response: str, answer: str) -> float:
    """1.0 if the last number of the response (of its last \\boxed{} if it has one) equals the answer."""
    boxed = BOXED.findall(response)
    numbers = NUMBER.findall(boxed[-1] if boxed else response)
    try:
        return float(bool(numbers) and float(numbers[-1]) == float(answer))
    except ValueError:  # a ground truth that is not a number: this function does not apply
        return 0.0
