"""The papers' claims table (docs/schedulers.md): a verdict comes from a paired interval, never from one pair."""
import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
SPEC = importlib.util.spec_from_file_location("doc_tables.emulated", ROOT / "benchmarks" / "doc_tables" / "emulated.py")
emulated = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(emulated)


def ratio(value, interval, pairs):
    return {"pairs": pairs, "x": value, "x_ci95": interval, "x_pairs": pairs}


def test_a_ratio_holds_only_where_its_interval_clears_the_bar():
    assert emulated.against(ratio(1.5, None, 1), "x", 1.0)[1] == "undecided (1 pair)"
    assert emulated.against(ratio(1.5, [1.1, 2.0], 3), "x", 1.0)[1] == "holds"
    assert emulated.against(ratio(1.5, [0.9, 2.0], 3), "x", 1.0)[1] == "undecided"
    assert emulated.against(ratio(0.8, [0.7, 0.9], 3), "x", 1.0)[1] == "fails"
    assert emulated.against(ratio(1.5, [1.1, 2.0], 3), "x", 1.69)[1] == "undecided"
    assert emulated.against({"pairs": 3, "x": None, "x_pairs": 2}, "x", 1.0) == ("reached in 2 of 3 pairs",
                                                                                 "undecided")


def test_no_loss_holds_within_one_paired_error_and_better_needs_the_interval_above_zero():
    half = emulated.t975(3) * 0.01  # four pairs, a paired error of 0.01
    within = {"final_accuracy_paired": {"diff": -0.009, "ci95": [-0.009 - half, -0.009 + half], "pairs": 4},
              "final_accuracy_vs_sync": {"diff": -0.009, "se": 0.02}}
    below = {**within, "final_accuracy_paired": {"diff": -0.011, "ci95": [-0.011 - half, -0.011 + half],
                                                 "pairs": 4}}
    assert emulated.final_against(within, better=False)[1] == "holds"
    assert emulated.final_against(below, better=False)[1] == "fails"
    assert emulated.final_against(within, better=True)[1] == "undecided"
    one = {"final_accuracy_paired": {"diff": 0.03, "ci95": None, "pairs": 1},
           "final_accuracy_vs_sync": {"diff": 0.03, "se": 0.02}}
    assert emulated.final_against(one, better=True)[1] == "undecided (1 pair)"
