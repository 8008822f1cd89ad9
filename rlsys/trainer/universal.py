"""Optimizer state stored per parameter name, so a checkpoint resumes on another world size or ZeRO stage.

  optimizer.json                    {"format", "step", "keys", "shards"}
  optimizer_shard{r}.safetensors    full tensors "<parameter name>/<key>" of the parameters rank r owned

Parameters are dealt round robin over the ranks that save, so no rank holds more than its share of
the full state; every rank reads what it needs from all shards when loading, whatever its count.
"""
from __future__ import annotations

import json
from contextlib import ExitStack
from pathlib import Path
from typing import Callable, Iterable

import torch
from safetensors import safe_open

from rlsys.trainer.tensor_io import save_tensors

INDEX = "optimizer.json"
FORMAT = "per-parameter"


def shard_file(rank: int) -> str:
    return f"optimizer_shard{rank}.safetensors"


def save_per_parameter(folder: str | Path, names: Iterable[str], keys: list[str],
                       full: Callable[[str, str], torch.Tensor], rank: int, world_size: int, step: float) -> None:
    """`full(name, key)` may be a collective: every rank calls it for every name and key, in order."""
    folder = Path(folder)
    owned = {}
    for i, name in enumerate(names):
        for key in keys:
            tensor = full(name, key)
            if i % world_size == rank:
                owned[f"{name}/{key}"] = tensor.detach().cpu()
    save_tensors(owned, folder / shard_file(rank))
    if rank == 0:
        index = {"format": FORMAT, "step": step, "keys": keys, "shards": world_size}
        (folder / INDEX).write_text(json.dumps(index))


class PerParameterState:
    """A saved per-parameter state, opened lazily: `get` reads one tensor from whichever shard holds it."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        index_path = self.folder / INDEX
        if not index_path.exists():
            raise ValueError(f"{self.folder}: no {INDEX}; the checkpoint has no per-parameter optimizer state")
        index = json.loads(index_path.read_text())
        if index.get("format") != FORMAT:
            raise ValueError(f"{index_path}: format {index.get('format')!r}, expected {FORMAT!r}")
        self.step, self.keys, self.shards = index["step"], list(index["keys"]), index["shards"]
        self._stack = ExitStack()
        self._where = {}
        for r in range(self.shards):
            path = self.folder / shard_file(r)
            if not path.exists():
                raise ValueError(f"{path}: missing; the checkpoint was written by {self.shards} ranks")
            handle = self._stack.enter_context(safe_open(str(path), framework="pt"))
            self._where.update({k: handle for k in handle.keys()})

    def check_names(self, names: Iterable[str]) -> None:
        """Refuse a checkpoint of another model, before any state is changed."""
        mine, saved = set(names), {entry.rsplit("/", 1)[0] for entry in self._where}
        if self.keys and mine != saved:
            extra, missing = sorted(saved - mine), sorted(mine - saved)
            raise ValueError(f"{self.folder}: optimizer state is for other parameters (only in the checkpoint: "
                             f"{extra[:3]}, only in this model: {missing[:3]}); was it written for another model?")

    def get(self, name: str, key: str) -> torch.Tensor:
        entry = f"{name}/{key}"
        return self._where[entry].get_tensor(entry)

    def close(self) -> None:
        self._stack.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
