"""A run's config, from its file to the moment the first actor may start: the one place that loads it.

The schema (rlsys/config.py) imports nothing of rlsys, so what needs the rest of rlsys is checked here, right
after the file is read: names against the registries, the loss's options against the loss, the user's code
named in the config imported (rlsys/plugins.py), the GPU placement planned. A typo fails before any actor
starts, with the field and where it was set (file and line, or override). Every entry point that loads a
config for a run (train, eval, bench, launch/submit.py) calls `load_config`.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable

from rlsys.config import Config, read_config
from rlsys.data import row_loader, task_family
from rlsys.placement import plan_from_config
from rlsys.plugins import is_spec
from rlsys.reward.registry import reward_fn
from rlsys.rollout.registry import engine_entry
from rlsys.trainer.losses import check_loss_options

# (the field's location, or () for the whole config; its check, which raises a ValueError naming the field).
# The user's code named in data.task and reward.fn is imported here; a built-in name there is looked up where it
# is used (load_datasets, the reward pool), which names the field as well.
CHECKS: tuple[tuple[tuple[str, ...], Callable[[Config], object]], ...] = (
    (("data", "task"), lambda cfg: is_spec(cfg.data.task) and task_family(cfg.data.task)),
    (("data", "loader"), lambda cfg: cfg.data.loader and row_loader(cfg.data.loader)),
    (("reward", "fn"), lambda cfg: is_spec(cfg.reward.fn) and reward_fn(cfg.reward.fn)),
    (("rollout", "engine"), lambda cfg: engine_entry(cfg.rollout.engine)),
    ((), lambda cfg: check_loss_options(cfg.trainer)),  # the loss registry's: options the loss gives no meaning
    ((), plan_from_config),
)


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """The config of a file (the default one for None) with `key=value` overrides, checked against the schema
    and then by CHECKS; every problem found is raised as one ConfigError."""
    cfg, source = read_config(path, overrides)
    problems = []
    for loc, check in CHECKS:
        try:
            check(cfg)
        except ValueError as e:
            value = cfg
            for key in loc:
                value = getattr(value, key)
            field = ".".join(loc)  # printed before the message already
            problems.append((loc, str(e).removeprefix(f"{field}: "), f" (got {value!r})" if loc else ""))
    if problems:
        raise source.error(problems)
    return cfg
