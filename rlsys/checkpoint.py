"""Crash-safe checkpoint folders: written under a temporary name, then renamed in one step.

A crash or SIGKILL mid-write leaves at most a `*.tmp` folder behind, which is ignored and removed
later; `latest()` only ever returns a folder that was completely written. Contents are safetensors
and JSON only: nothing is unpickled when loading.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Callable

STATE_FILE = "controller.json"


def _fsync_tree(path: Path) -> None:
    for p in sorted(path.rglob("*")) + [path]:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def write_json_atomic(path: Path, data) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)


class CheckpointManager:
    def __init__(self, root: str | Path, keep_last: int = 2):
        self.root = Path(root)
        self.keep_last = keep_last

    def save(self, step: int, write: Callable[[Path], None]) -> Path:
        """`write(folder)` fills a fresh folder; it becomes `step_NNNNNN` only once complete."""
        self.root.mkdir(parents=True, exist_ok=True)
        final = self.root / f"step_{step:06d}"
        tmp = self.root / f"step_{step:06d}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        write(tmp)
        _fsync_tree(tmp)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        self._prune()
        return final

    def completed(self) -> list[Path]:
        if not self.root.exists():
            return []
        return sorted(p for p in self.root.glob("step_*")
                      if p.is_dir() and not p.name.endswith(".tmp") and (p / STATE_FILE).exists())

    def latest(self) -> Path | None:
        done = self.completed()
        return done[-1] if done else None

    @staticmethod
    def read_state(folder: Path) -> dict:
        """The controller's state saved in a checkpoint folder."""
        return json.loads((folder / STATE_FILE).read_text())

    def _prune(self) -> None:
        for old in self.completed()[: -self.keep_last]:
            shutil.rmtree(old, ignore_errors=True)
        for tmp in self.root.glob("step_*.tmp"):
            shutil.rmtree(tmp, ignore_errors=True)
