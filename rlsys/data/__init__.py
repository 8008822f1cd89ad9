"""Datasets: the built-in synthetic tasks, the user's own task or loader, or veRL-style files, as (train, eval)
lists of Prompts."""
from __future__ import annotations

import dataclasses
import logging
import random

from rlsys.config import DataConfig
from rlsys.registry import Registry
from rlsys.data.files import DataError, chat_text, read_prompts
from rlsys.data import code_tasks  # noqa: F401  registers the `code` family
from rlsys.data import cot_tasks  # noqa: F401  registers the `cot_sum` family
from rlsys.data import long_tasks  # noqa: F401  registers the `rep_long` family
from rlsys.data import math_tasks  # noqa: F401  registers the `math` family
from rlsys.data import reason_tasks  # noqa: F401  registers the `reason` family
from rlsys.data import tool_tasks  # noqa: F401  registers the `tool_arith` family
from rlsys.data import word_problems  # noqa: F401  registers the `word_problems` family
from rlsys.data.synthetic import TASKS, length_stats, synthetic_splits
from rlsys.plugins import check_signature, is_spec, load_function, resolve
from rlsys.types import Prompt

log = logging.getLogger(__name__)
LOADERS: Registry = Registry("data loader")  # only the user's, each under its `module:function` spec

__all__ = ["DataError", "TASKS", "demonstrations", "filter_long_prompts", "length_stats", "load_datasets", "load_prompts",
           "read_prompts", "row_loader", "task_family"]


def task_family(name: str):
    """The family `data.task` names: registered, or the user's `module:function`, called as fn(rng) with a
    random.Random and returning (prompt text, answer)."""
    return resolve(TASKS, name, "data.task", ("rng",))


def demonstrations(task: str, spec: str | None = None):
    """The tool-use demonstrations for the warm start (model.warm_start.tool_share), a function of a Prompt giving
    its conversation as (text, the model's?) parts: the user's (`spec`, model.warm_start.demonstrations), else
    those of `task`'s family; ValueError if there are none."""
    if spec:
        fn = load_function(spec, "model.warm_start.demonstrations")
        check_signature(fn, spec, "model.warm_start.demonstrations", ("prompt",))
        return fn
    if task not in tool_tasks.DEMONSTRATIONS:
        raise ValueError(f"data.task={task!r} has no tool-use demonstrations; the families that have them: "
                         f"{', '.join(tool_tasks.DEMONSTRATIONS)}; or give yours in "
                         "model.warm_start.demonstrations=module:function")
    return tool_tasks.DEMONSTRATIONS[task]


def row_loader(spec: str):
    """The user's `data.loader`, called as fn(path) with data.train_path (or eval_path); it returns an
    iterable of veRL-style rows (dicts with `prompt` and `answer` or `reward_model.ground_truth`)."""
    return resolve(LOADERS, spec, "data.loader", ("path",))


def load_datasets(cfg: DataConfig, tokenizer=None,
                  tools: list[dict] | None = None) -> tuple[list[Prompt], list[Prompt]]:
    """(train, eval) for `cfg.task`: "synthetic" (the default mix), a task family (a name or the user's
    `module:function`), or "files", read by `cfg.loader` if set.

    With "files" and no `eval_path`, `eval_size` prompts are held out of the training file (seeded).
    `tokenizer` renders chat-message prompts with its chat template, if it has one; with
    `cfg.chat_template` every prompt is rendered, as one user message (it must have one then); the
    template shows the model the `tools` (JSON schemas, rlsys.tools.schemas) when given.
    """
    if cfg.chat_template and not getattr(tokenizer, "chat_template", None):
        raise DataError("data.chat_template is true but the model's tokenizer has no chat template"
                        if tokenizer is not None else "data.chat_template is true but no tokenizer was given")
    if cfg.task == "files":
        if not cfg.train_path:
            raise DataError("data.train_path must be set when data.task is 'files'")
        loader = row_loader(cfg.loader) if cfg.loader else None
        train = read_prompts(cfg.train_path, "train", tokenizer, cfg.chat_template, loader, tools)
        if cfg.eval_path:
            return train, read_prompts(cfg.eval_path, "eval", tokenizer, cfg.chat_template, loader, tools)
        return _hold_out(train, cfg.eval_size, cfg.seed, cfg.train_path)
    if cfg.task != "synthetic" and not is_spec(cfg.task) and cfg.task not in TASKS:
        raise DataError(f"data.task: unknown task {cfg.task!r}; choose 'files', 'synthetic', 'module:function' "
                        f"or one of: {', '.join(TASKS.names())}")
    if is_spec(cfg.task):
        task_family(cfg.task)  # imports the user's family and registers it under its spec, for synthetic_splits
    splits = synthetic_splits(cfg.task, cfg.train_size, cfg.eval_size, cfg.seed)
    if not cfg.chat_template:
        return splits
    return tuple([dataclasses.replace(p, text=chat_text(tokenizer, [{"role": "user", "content": p.text}], tools))
                  for p in split] for split in splits)


def _hold_out(prompts: list[Prompt], n_eval: int, seed: int, path: str) -> tuple[list[Prompt], list[Prompt]]:
    if n_eval >= len(prompts):
        raise DataError(f"{path}: {len(prompts)} rows cannot spare data.eval_size={n_eval} for evaluation; "
                        "set data.eval_path or a smaller data.eval_size")
    order = list(range(len(prompts)))
    random.Random(seed).shuffle(order)
    held = set(order[:n_eval])

    def renumber(items: list[Prompt], split: str) -> list[Prompt]:
        return [dataclasses.replace(p, uid=f"{split}-{i}", index=i) for i, p in enumerate(items)]
    return (renumber([p for i, p in enumerate(prompts) if i not in held], "train"),
            renumber([prompts[i] for i in sorted(held)], "eval"))


def load_prompts(cfg: DataConfig, tokenizer, tools: list[dict] | None = None) -> tuple[list[Prompt], list[Prompt], int]:
    """(train, eval, training prompts dropped) as a run uses them: both splits without the prompts over
    `cfg.max_prompt_tokens` tokens. Drops are logged per split; a split left empty is refused."""
    train, evals = load_datasets(cfg, tokenizer, tools)
    train, dropped = _within_limit(train, "training", tokenizer, cfg.max_prompt_tokens)
    evals, _ = _within_limit(evals, "eval", tokenizer, cfg.max_prompt_tokens)
    return train, evals, dropped


def _within_limit(prompts: list[Prompt], split: str, tokenizer, max_tokens: int) -> tuple[list[Prompt], int]:
    kept, dropped = filter_long_prompts(prompts, tokenizer, max_tokens)
    if not kept:
        raise DataError(f"all {len(prompts)} {split} prompts are longer than data.max_prompt_tokens={max_tokens} "
                        "tokens: raise it, or check data.chat_template and the tokenizer")
    if dropped:
        log.warning("dropped %d of %d %s prompts longer than data.max_prompt_tokens=%d tokens",
                    dropped, len(prompts), split, max_tokens)
    return kept, dropped


def filter_long_prompts(prompts: list[Prompt], tokenizer, max_tokens: int) -> tuple[list[Prompt], int]:
    """(prompts of at most `max_tokens` tokens, how many were dropped); the caller reports the count."""
    if not prompts:
        return [], 0
    lengths = [len(ids) for ids in tokenizer([p.text for p in prompts])["input_ids"]]
    kept = [p for p, n in zip(prompts, lengths) if n <= max_tokens]
    return kept, len(prompts) - len(kept)
