"""Name -> class registries, so that config selects an algorithm by name (docs/design.md principle 3)."""
from __future__ import annotations

import difflib
from typing import Callable, Generic, TypeVar

T = TypeVar("T")


class UnknownName(KeyError, ValueError):
    """A name no entry of a registry has, most often a typo in a config: rlsys/startup.py reports it as the
    field's error (a ValueError) before anything starts; code that looks a name up may catch the KeyError."""

    def __str__(self) -> str:  # KeyError's would quote the message
        return self.args[0]


class Registry(Generic[T]):
    def __init__(self, kind: str):
        self.kind = kind
        self._items: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        def add(item: T) -> T:
            if name in self._items:
                raise ValueError(f"{self.kind} {name!r} is registered twice")
            self._items[name] = item
            return item
        return add

    def get(self, name: str) -> T:
        if name not in self._items:
            close = difflib.get_close_matches(name, self._items, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise UnknownName(f"unknown {self.kind} {name!r}; {hint}choose one of: {', '.join(sorted(self._items))}")
        return self._items[name]

    def names(self) -> list[str]:
        return sorted(self._items)

    def __contains__(self, name: str) -> bool:
        return name in self._items
