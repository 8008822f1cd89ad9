"""Prompt datasets from jsonl or parquet files with veRL-style columns.

Columns: `prompt` (a string, or a list of {role, content} chat messages), the answer in `answer` or in
`reward_model.ground_truth`, and optional `data_source` (default: the file's stem) and `extra_info` (an
object); both reach a reward function written in veRL's form (rlsys/reward/registry.py). A bad row is
refused with the file, the line (jsonl, from 1) or row (parquet, from 0) and what is wrong with it.
A `data.loader` (the user's `fn(path) -> iterable of rows`) reads other formats into the same rows.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

from rlsys.errors import UserError
from rlsys.types import Prompt


class DataError(UserError, ValueError):
    pass


def read_prompts(path: str | Path, split: str = "train", tokenizer=None, chat_template: bool = False,
                 loader: Callable[[str], Iterable[Any]] | None = None, tools: list[dict] | None = None) -> list[Prompt]:
    """Every row of a .jsonl or .parquet file (or every row `loader(path)` returns) as a Prompt with uid
    `<split>-<i>`.

    Chat-message prompts are rendered with `tokenizer`'s chat template when it has one; otherwise the
    last user message is the prompt text. With `chat_template`, string prompts are rendered too, as one
    user message. `tools` (JSON schemas) go to the template, which shows them to the model.
    """
    path = Path(path)
    rows = _reader(path, loader)
    prompts = []
    for where, row in rows(path):
        try:
            text, answer, source, extra_info = _parse_row(row, tokenizer, path.stem, chat_template, tools)
        except DataError as e:
            raise DataError(f"{path}, {where}: {e}") from None
        i = len(prompts)
        prompts.append(Prompt(uid=f"{split}-{i}", text=text, answer=answer, data_source=source, index=i,
                              extra_info=extra_info))
    if not prompts:
        raise DataError(f"{path}: the file is empty (no rows)")
    return prompts


def _reader(path: Path, loader) -> Callable[[Path], Iterator[tuple[str, Any]]]:
    if loader is not None:  # the path means what the loader makes of it: a file, a folder, a dataset name
        return lambda p: _loaded_rows(p, loader)
    if not path.is_file():
        raise DataError(f"{path}: dataset file not found")
    rows = {".jsonl": _jsonl_rows, ".parquet": _parquet_rows}.get(path.suffix)
    if rows is None:
        raise DataError(f"{path}: unsupported dataset file type {path.suffix!r}; use .jsonl or .parquet, "
                        "or read it with your own data.loader")
    return rows


def _loaded_rows(path: Path, loader) -> Iterator[tuple[str, Any]]:
    try:
        rows = loader(str(path))
        for number, row in enumerate(rows):
            yield f"row {number} of data.loader", row
    except DataError:
        raise
    except Exception as e:  # the user's code: name it, keep the cause
        raise DataError(f"{path}: data.loader raised {type(e).__name__}: {e}") from e


def _jsonl_rows(path: Path) -> Iterator[tuple[str, Any]]:
    with path.open("rb") as f:  # decoded line by line, so bytes that are not UTF-8 get a line number
        for number, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DataError(f"{path}, line {number}: not UTF-8 text ({e.reason} at byte {e.start + 1})") from None
            if not line.strip():
                continue  # blank lines (a trailing newline) are not rows
            try:
                yield f"line {number}", json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}, line {number}: not valid JSON ({e.msg} at column {e.colno})") from None


def _parquet_rows(path: Path) -> Iterator[tuple[str, Any]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except (pa.ArrowException, OSError) as e:
        raise DataError(f"{path}: not a readable parquet file ({e})") from None
    for number, row in enumerate(table.to_pylist()):
        yield f"row {number}", row


def _parse_row(row: Any, tokenizer, default_source: str, chat_template: bool = False,
               tools: list[dict] | None = None) -> tuple[str, str, str, dict | None]:
    if not isinstance(row, dict):
        raise DataError(f"a row must be an object with a 'prompt' field, got {type(row).__name__}")
    if row.get("prompt") is None:
        raise DataError("missing 'prompt'")
    text = _prompt_text(row["prompt"], tokenizer, chat_template, tools)
    if not text.strip():
        raise DataError("'prompt' is empty")
    source = row.get("data_source")
    if source is None:
        source = default_source
    elif not isinstance(source, str):
        raise DataError(f"'data_source' must be a string, got {type(source).__name__}")
    extra_info = row.get("extra_info")
    if extra_info is not None and not isinstance(extra_info, dict):
        raise DataError(f"'extra_info' must be an object, got {type(extra_info).__name__}")
    try:  # it is saved with the scheduler's open prompts in each checkpoint
        json.dumps(extra_info)
    except (TypeError, ValueError) as e:
        raise DataError(f"'extra_info' must hold only JSON values (strings, numbers, lists, objects): {e}") from None
    return text, _answer(row), source, extra_info


def chat_text(tokenizer, messages: list[dict], tools: list[dict] | None = None) -> str:
    """The messages rendered by the chat template, ready for `tokenizer(text)`, with the tools' schemas where
    there are some: a template that writes the BOS token itself loses it here when the tokenizer adds one
    anyway, so the model never sees two."""
    text = tokenizer.apply_chat_template(messages, tools=tools or None, tokenize=False, add_generation_prompt=True)
    bos = tokenizer.bos_token
    if bos and text.startswith(bos) and tokenizer("")["input_ids"][:1] == [tokenizer.bos_token_id]:
        text = text[len(bos):]
    return text


def _prompt_text(prompt: Any, tokenizer, chat_template: bool = False, tools: list[dict] | None = None) -> str:
    if isinstance(prompt, str):
        return chat_text(tokenizer, [{"role": "user", "content": prompt}], tools) if chat_template else prompt
    if not isinstance(prompt, list):
        raise DataError(f"'prompt' must be a string or a list of chat messages, got {type(prompt).__name__}")
    for i, message in enumerate(prompt):
        if not (isinstance(message, dict) and isinstance(message.get("role"), str)
                and isinstance(message.get("content"), str)):
            raise DataError(f"'prompt' message {i} must be an object with string 'role' and 'content'")
    if tokenizer is not None and getattr(tokenizer, "chat_template", None):
        return chat_text(tokenizer, [{"role": m["role"], "content": m["content"]} for m in prompt], tools)
    users = [m["content"] for m in prompt if m["role"] == "user"]
    if not users:
        raise DataError("'prompt' has no message with role 'user'")
    return users[-1]


def _answer(row: dict) -> str:
    answer, field = row.get("answer"), "answer"
    if answer is None:
        reward_model, field = row.get("reward_model"), "reward_model.ground_truth"
        if reward_model is None:
            raise DataError("missing the answer: give 'answer' or 'reward_model.ground_truth'")
        if not isinstance(reward_model, dict):
            raise DataError(f"'reward_model' must be an object, got {type(reward_model).__name__}")
        answer = reward_model.get("ground_truth")
        if answer is None:
            raise DataError("missing 'reward_model.ground_truth' (and no 'answer')")
    if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
        raise DataError(f"'{field}' must be a string or a number, got {type(answer).__name__}")
    return str(answer)
