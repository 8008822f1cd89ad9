"""Run output: one JSON line per step in metrics.jsonl, the request timeline, a progress bar, and
TensorBoard / wandb when asked for."""
from __future__ import annotations

import json
import threading
import time
from contextlib import contextmanager
from pathlib import Path

from rlsys.config import LoggingConfig

PROGRESS_KEYS = {"eval/accuracy": "acc", "reward/mean": "reward", "response_length/mean": "len",
                 "rollout/bubble_ratio": "bubble", "timing/step_s": "step_s"}


def read_jsonl(path: Path) -> list[dict]:
    """The rows of a run's metrics.jsonl or timeline.jsonl; none if the file is not there (yet)."""
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def progress_format(clock: str) -> str:
    """The bar's layout: tqdm's own times are wall seconds, so they say so beside the run's step time when that
    is on another clock (an emulated GPU's)."""
    wall = "" if clock == "wall" else "wall "
    return ("{desc}: {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} [" + wall
            + "{elapsed}<{remaining}, {rate_fmt}]{postfix}")


LINE_EVERY_S = 10.0  # without a bar, a run's step line at most this often


@contextmanager
def waiting(what, first: float = 5.0, every: float = 10.0, say=None):
    """A wait with nothing of its own to show (Ray starting, actors loading a model) is not spent in silence:
    past `first` seconds a line says what it waits for, then one every `every` seconds, and one when it ends.
    A short wait prints nothing. `what`: the text, or a function that gives it as the wait goes on (its progress);
    `say`: where the lines go (print, or above a progress bar: RunLogger.say)."""
    t0 = time.monotonic()
    done = threading.Event()
    text = what if callable(what) else lambda: what
    say = say or (lambda line: print(line, flush=True))

    def tick() -> None:
        pause = first
        while not done.wait(pause):
            say(f"{text()}: {time.monotonic() - t0:.0f} s so far")
            pause = every
    ticker = threading.Thread(target=tick, name="waiting", daemon=True)
    ticker.start()
    try:
        yield
    finally:
        done.set()
        ticker.join()
        if time.monotonic() - t0 >= first:
            say(f"{text()}: done in {time.monotonic() - t0:.0f} s")


class RunLogger:
    def __init__(self, run_dir: Path, cfg: LoggingConfig, total_steps: int, clock: str = "wall"):
        """`clock`: what the metrics' times are, "wall" or "emulated <gpu>/<model>" (emulate.clock_label)."""
        self.run_dir = run_dir
        self.metrics_path = run_dir / "metrics.jsonl"
        self.timeline_path = run_dir / "timeline.jsonl"
        self.shown: dict[str, float] = {}
        self.names = dict(PROGRESS_KEYS)
        if clock != "wall":  # one label per clock: the step time is the emulated GPU's
            self.names["timing/step_s"] = f"step_s ({clock})"
        self.bar = self.tb = self.wandb = None
        self.total_steps = total_steps
        self.lined_at = time.monotonic()  # without a bar: when the last step line was printed
        if cfg.progress:
            from tqdm import tqdm
            self.bar = tqdm(total=total_steps, desc="rl steps", dynamic_ncols=True, bar_format=progress_format(clock))
        if cfg.tensorboard:
            from torch.utils.tensorboard import SummaryWriter
            self.tb = SummaryWriter(str(run_dir / "tensorboard"))
        if cfg.wandb:
            import wandb
            self.wandb = wandb.init(project=cfg.wandb_project, dir=str(run_dir), name=run_dir.name)

    def write(self, step: int, time_s: float, metrics: dict, final: bool = False) -> None:
        row = {"step": step, "time_s": round(time_s, 4), **metrics}
        if final:
            row["final"] = True
        with self.metrics_path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        numbers = {k: v for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        if self.tb:
            for k, v in numbers.items():
                self.tb.add_scalar(k, v, step)
        if self.wandb:
            self.wandb.log(numbers, step=step)
        self.shown.update({short: metrics[k] for k, short in self.names.items() if k in metrics})
        if self.bar:
            self.bar.n = step
            self.bar.set_postfix({k: f"{v:.3g}" for k, v in self.shown.items()}, refresh=True)
        elif time.monotonic() - self.lined_at >= LINE_EVERY_S or step == self.total_steps:
            # no bar (a bench's runs): a line now and then, so that a run's minutes do not pass in silence
            self.lined_at = time.monotonic()
            shown = ", ".join(f"{k} {v:.3g}" for k, v in self.shown.items())
            print(f"{self.run_dir.name}: step {step}/{self.total_steps}" + (f": {shown}" if shown else ""), flush=True)

    def timeline(self, rows: list[dict]) -> None:
        with self.timeline_path.open("a") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)

    def say(self, line: str) -> None:
        """A line above the bar, not over it."""
        if self.bar:
            self.bar.write(line)
        else:
            print(line, flush=True)

    def resumed(self, step: int, message: str) -> None:
        """On resume from the checkpoint of `step`: forget what the interrupted run logged after it, and say so
        (`message`) above the bar, not over it. The bar counts its rate and ETA from `step` on: the steps before
        it were not trained in this process's seconds."""
        for path in (self.metrics_path, self.timeline_path):
            if path.exists():
                rows = [line for line in path.read_text().splitlines()
                        if line and json.loads(line)["step"] <= step and not json.loads(line).get("final")]
                path.write_text("".join(r + "\n" for r in rows))
        if not self.bar:
            print(message)
            return
        self.bar.write(message)
        self.bar.reset()  # its clock starts now
        self.bar.n = self.bar.initial = self.bar.last_print_n = step
        self.bar.refresh()

    def close(self) -> None:
        if self.bar:
            self.bar.close()
        if self.tb:
            self.tb.close()
        if self.wandb:
            self.wandb.finish()
