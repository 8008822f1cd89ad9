"""A new user's first hour: configs that differ only in what RL does share one warm start, the first run states
the warm start's cost before it starts and shows its progress, no wait passes in silence, `make setup` says what
it installs, and the README's first screen promises no time that the first run cannot keep."""
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rlsys.config import Config, DataConfig, ModelConfig, WarmStartConfig, read_config
from rlsys.models import cache_key, prepare_model

from helpers import SMALL_MODEL as SMALL

REPO = Path(__file__).resolve().parent.parent


def config(steps=3, data=None, **warm_start) -> Config:
    return Config(model=ModelConfig(**SMALL, warm_start=WarmStartConfig(steps=steps, batch_size=8, **warm_start)),
                  data=data or DataConfig(train_size=40, eval_size=4))


def with_fields(cfg: Config, **dotted) -> Config:
    """`cfg` with `section.field=value` overrides, validated as a config file's."""
    tree = cfg.model_dump()
    for key, value in dotted.items():
        *path, last = key.split("__")
        node = tree
        for name in path:
            node = node[name]
        node[last] = value
    return Config.model_validate(tree)


def test_configs_that_differ_only_in_rl_settings_share_one_warm_start():
    base = config()
    rl_only = with_fields(base, trainer__loss="gspo", trainer__lr=3e-5, control__group_size=4,
                          rollout__max_new_tokens=32, rollout__temperature=0.7, data__eval_size=50,
                          data__max_prompt_tokens=40, model__cache_dir="elsewhere", output_dir="runs/other")
    assert cache_key(rl_only) == cache_key(base)
    built_differently = {"model__hidden_size": 64, "model__num_layers": 3, "data__task": "rev",
                         "data__train_size": 50, "data__seed": 1, "model__warm_start__steps": 4,
                         "model__warm_start__lr": 1e-3, "model__warm_start__label_noise": 0.5,
                         "model__warm_start__seed": 1, "model__warm_start__device": "cuda"}
    for key, value in built_differently.items():
        assert cache_key(with_fields(base, **{key: value})) != cache_key(base), key


def test_every_recipe_shares_one_warm_start_and_tiny_yaml_shares_its_own_with_rl_overrides():
    """The recipes set RL only (configs/recipes/*.yaml): one build serves them all. configs/tiny.yaml's warm start
    differs from theirs (800 steps on noisy answers, not the default 400 on clean ones), so it builds its own."""
    recipes = sorted((REPO / "configs" / "recipes").glob("*.yaml"))
    keys = {path.name: cache_key(read_config(path)[0]) for path in recipes}
    assert len(recipes) > 5 and len(set(keys.values())) == 1, keys
    tiny = cache_key(read_config(REPO / "configs" / "tiny.yaml")[0])
    assert tiny == cache_key(read_config(REPO / "configs" / "tiny.yaml", [
        "trainer.loss=cispo", "control.scheduler=tail", "trainer.total_steps=2", "data.eval_size=20"])[0])


def test_what_a_build_cannot_depend_on_is_no_part_of_its_key(tmp_path):
    """No warm start: only the architecture and its init seed. No label noise: not its kind. A held-out eval file:
    not the hold-out's size. The user's loader reads the training file: part of it."""
    off = config(steps=0)
    assert cache_key(with_fields(off, data__task="rev", model__warm_start__label_noise=0.5,
                                 model__warm_start__lr=1e-3)) == cache_key(off)
    assert cache_key(with_fields(off, model__warm_start__seed=1)) != cache_key(off)
    assert cache_key(with_fields(config(), model__warm_start__noise="guess")) == cache_key(config())
    noisy = config(label_noise=0.5)
    assert cache_key(with_fields(noisy, model__warm_start__noise="guess")) != cache_key(noisy)
    rows = tmp_path / "train.jsonl"
    rows.write_text('{"prompt": "1+1=", "answer": "2"}\n' * 10)
    files = config(data=DataConfig(task="files", train_path=str(rows), eval_path=str(rows), eval_size=4))
    assert cache_key(with_fields(files, data__eval_size=2, data__seed=3)) == cache_key(files)
    held_out = with_fields(files, data__eval_path=None)
    assert cache_key(with_fields(held_out, data__eval_size=2)) != cache_key(held_out)
    assert cache_key(with_fields(files, data__loader="my_rows:read")) != cache_key(files)


def test_the_first_run_states_the_warm_starts_cost_before_it_starts_and_shows_its_progress(tmp_path, capsys,
                                                                                             monkeypatch):
    cfg = with_fields(config(steps=6, data=DataConfig(train_size=40, eval_size=12)),
                      model__cache_dir=str(tmp_path / "cache"))
    monkeypatch.setattr(sys, "stderr", sys.stdout)  # tqdm's bars and the lines in the order a terminal shows them
    prepare_model(cfg)
    text = capsys.readouterr().out.replace("\r", "\n")
    cost = re.search(r"warm start: 6 steps of 8 examples, (under a minute|about \d+ minutes?) on this machine "
                     r"\(([\d.]+) s a step, the median of 3 measured before it starts\)", text)
    assert cost, text
    bar = text.index("warm start:   0%")
    assert text.index("building the tiny model (once: cached at") < cost.start() < bar, text
    assert "6/6" in text[bar:] and "loss=" in text[bar:]
    after = text[text.index("6/6"):]
    assert "now a greedy eval of its 12 eval prompts" in after and "greedy eval: 100%" in after, after
    assert "12/12" in after and after.index("greedy eval: 100%") < after.index("eval greedy accuracy")


