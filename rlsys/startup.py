"""A run's config, from its file to the moment the first actor may start: the one place that loads it.

The schema (rlsys/config.py) imports nothing of rlsys, so what needs the rest of rlsys is checked here, right
after the file is read: names against the registries, the loss's options against the loss, the user's code
named in the config imported (rlsys/plugins.py), the GPU placement planned. A typo fails before any actor
starts, with the field and where it was set (file and line, or override). Every entry point that loads a
config for a run (train, eval, bench, launch/submit.py) calls `load_config`; `check_report` says what a loaded
config would start (`rlsys check`, every --dry-run), without starting it.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable

from rlsys.config import Config, read_config
from rlsys.control.scheduler import SCHEDULERS
from rlsys.control.sizing import GROUP_SIZERS
from rlsys.data import demonstrations, row_loader, task_family
from rlsys.data.synthetic import TASKS
from rlsys.emulate import Budget, Emulation
from rlsys.placement import format_plan, idle_warning, plan_from_config
from rlsys.plugins import is_spec
from rlsys.reward.registry import reward_fn
from rlsys.rollout.registry import engine_entry
from rlsys.tools.box import user_tools
from rlsys.trainer.advantages import ADVANTAGES
from rlsys.trainer.losses import POLICY_LOSSES, check_loss_options

# (the field's location, or () for the whole config; its check, which raises a ValueError naming the field).
# Every name chosen from a registry is looked up here, so a typo ("did you mean ...?") costs seconds, not the
# minutes until the part that uses it starts; the user's code named in data.task and reward.fn is imported.
CHECKS: tuple[tuple[tuple[str, ...], Callable[[Config], object]], ...] = (
    (("data", "task"), lambda cfg: cfg.data.task in ("files", "synthetic")
     or (task_family(cfg.data.task) if is_spec(cfg.data.task) else TASKS.get(cfg.data.task))),
    (("data", "loader"), lambda cfg: cfg.data.loader and row_loader(cfg.data.loader)),
    (("reward", "fn"), lambda cfg: reward_fn(cfg.reward.fn)),
    (("tools", "fns"), lambda cfg: user_tools(cfg.tools)),
    (("model", "warm_start", "tool_share"), lambda cfg: not cfg.model.warm_start.tool_share
     or demonstrations(cfg.data.task)),
    (("rollout", "engine"), lambda cfg: engine_entry(cfg.rollout.engine)),
    (("control", "scheduler"), lambda cfg: SCHEDULERS.get(cfg.control.scheduler)),
    (("control", "group_sizer"), lambda cfg: GROUP_SIZERS.get(cfg.control.group_sizer)),
    (("trainer", "loss"), lambda cfg: POLICY_LOSSES.get(cfg.trainer.loss)),
    (("trainer", "advantage"), lambda cfg: ADVANTAGES.get(cfg.trainer.advantage)),
    ((), lambda cfg: cfg.trainer.loss not in POLICY_LOSSES or check_loss_options(cfg.trainer)),  # the loss's options
    ((), plan_from_config),
    ((), lambda cfg: not cfg.emulate.on or Budget.of(cfg.emulate, cfg.rollout.num_workers, cfg.trainer.world_size)),
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


USER_CODE = (("data", "task"), ("data", "loader"), ("reward", "fn"), ("tools", "fns"))  # may name the user's code


def _listed(value: str | list[str] | None) -> list[str]:
    return value if isinstance(value, list) else [value or ""]


def check_report(cfg: Config) -> str:
    """What a config loaded by `load_config` would start: the user code it imported, which GPU would hold which
    engine and trainer rank on each node (logical GPUs: no Ray, no GPU needed), and what would sit idle."""
    specs = [f"{section}.{key}={value}" for section, key in USER_CODE
             for value in _listed(getattr(getattr(cfg, section), key)) if is_spec(value)]
    lines = [f"user code imported: {', '.join(specs)}"] if specs else []
    plan = plan_from_config(cfg)
    if plan is None:
        lines.append(f"placement: no GPUs (cluster.gpus_per_node=0): {cfg.rollout.num_workers} engine(s), "
                     f"{cfg.trainer.world_size} trainer rank(s) and {cfg.reward.num_workers} reward worker(s) on the "
                     "CPUs of the Ray cluster")
    else:
        lines += [format_plan(plan), *filter(None, [idle_warning(plan)])]
    if cfg.emulate.on:
        lines.append(Emulation.of(cfg).layout_report(cfg))
    return "\n".join(lines)
