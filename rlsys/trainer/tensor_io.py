"""Nested state dicts <-> one safetensors file + one JSON skeleton, so checkpoints never need pickle.

Tensors (and numpy arrays) go to `<name>.safetensors` under their path in the tree; everything else
(numbers, strings, lists, tuples, dicts with int keys, None) goes to `<name>.json`, tagged where JSON
alone would lose the type, so `load_state(save_state(x))` gives back an equal structure.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file


def save_state(state: Any, folder: str | Path, name: str) -> None:
    tensors: dict[str, torch.Tensor] = {}
    skeleton = _encode(state, "", tensors)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / f"{name}.safetensors"))
    (folder / f"{name}.json").write_text(json.dumps(skeleton))


def load_state(folder: str | Path, name: str) -> Any:
    folder = Path(folder)
    tensors = load_file(str(folder / f"{name}.safetensors"))
    return _decode(json.loads((folder / f"{name}.json").read_text()), tensors)


def save_tensors(tensors: dict[str, torch.Tensor], path: str | Path) -> None:
    """A flat dict of tensors; clones break memory sharing (tied weights), which safetensors refuses."""
    save_file({k: v.detach().cpu().clone().contiguous() for k, v in tensors.items()}, str(path))


def _encode(obj: Any, path: str, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(obj, torch.Tensor):
        return {"__tensor__": _add(tensors, path, obj.detach().cpu().clone().contiguous())}
    if isinstance(obj, np.ndarray):
        return {"__ndarray__": _add(tensors, path, torch.from_numpy(obj.copy()))}
    if isinstance(obj, dict):
        if all(isinstance(k, str) and not k.startswith("__") for k in obj):
            return {k: _encode(v, f"{path}/{k}", tensors) for k, v in obj.items()}
        # Optimizer state is keyed by int: keep the keys' types by storing pairs.
        return {"__items__": [[_key(k), _encode(v, f"{path}/{k}", tensors)] for k, v in obj.items()]}
    if isinstance(obj, tuple):
        return {"__tuple__": [_encode(v, f"{path}/{i}", tensors) for i, v in enumerate(obj)]}
    if isinstance(obj, list):
        return [_encode(v, f"{path}/{i}", tensors) for i, v in enumerate(obj)]
    if isinstance(obj, np.generic):
        return obj.item()
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise TypeError(f"cannot store {type(obj).__name__} at {path or '/'} in safetensors + JSON")


def _add(tensors: dict[str, torch.Tensor], path: str, tensor: torch.Tensor) -> str:
    key = path if path not in tensors else f"{path}#{len(tensors)}"  # a str key holding "/" could collide
    tensors[key] = tensor
    return key


def _key(k: Any) -> Any:
    if isinstance(k, (str, int)) and not isinstance(k, bool):
        return k
    raise TypeError(f"dict key {k!r} must be str or int to be stored as JSON")


def _decode(obj: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(obj, list):
        return [_decode(v, tensors) for v in obj]
    if not isinstance(obj, dict):
        return obj
    if "__tensor__" in obj:
        return tensors[obj["__tensor__"]]
    if "__ndarray__" in obj:
        return tensors[obj["__ndarray__"]].numpy()
    if "__tuple__" in obj:
        return tuple(_decode(v, tensors) for v in obj["__tuple__"])
    if "__items__" in obj:
        return {k: _decode(v, tensors) for k, v in obj["__items__"]}
    return {k: _decode(v, tensors) for k, v in obj.items()}
