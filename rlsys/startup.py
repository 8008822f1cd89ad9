"""A run's config, from its file to the moment the first actor may start: the one place that loads it.

The schema (rlsys/config.py) imports nothing of rlsys, so what needs the rest of rlsys is checked here, right
after the file is read: names against the registries, the loss's options against the loss, the user's code
named in the config imported (rlsys/plugins.py), the GPU placement planned. A typo fails before any actor
starts, with the field and where it was set (file and line, or override). Every entry point that loads a
config for a run (train, eval, bench, launch/submit.py) calls `load_config`; `check_report` says what a loaded
config would start (`rlsys check`, every --dry-run), without starting it.
"""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Callable

from rlsys.config import Config, read_config
from rlsys.control.scheduler import SCHEDULERS
from rlsys.control.sizing import GROUP_SIZERS
from rlsys.data import demonstrations, row_loader, task_family
from rlsys.data.synthetic import TASKS, synthetic_splits
from rlsys.emulate import Budget, Emulation
from rlsys.memory import check_fits, format_memory, plan_memory
from rlsys.placement import format_plan, idle_warning, plan_from_config
from rlsys.plugins import is_spec
from rlsys.reward.registry import reward_parts
from rlsys.rollout.registry import engine_entry
from rlsys.tools.box import user_env, user_tools
from rlsys.trainer.advantages import ADVANTAGES, check_advantage_options
from rlsys.trainer.losses import POLICY_LOSSES, check_loss_options

# (the field's location, or () for the whole config; its check, which raises a ValueError naming the field).
# Every name chosen from a registry is looked up here, so a typo ("did you mean ...?") costs seconds, not the
# minutes until the part that uses it starts; the user's code named in data.task and reward.fn is imported.
CHECKS: tuple[tuple[tuple[str, ...], Callable[[Config], object]], ...] = (
    (("data", "task"), lambda cfg: cfg.data.task in ("files", "synthetic")
     or (task_family(cfg.data.task) if is_spec(cfg.data.task) else TASKS.get(cfg.data.task))),
    (("data", "loader"), lambda cfg: cfg.data.loader and row_loader(cfg.data.loader)),
    (("reward", "fn"), lambda cfg: reward_parts(cfg.reward)),
    (("reward", "model", "device"), lambda cfg: reward_model_gpus(cfg)),
    (("tools", "fns"), lambda cfg: user_tools(cfg.tools)),
    (("tools", "env"), lambda cfg: user_env(cfg.tools)),
    (("model", "warm_start", "tool_share"), lambda cfg: not cfg.model.warm_start.tool_share
     or cfg.model.warm_start.demonstrations or demonstrations(cfg.data.task)),
    (("model", "warm_start", "demonstrations"), lambda cfg: not cfg.model.warm_start.demonstrations
     or demonstrations(cfg.data.task, cfg.model.warm_start.demonstrations)),
    (("rollout", "engine"), lambda cfg: engine_entry(cfg.rollout.engine)),
    (("control", "scheduler"), lambda cfg: SCHEDULERS.get(cfg.control.scheduler)),
    (("control", "group_sizer"), lambda cfg: GROUP_SIZERS.get(cfg.control.group_sizer)),
    (("trainer", "loss"), lambda cfg: POLICY_LOSSES.get(cfg.trainer.loss)),
    (("trainer", "advantage"), lambda cfg: ADVANTAGES.get(cfg.trainer.advantage)),
    ((), lambda cfg: cfg.trainer.advantage not in ADVANTAGES or check_advantage_options(cfg.trainer)),
    ((), lambda cfg: cfg.trainer.loss not in POLICY_LOSSES or check_loss_options(cfg.trainer)),  # the loss's options
    ((), plan_from_config),
    ((), check_fits),  # the per-GPU memory plan (rlsys/memory.py)
    (("logging", "tensorboard"), lambda cfg: not cfg.logging.tensorboard or installed("tensorboard")),
    (("logging", "wandb"), lambda cfg: not cfg.logging.wandb or wandb_ready()),
    ((), lambda cfg: not cfg.emulate.on or Budget.of_run(cfg)),
)

LOGGING_EXTRA = "install the `logging` extra (`make setup EXTRAS=dev,logging`, or `pip install -e \".[logging]\"`)"


def installed(package: str) -> bool:
    """A logging.<package> backend's package (tensorboard's writer, wandb) is there; looked up, not imported (a
    check imports no torch)."""
    if importlib.util.find_spec(package) is None:
        raise ValueError(f"the {package} package is not installed: {LOGGING_EXTRA}, or set logging.{package}=false")
    return True


