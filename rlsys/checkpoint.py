"""Crash-safe checkpoint folders: written under a temporary name, then renamed in one step.

A crash or SIGKILL mid-write leaves at most a `*.tmp` folder behind, which is ignored and removed
later; `latest()` only ever returns a folder that was completely written. Contents are safetensors
and JSON only: nothing is unpickled when loading.
"""
from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Callable

from rlsys.errors import UserError

STATE_FILE = "controller.json"
RUN_RECORDS = ("metrics.jsonl", "timeline.jsonl", "checkpoints", "export")  # what a started run leaves


def _fsync_tree(path: Path) -> None:
    for p in sorted(path.rglob("*")) + [path]:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def open_to_umask(folder: Path) -> None:
    """Every file under `folder` given the mode the umask leaves (0644 under 022), as a file written with open()
    has: safetensors writes its files 0600, which would keep an exported model or a checkpoint from the others
    who share a run folder."""
    mask = os.umask(0)
    os.umask(mask)
    for p in folder.rglob("*"):
        if p.is_file() and p.stat().st_mode & 0o777 != 0o666 & ~mask:
            p.chmod(0o666 & ~mask)


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
        open_to_umask(tmp)
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

    def latest_step(self) -> int | None:
        """The step of the latest complete checkpoint; None where there is none."""
        latest = self.latest()
        return None if latest is None else self.read_state(latest)["step"]

    def _prune(self) -> None:
        for old in self.completed()[: -self.keep_last]:
            shutil.rmtree(old, ignore_errors=True)
        for tmp in self.root.glob("step_*.tmp"):
            shutil.rmtree(tmp, ignore_errors=True)


def finished_step(run_dir: str | Path, total_steps: int) -> int | None:
    """The step a run in `run_dir` finished at, if it trained `total_steps` or more and exported its model;
    None for a run that has steps to go (or was stopped before its export)."""
    run_dir = Path(run_dir)
    step = CheckpointManager(run_dir / "checkpoints").latest_step()
    if step is None or not (run_dir / "export" / "config.json").exists():
        return None
    return step if step >= total_steps else None


def claim_run_dir(run_dir: str | Path, resume: bool, overwrite: bool = False) -> None:
    """Refuse what would mix two runs in one folder, before anything starts: a second run appended to the
    first's metrics, its checkpoints pruned as older than the first's. `overwrite` moves the old run aside."""
    run_dir = Path(run_dir)
    latest = CheckpointManager(run_dir / "checkpoints").latest_step()
    if resume:
        if latest is None:
            raise UserError(f"--resume: no complete checkpoint under {run_dir / 'checkpoints'}; start the run "
                            f"without --resume (or set output_dir to the run to continue)")
        return
    used = [name for name in RUN_RECORDS if (run_dir / name).exists()]
    if not used:
        return
    if overwrite:
        aside = run_dir.with_name(f"{run_dir.name}.replaced-{time.strftime('%Y%m%d-%H%M%S')}")
        os.replace(run_dir, aside)
        print(f"moved the earlier run in {run_dir} to {aside}")
        return
    last = f"its last checkpoint is step {latest}" if latest is not None else "no checkpoint"
    raise UserError(f"output_dir {run_dir} holds a run ({', '.join(used)}; {last}). Continue it with --resume, "
                    f"choose another output_dir, or add --overwrite to move it aside and start again")
