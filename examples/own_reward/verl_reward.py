"""A reward function written for veRL, used as it is: name it with
`reward.fn=examples/own_reward/verl_reward.py:compute_score`.

rlsys tells this form from `score(response, answer)` by its parameter names (a `solution_str` parameter) and
calls it by name, as veRL does, with the row's `data_source` and `extra_info` columns passed through from the
parquet or jsonl file (extra_info is None for a row without one). It may return a float or, as here, a dict
whose "score" is the reward (rlsys uses only that key).
"""
import re

BOXED = re.compile(r"\\boxed\{([^{}]*)\}")


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """1.0 if the last \\boxed{} holds exactly the ground truth, for the rows make_data.py writes."""
    if data_source != "own_apples":  # a mix of datasets is told apart by data_source, as veRL's default does
        raise ValueError(f"no reward for data_source {data_source!r}")
    boxed = BOXED.findall(solution_str)
    return {"score": float(bool(boxed) and boxed[-1].strip() == ground_truth),
            "row": (extra_info or {}).get("index")}
