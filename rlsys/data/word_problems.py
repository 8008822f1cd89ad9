"""The `word_problems` task family: short grade-school word problems with whole-number answers.

One or two arithmetic steps over small numbers (a third of them one step), phrased from templates with
random names, things and numbers (seeded, like every family). The prompt asks for the answer in \\boxed{},
which the `math_verify` reward reads. Meant for real pretrained models (configs/smollm2_math.yaml), usually
with data.chat_template on; not in the default mix.
"""
from __future__ import annotations

import random

from rlsys.data.synthetic import TASKS

NAMES = [("Tom", "he"), ("Anna", "she"), ("Lee", "he"), ("Maria", "she"), ("Sam", "he"), ("Nora", "she"),
         ("Omar", "he"), ("Ines", "she"), ("Ravi", "he"), ("Lucy", "she")]
THINGS = ["apples", "pencils", "stickers", "marbles", "cookies", "books", "stamps", "shells"]
INSTRUCTION = "Put the final answer in \\boxed{}."


def _more(rng: random.Random) -> tuple[str, int]:
    (name, he), thing = rng.choice(NAMES), rng.choice(THINGS)
    a, b = rng.randint(2, 20), rng.randint(2, 20)
    return f"{name} has {a} {thing}. {he.capitalize()} finds {b} more. How many {thing} does {he} have now?", a + b


def _fewer(rng: random.Random) -> tuple[str, int]:
    (name, he), thing = rng.choice(NAMES), rng.choice(THINGS)
    a = rng.randint(5, 30)
    b = rng.randint(1, a - 1)
    return f"{name} has {a} {thing}. {he.capitalize()} eats or loses {b} of them. How many {thing} are left?", a - b


def _bags(rng: random.Random) -> tuple[str, int]:
    thing = rng.choice(THINGS)
    a, b = rng.randint(2, 9), rng.randint(2, 9)
    return f"There are {a} bags with {b} {thing} in each bag. How many {thing} are there in all?", a * b


def _boxes(rng: random.Random) -> tuple[str, int]:
    (name, he), thing = rng.choice(NAMES), rng.choice(THINGS)
    a, b = rng.randint(2, 9), rng.randint(2, 12)
    c = rng.randint(1, a * b - 1)
    return (f"{name} has {a} boxes with {b} {thing} in each box. {he.capitalize()} gives away {c} {thing}. "
            f"How many {thing} does {name} have left?", a * b - c)


def _change(rng: random.Random) -> tuple[str, int]:
    (name, he), thing = rng.choice(NAMES), rng.choice(THINGS[:4])
    a, p = rng.randint(2, 6), rng.randint(2, 9)
    bill = rng.choice([b for b in (10, 20, 50, 100) if b >= a * p])
    return (f"{name} buys {a} {thing} that cost {p} dollars each and pays with a {bill} dollar bill. "
            f"How many dollars of change does {he} get?", bill - a * p)


def _share(rng: random.Random) -> tuple[str, int]:
    (name, he), thing = rng.choice(NAMES), rng.choice(THINGS)
    k, each = rng.randint(2, 6), rng.randint(2, 10)
    b = rng.randint(1, k * each - 1)
    return (f"{name} has {k * each - b} {thing} and gets {b} more. {he.capitalize()} shares all of them "
            f"equally among {k} friends. How many {thing} does each friend get?", each)


def _distance(rng: random.Random) -> tuple[str, int]:
    speed, hours = rng.randint(3, 12) * 5, rng.randint(2, 6)
    return f"A train travels {speed} km every hour. How many km does it travel in {hours} hours?", speed * hours


def _pages(rng: random.Random) -> tuple[str, int]:
    (name, he) = rng.choice(NAMES)
    per_day, days = rng.randint(5, 20), rng.randint(2, 7)
    total = per_day * days + rng.randint(1, 100)
    return (f"A book has {total} pages. {name} reads {per_day} pages every day. How many pages are left "
            f"after {days} days?", total - per_day * days)


def _wages(rng: random.Random) -> tuple[str, int]:
    (name, he) = rng.choice(NAMES)
    wage, h1, h2 = rng.randint(5, 15), rng.randint(1, 8), rng.randint(1, 8)
    return (f"{name} earns {wage} dollars per hour. {he.capitalize()} works {h1} hours on Monday and {h2} "
            f"hours on Tuesday. How many dollars does {he} earn in total?", wage * (h1 + h2))


def _chairs(rng: random.Random) -> tuple[str, int]:
    rows, per_row = rng.randint(3, 12), rng.randint(4, 10)
    taken = rng.randint(1, rows * per_row - 1)
    return (f"A hall has {rows} rows of chairs with {per_row} chairs in each row. {taken} chairs are taken. "
            f"How many chairs are free?", rows * per_row - taken)


# One-step problems first: a 135M model solves some of them, so RL groups have mixed rewards to learn from.
TEMPLATES = [_more, _fewer, _bags, _boxes, _change, _share, _distance, _pages, _wages, _chairs]


@TASKS.register("word_problems")
def word_problem(rng: random.Random) -> tuple[str, str]:
    """`Tom has 3 boxes with 12 apples in each box. He gives away 7 apples. ...` -> `29`."""
    text, answer = rng.choice(TEMPLATES)(rng)
    return f"{text} {INSTRUCTION}", str(answer)