def wandb_ready() -> bool:
    """wandb installed, and a key to log with (WANDB_API_KEY, or a `wandb login` in ~/.netrc), or a mode that
    needs none."""
    installed("wandb")
    netrc = Path(os.environ.get("NETRC", Path.home() / ".netrc"))
    logged_in = netrc.is_file() and "api.wandb.ai" in netrc.read_text(errors="replace")
    if not (os.environ.get("WANDB_API_KEY") or logged_in or os.environ.get("WANDB_MODE") in ("offline", "disabled")):
        raise ValueError("wandb has no key: run `wandb login` (or set WANDB_API_KEY), or log to files with "
                         "WANDB_MODE=offline, or set logging.wandb=false")
    return True


def reward_model_gpus(cfg: Config) -> None:
    """A reward model on cuda gives each reward worker a GPU of its own: the placement plan must leave them free."""
    if not cfg.reward.model.path or cfg.reward.model.device != "cuda":
        return
    try:
        plan = plan_from_config(cfg)
    except ValueError:  # a plan that fails is the plan's check's to report
        return
    total = plan.nodes * plan.gpus_per_node if plan else 0
    free = total - plan.used_gpus if plan else 0
    if free < cfg.reward.num_workers:
        raise ValueError(f"cuda gives each of the reward.num_workers={cfg.reward.num_workers} reward workers a GPU of "
                         f"its own, and the placement leaves {free} of cluster.nodes x cluster.gpus_per_node = "
                         f"{total} free: add GPUs, use fewer engines or trainer ranks, or reward.model.device=cpu")


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


def start_problems(cfg: Config) -> list[str]:
    """What a run of `cfg` started here would fail on (or silently ignore), found without starting anything:
    model.path, the data files, data.eval_size held out of a training file too small for it, a task with fewer
    distinct prompts than data.train_size and data.eval_size ask, several nodes asked
    of the one-node Ray a run starts itself. Not part of `load_config`: a config may be checked here for a cluster
    (its disks, its Ray) that this machine is not."""
    from rlsys.models import ModelDirError, validate_model_dir

    problems = []
    c = cfg.cluster
    if c.nodes > 1 and not c.address and not c.gpus_per_node:  # GPU plans have their own refusal (placement)
        problems.append(f"cluster.nodes={c.nodes}: the Ray cluster a run starts itself (cluster.address unset) is "
                        "this one machine, so it would train on one node; join a running multi-node Ray with "
                        "cluster.address=auto (launch/), or set cluster.nodes=1")
    for path, field in ((cfg.model.path, "model.path"), (cfg.reward.model.path, "reward.model.path")):
        try:
            path and validate_model_dir(path, field)
        except ModelDirError as e:
            problems.append(str(e))
    data = cfg.data
    if data.task != "files":  # a task with fewer distinct prompts than the splits ask: now, not minutes in
        try:
            synthetic_splits(data.task, data.train_size, data.eval_size, data.seed)
        except ValueError as e:
            problems.append(str(e))
    if data.task != "files" or data.loader:  # the user's loader decides what its paths mean
        return problems
    if not data.train_path:
        return problems + ["data.train_path must be set when data.task is 'files'"]
    for field, path in (("data.train_path", data.train_path), ("data.eval_path", data.eval_path)):
        if path and not Path(path).is_file():
            problems.append(f"{field}: {path}: dataset file not found")
    if not data.eval_path and Path(data.train_path).is_file():
        rows = count_rows(Path(data.train_path))
        if rows is not None and data.eval_size >= rows:
            problems.append(f"data.eval_size: {data.train_path} has {rows} rows and cannot spare data.eval_size="
                            f"{data.eval_size} for evaluation; set data.eval_path or a smaller data.eval_size")
    return problems


def count_rows(path: Path) -> int | None:
    """The rows of a jsonl (its non-blank lines) or parquet file (its metadata); None for another kind."""
    if path.suffix == ".jsonl":
        with path.open("rb") as f:
            return sum(1 for line in f if line.strip())
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.ParquetFile(path).metadata.num_rows
    return None


def stale_loss_warning(cfg: Config) -> str | None:
    """Samples generated by older weights (async with eta > 0, sorted's partial mode) trained with a loss that does
    not correct for their age: docs/schedulers.md's "set also" asks for decoupled_ppo. A warning, not a refusal: the
    loss studies (benchmarks/loss_sweep.py) train other losses on stale samples on purpose."""
    c = cfg.control
    stale = ("control.scheduler=async" if c.scheduler == "async" and c.staleness.eta > 0 else
             "control.sorted.mode=partial" if c.scheduler == "sorted" and c.sorted.mode == "partial" else None)
    if stale is None or cfg.trainer.loss == "decoupled_ppo":
        return None
    return (f"warning: {stale} trains on samples of older weights, which trainer.loss={cfg.trainer.loss} does not "
            "correct for; set trainer.loss=decoupled_ppo (unless comparing losses under staleness)")


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
        lines += [format_plan(plan), format_memory(plan_memory(cfg)), *filter(None, [idle_warning(plan)])]
    if cfg.emulate.on:
        lines.append(Emulation.of(cfg).layout_report(cfg))
    return "\n".join(lines + list(filter(None, [stale_loss_warning(cfg)])))
