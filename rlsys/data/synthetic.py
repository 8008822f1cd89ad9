"""Built-in verifiable tasks whose answer lengths are heavy-tailed and fixed by the prompt.

Each family is a function `rng -> (prompt text, answer)` registered by name. Most answers are a few
characters, but `rep` (repeat a unit k times, k heavy-tailed) reaches toward the 96-token response
limit, so a rollout batch has real stragglers and the samples of one prompt share their length, as in
RL on math or code. Answers are checked by exact match.
"""
from __future__ import annotations

import functools
import random
import statistics
import string
from typing import Callable

from rlsys.data.files import DataError
from rlsys.registry import Registry
from rlsys.types import Prompt

TaskFn = Callable[[random.Random], tuple[str, str]]
TASKS: Registry[TaskFn] = Registry("task family")

MAX_ANSWER_CHARS = 90  # under the default 96-token response limit, eos included
# The default mix ("synthetic"): family -> share of prompts. After the default warm start the tiny model
# gets many short `rep`s right, some `rev`/`srt`, and almost no `add` (hard prompts, as in real data).
MIX = {"rep": 0.45, "rev": 0.2, "srt": 0.2, "add": 0.15}


def random_word(rng: random.Random, lo: int, hi: int) -> str:
    return "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(lo, hi)))


def repetitions(rng: random.Random, draw_k: Callable[[], int], max_chars: int) -> tuple[str, str]:
    """`rep k unit=` -> the unit k times, k from `draw_k`, drawn again while the answer passes `max_chars` (no
    spike at the limit, as clipping would make)."""
    unit = random_word(rng, 1, 3)
    k = draw_k()
    while len(unit) * k > max_chars:
        k = draw_k()
    return f"rep {k} {unit}=", unit * k


@TASKS.register("rep")
def repeat_unit(rng: random.Random) -> tuple[str, str]:
    """`rep 7 ab=` -> `ababababababab`; k is Pareto-distributed, so long answers are rare but real."""
    return repetitions(rng, lambda: 1 + int(rng.paretovariate(1.0)), MAX_ANSWER_CHARS)


@TASKS.register("rev")
def reverse_word(rng: random.Random) -> tuple[str, str]:
    """`rev abc=` -> `cba`."""
    word = random_word(rng, 2, 7)
    return f"rev {word}=", word[::-1]


@TASKS.register("add")
def add_numbers(rng: random.Random) -> tuple[str, str]:
    """`add 385+7=` -> `392`: a number and a digit, so the carry is the hard part."""
    a, b = rng.randint(0, 999), rng.randint(0, 9)
    return f"add {a}+{b}=", str(a + b)


@TASKS.register("srt")
def sort_letters(rng: random.Random) -> tuple[str, str]:
    """`srt dbca=` -> `abcd`."""
    word = random_word(rng, 2, 7)
    return f"srt {word}=", "".join(sorted(word))


def _draw(task: str, rng: random.Random) -> tuple[str, str, str]:
    """One (family, text, answer); "synthetic" picks the family by the default mix."""
    family = rng.choices(list(MIX), weights=list(MIX.values()))[0] if task == "synthetic" else task
    text, answer = TASKS.get(family)(rng)
    return family, text, answer


def make_split(task: str, split: str, size: int, seed: int, exclude: set[str] | frozenset = frozenset()
               ) -> list[Prompt]:
    """`size` distinct prompts of `task` (a family name or "synthetic"), none of whose text is in `exclude`."""
    if task != "synthetic" and task not in TASKS:
        TASKS.get(task)  # raises, listing the known families
    rng = random.Random(f"rlsys:{task}:{split}:{seed}")  # str seeds hash stably across processes
    prompts: list[Prompt] = []
    seen = set(exclude)
    draws = 100 * size + 1000
    for _ in range(draws):
        if len(prompts) == size:
            return prompts
        family, text, answer = _draw(task, rng)
        if text not in seen:
            seen.add(text)
            prompts.append(Prompt(uid=f"{split}-{len(prompts)}", text=text, answer=answer,
                                  data_source=family, index=len(prompts)))
    if len(prompts) == size:
        return prompts
    held_out = " not in the train split (eval is held out of it)" if exclude else ""
    raise DataError(f"data.{split}_size: data.task={task!r} gave {len(prompts)} distinct prompts{held_out} in {draws} "
                    f"draws, fewer than data.{split}_size={size}; lower data.{split}_size, or give the task more "
                    "distinct prompts")


def synthetic_splits(task: str, train_size: int, eval_size: int, seed: int) -> tuple[list[Prompt], list[Prompt]]:
    """(train, eval); eval is held out: no eval prompt text appears in train. A DataError naming data.train_size
    (or eval_size) if the task has too few distinct prompts: `rlsys check` and `train` make the splits first
    (rlsys/startup.py start_problems), so the run's own make them again from this cache."""
    train, evals = _splits(task, train_size, eval_size, seed)
    return list(train), list(evals)


@functools.lru_cache(maxsize=2)
def _splits(task: str, train_size: int, eval_size: int, seed: int) -> tuple[tuple[Prompt, ...], tuple[Prompt, ...]]:
    train = make_split(task, "train", train_size, seed)
    return tuple(train), tuple(make_split(task, "eval", eval_size, seed, exclude={p.text for p in train}))


def length_stats(prompts: list[Prompt], tokenizer=None) -> dict[str, float]:
    """Answer length in tokens (eos not counted): median, p99 and their ratio (the tail's weight)."""
    if not prompts:
        raise ValueError("length_stats: no prompts")
    if tokenizer is None:
        lengths = sorted(len(p.answer.encode()) for p in prompts)  # the byte tokenizer: a token per byte
    else:
        lengths = sorted(len(ids) for ids in tokenizer([p.answer for p in prompts])["input_ids"])
    median = statistics.median(lengths)
    p99 = lengths[min(len(lengths) - 1, int(0.99 * len(lengths)))]
    return {"median": median, "p99": p99, "ratio": p99 / max(median, 1), "max": lengths[-1],
            "mean": statistics.fmean(lengths)}
