"""`code_tests`: 1.0 if the response's Python passes every test case of the answer, run in the sandbox.

The answer is the JSON the `code` task family writes: {"fn": name, "cases": [[args, expected], ...]}.
Each reward worker builds one Sandbox at start (`setup`), so a machine that cannot isolate code stops
the run before training, and the adaptive timeout learns from that worker's runs.
"""
from __future__ import annotations

import json
import re

from rlsys.config import RewardConfig
from rlsys.reward.registry import register_reward
from rlsys.reward.sandbox import Sandbox

START_S = 1.0  # start-up of the sandbox's two interpreters, beyond the code's own timeout
FENCED = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)```", re.DOTALL)

_sandbox: Sandbox | None = None


def setup(cfg: RewardConfig) -> None:
    """Check that the pool waits longer than the sandbox, and build the sandbox (it may refuse)."""
    global _sandbox
    if cfg.timeout_s <= cfg.sandbox.t_max_s + START_S:
        raise ValueError(f"reward.timeout_s={cfg.timeout_s} must exceed reward.sandbox.t_max_s="
                         f"{cfg.sandbox.t_max_s} by more than {START_S}s, or the pool stops waiting first")
    _sandbox = Sandbox(cfg.sandbox)


def parse_tests(answer: str) -> tuple[str, list[tuple[list, object]]]:
    """(function name, [(args, expected), ...]) from a `code` answer, or ValueError saying what is wrong."""
    try:
        tests = json.loads(answer)
        fn, cases = tests["fn"], [(list(args), want) for args, want in tests["cases"]]
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"code_tests: the answer is not {{'fn': name, 'cases': [[args, expected], ...]}} "
                         f"({type(e).__name__}: {e}): {answer[:80]!r}") from None
    if not isinstance(fn, str) or not fn.isidentifier() or not cases:
        raise ValueError(f"code_tests: the answer needs a function name and at least one case: {answer[:80]!r}")
    return fn, cases


def extract_code(response: str) -> str:
    """The last fenced code block of the response, or the whole response when it has none."""
    blocks = FENCED.findall(response)
    return blocks[-1] if blocks else response


@register_reward("code_tests")
def code_tests(response: str, answer: str) -> float:
    if _sandbox is None:  # called outside a reward worker (a script, a test): default limits
        setup(RewardConfig())
    fn, cases = parse_tests(answer)
    return float(_sandbox.run(extract_code(response), fn, cases).passed)


code_tests.setup = setup
