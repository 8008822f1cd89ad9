"""The user's own code, named in the config: `module.path:function` or `path/to/file.py:function`.

The config fields that select a registered function by name (reward.fn, data.task) also take such a
spec, and data.loader takes one. `resolve` imports the module, checks that the function can be called
with the arguments rlsys passes, and registers it under the spec, so the rest of rlsys looks it up by
name as it does a built-in. A run's config is checked as it loads (rlsys/startup.py): every spec is
imported then, so a typo fails before any actor starts, with an error naming the field. A module spec
must be importable (installed, or on PYTHONPATH); a file spec is read from that path (relative to the
working directory). The reward function travels to the reward actors by value (rlsys/reward/pool.py): the
actors need not see the file, but any module it imports must be importable there.
"""
from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import sys
from pathlib import Path
from types import ModuleType
from typing import Callable

from rlsys.errors import UserError


class PluginError(UserError, ValueError):
    pass


def is_spec(value: str) -> bool:
    """A `module:function` or `file.py:function` spec, as opposed to a registered name (never has a colon)."""
    return ":" in value


def resolve(registry, value: str, key: str,
            params: tuple[str, ...] | Callable[[Callable], tuple[tuple[str, ...], bool]], by_name: bool = False):
    """The function `value` names: a registered one, or the user's, imported and registered under `value`.

    `params` are the arguments rlsys calls it with, positionally (by name with `by_name`), or, for a field that
    takes two forms, a function of the user's function giving (params, by_name)."""
    if not is_spec(value) or value in registry:
        return registry.get(value)
    fn = load_function(value, key)
    if callable(params):
        params, by_name = params(fn)
    check_signature(fn, value, key, params, by_name)
    registry.register(value)(fn)
    return fn


def load_function(spec: str, key: str) -> Callable:
    module_part, _, name = spec.rpartition(":")
    if not module_part or not name.isidentifier():
        raise PluginError(f"{key}: {spec!r} is neither a registered name nor 'module.path:function' or "
                          "'path/to/file.py:function'")
    module = _import_file(module_part, key) if module_part.endswith(".py") else _import_module(module_part, key)
    fn = getattr(module, name, None)
    if fn is None:
        kind = "file" if module_part.endswith(".py") else "module"
        raise PluginError(f"{key}: {kind} {module_part!r} has no function {name!r}")
    if not callable(fn):
        raise PluginError(f"{key}: {spec!r} is not a function (it is of type {type(fn).__name__})")
    return fn


def check_signature(fn: Callable, spec: str, key: str, params: tuple[str, ...], by_name: bool = False) -> None:
    """Refuse a function that cannot be called as fn(*params) (fn(p=...) for each p with `by_name`), before a
    run calls it thousands of times."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # some builtins have none: nothing to check
        return
    try:
        signature.bind(**dict.fromkeys(params)) if by_name else signature.bind(*params)
    except TypeError:
        call = ", ".join(f"{p}=..." for p in params) if by_name else ", ".join(params)
        raise PluginError(f"{key}: {spec!r} has the signature {signature}, but rlsys calls it as fn({call})") from None


def _import_module(name: str, key: str) -> ModuleType:
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name and name.startswith(e.name):  # the module itself (or its package), not one it imports
            raise PluginError(f"{key}: cannot import module {name!r} ({e}); install it, put its folder on "
                              f"PYTHONPATH, or give a file: path/to/{name.rsplit('.', 1)[-1]}.py:function") from None
        raise _failed(name, key, e) from e
    except Exception as e:  # the user's module raised as it loaded
        raise _failed(name, key, e) from e


def _import_file(path: str, key: str) -> ModuleType:
    file = Path(path).expanduser().resolve()
    if not file.is_file():
        raise PluginError(f"{key}: file {path!r} not found (relative paths start at {Path.cwd()})")
    # One module per file, under a name of its own, so two files called rewards.py do not collide.
    name = f"rlsys_user_{file.stem}_{hashlib.sha256(str(file).encode()).hexdigest()[:8]}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, file)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # before it runs, as import does: pickling by value looks it up there
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        del sys.modules[name]
        raise _failed(path, key, e) from e
    return module


def _failed(where: str, key: str, error: Exception) -> PluginError:
    return PluginError(f"{key}: importing {where!r} raised {type(error).__name__}: {error}")