def test_without_a_bar_the_warm_start_prints_a_line_at_each_tenth_of_its_steps(tmp_path, capsys):
    """logging.progress=false (each bench run's config) turns the bars off, not the progress."""
    cfg = with_fields(config(steps=20), model__cache_dir=str(tmp_path / "cache"), logging__progress=False)
    prepare_model(cfg)
    out, err = capsys.readouterr()
    steps = re.findall(r"warm start: step (\d+)/20, loss [\d.]+, \d+ s", out)
    assert steps == [str(n) for n in range(2, 20, 2)], out
    assert "warm start: " not in err and "greedy eval:" not in err, err


def test_a_wait_past_its_first_seconds_says_what_it_waits_for_until_it_ends(capsys):
    from rlsys.logger import waiting

    with waiting("starting Ray", first=0.2, every=0.2):
        time.sleep(0.75)
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) >= 3 and all(re.fullmatch(r"starting Ray: \d+ s so far", line) for line in lines[:-1]), lines
    assert re.fullmatch(r"starting Ray: done in \d+ s", lines[-1]), lines
    with waiting("a short wait", first=0.5):
        time.sleep(0.05)
    assert capsys.readouterr().out == ""


def test_a_runs_eval_says_how_many_of_its_samples_are_scored_above_the_bar():
    """The step-0 eval held a training run's bar still for 20 s in silence: its wait says how far it has come, through
    the run's logger, so the lines go above the bar."""
    from rlsys.config import RolloutConfig
    from rlsys.evaluate import Evaluation
    from rlsys.logger import waiting
    from rlsys.models.tiny import build_char_tokenizer
    from rlsys.types import Prompt

    prompts = [Prompt(f"p{i}", f"{i}+1=", str(i + 1)) for i in range(3)]
    evaluation = Evaluation(build_char_tokenizer(), prompts, RolloutConfig(eval_samples=2, eval_greedy=False))
    said = []
    with waiting(evaluation.progress, first=0.1, every=0.1, say=said.append):
        time.sleep(0.15)
        for key in list(evaluation.asked)[:4]:
            evaluation.add(key, 1.0)
        time.sleep(0.2)
    assert said[0].startswith("eval: 0 of 6 samples scored: ")
    assert said[-1].startswith("eval: 4 of 6 samples scored: done in ")


def test_a_run_without_a_bar_prints_a_step_line_now_and_then_and_at_its_last_step(tmp_path, capsys, monkeypatch):
    """A bench's runs have no bar: each printed nothing for a minute. Now a line every LINE_EVERY_S at most."""
    from rlsys import logger
    from rlsys.config import LoggingConfig

    log = logger.RunLogger(tmp_path / "sync-s0", LoggingConfig(progress=False), total_steps=3)
    (tmp_path / "sync-s0").mkdir()
    log.write(1, 1.0, {"reward/mean": 0.25})
    assert capsys.readouterr().out == ""  # sooner than LINE_EVERY_S after the last line
    monkeypatch.setattr(logger, "LINE_EVERY_S", 0.0)
    log.write(2, 2.0, {"reward/mean": 0.5, "eval/accuracy": 0.4})
    monkeypatch.setattr(logger, "LINE_EVERY_S", 3600.0)
    log.write(3, 3.0, {"reward/mean": 0.75})
    assert capsys.readouterr().out.splitlines() == ["sync-s0: step 2/3: reward 0.5, acc 0.4",
                                                    "sync-s0: step 3/3: reward 0.75, acc 0.4"]


def test_make_setup_says_what_it_installs_before_each_step(tmp_path):
    plan = subprocess.run(["make", "-n", "-C", str(REPO), "setup", f"VENV={tmp_path / 'venv'}"],
                          capture_output=True, text=True, check=True).stdout
    assert " -q" not in plan, plan  # pip lists what it collects and installs
    steps = plan.splitlines()
    installs = [i for i, line in enumerate(steps) if "pip install" in line]
    assert len(installs) == 3, plan  # pip itself, torch's CPU build (no GPU here or not), rlsys and its extras
    for before, i in zip([-1] + installs, installs):
        said = [line for line in steps[before + 1:i + 1] if re.search(r'echo "setup: (creating|installing)', line)]
        assert said, f"nothing said before {steps[i]!r}:\n{plan}"


def test_the_readmes_first_screen_promises_no_time_the_first_run_cannot_keep():
    """A first run on an empty home builds and warm-starts the tiny model first: minutes, not "a minute"."""
    first_screen = (REPO / "README.md").read_text().split("## Install")[0]
    assert "takes a minute" not in first_screen
    check = first_screen[first_screen.index("A first check"):]
    assert "builds" in check and "warm" in check and "cost" in check, check
