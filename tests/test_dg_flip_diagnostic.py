"""benchmarks/dg_flip_diagnostic.py's split of each loss's push, on a group computed by hand (the sampling
half is the built-in engine, tested on its own)."""
import importlib.util
import math
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "dg_flip_diagnostic.py"


def sigmoid(x: float) -> float:
    return 1 / (1 + math.exp(-x))


def test_the_dg_diagnostic_splits_each_losss_push_by_direction_and_true_answer():
    spec = importlib.util.spec_from_file_location("dg_flip", SCRIPT)
    diagnostic = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(diagnostic)
    # one group: a right answer at log-prob -0.1 per token, three wrong ones at -3 (improbable)
    group = [([-0.1, -0.1], 1.0), ([-3.0, -3.0], 0.0), ([-3.0, -3.0], 0.0), ([-3.0, -3.0], 0.0)]
    clean = diagnostic.pushes([group], flip=0.0, dg_eta=1.0, advantage="grpo", seed=0)
    for loss in ("ppo", "dg"):
        assert sum(clean[loss].values()) == pytest.approx(1.0)
        assert clean[loss]["up on wrong"] == 0 and clean[loss]["down on right"] == 0
    assert clean["ppo"]["up on right"] == pytest.approx(0.5)  # GRPO's advantages sum to zero over the group
    # A = 1.5 for the right answer, -0.5 for each wrong one; DG's gate sigmoid(A * surprisal) per token
    up, down = 1.5 * sigmoid(1.5 * 0.1), 3 * 0.5 * sigmoid(-0.5 * 3.0)
    assert clean["dg"]["down on wrong"] == pytest.approx(down / (up + down), rel=1e-4)  # damped improbable failures: ~0.25
    flipped = diagnostic.pushes([group], flip=1.0, dg_eta=1.0, advantage="grpo", seed=0)  # every reward flipped
    assert flipped["ppo"]["up on wrong"] == pytest.approx(0.5) and flipped["ppo"]["down on right"] == pytest.approx(0.5)
    up, down = 3 * 0.5 * sigmoid(0.5 * 3.0), 1.5 * sigmoid(-1.5 * 0.1)
    assert flipped["dg"]["up on wrong"] == pytest.approx(up / (up + down), rel=1e-4)  # the gate favours them: ~0.64
