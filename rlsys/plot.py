"""`rlsys plot RUN_DIR`: accuracy and reward against wall time, and the rollout timeline as a Gantt
chart in which the bubbles (idle slots) are the white gaps."""
from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

from rlsys.errors import UserError  # noqa: E402
from rlsys.logger import read_jsonl  # noqa: E402


def clock_name(rows: list[dict]) -> str:
    """What the run's times are: wall seconds, or emulated ones (`emulate`) with the GPU and model they follow."""
    emulated = next((r["emulate/label"] for r in rows if "emulate/label" in r), None)
    return f"{emulated} time (s)" if emulated else "training wall time (s)"


def draw_accuracy(ax, rows: list[dict], **style):
    """Each eval's accuracy against time, with its standard error (eval/accuracy_se) as an error bar, so a reader
    sees which gaps between points or curves are beyond the eval's own noise."""
    evals = [r for r in rows if "eval/accuracy" in r]
    return ax.errorbar([r["time_s"] for r in evals], [r["eval/accuracy"] for r in evals],
                       yerr=[r.get("eval/accuracy_se", 0.0) for r in evals], fmt="o-", capsize=3, **style)


def plot_progress(rows: list[dict], out: Path, label: str = "") -> Path:
    fig, (acc_ax, rew_ax) = plt.subplots(1, 2, figsize=(11, 4))
    clock = clock_name(rows)
    draw_accuracy(acc_ax, rows, label=label or None)
    acc_ax.set(xlabel=clock, ylabel="eval accuracy (± standard error)", title="Eval accuracy")
    steps = [r for r in rows if "reward/mean" in r]
    rew_ax.plot([r["time_s"] for r in steps], [r["reward/mean"] for r in steps], ".-")
    rew_ax.set(xlabel=clock, ylabel="mean reward", title="Training reward")
    for ax in (acc_ax, rew_ax):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def draw_timeline(ax, rows: list[dict], title: str = "", clock: str = "seconds") -> None:
    """One row per engine slot; bars are requests at their times in the run, coloured by step, aborted ones hatched;
    a legend names the steps' colours and the hatch."""
    if not rows:
        ax.set_title(f"{title} (no requests)")
        return
    slots = max(r["slot"] for r in rows) + 1
    colors = plt.get_cmap("tab10")
    for r in rows:
        lane = r["worker"] * slots + r["slot"]
        aborted = r.get("finish_reason") == "abort"
        ax.barh(lane, r["end"] - r["start"], left=r["start"], height=0.8,
                color=colors(r["step"] % 10), hatch="//" if aborted else None, alpha=0.5 if aborted else 0.9)
    steps = sorted({r["step"] for r in rows})
    legend = [Patch(color=colors(step % 10), label=f"step {step}") for step in steps]
    if any(r.get("finish_reason") == "abort" for r in rows):
        legend.append(Patch(facecolor="white", edgecolor="grey", hatch="//", label="aborted"))
    # beside the axes: inside them it covered the last step's bars, at the right end of the top lanes
    ax.legend(handles=legend, loc="upper left", bbox_to_anchor=(1.01, 1), borderaxespad=0, fontsize="small")
    ax.set(xlabel=clock, ylabel="engine slot", title=title or "Rollout timeline (gaps are bubbles)")
    ax.invert_yaxis()


def plot_timeline(rows: list[dict], out: Path, last_steps: int = 4, clock: str = "seconds") -> Path:
    steps = sorted({r["step"] for r in rows})[-last_steps:]
    rows = [r for r in rows if r["step"] in steps]
    fig, ax = plt.subplots(figsize=(12, 5))
    draw_timeline(ax, rows, f"Rollout timeline, steps {steps[0]}-{steps[-1]}" if steps else "", clock)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def plot_run(run_dir: str | Path, last_steps: int = 4) -> list[Path]:
    run_dir = Path(run_dir)
    if not (run_dir / "metrics.jsonl").exists():
        raise UserError(f"{run_dir} has no metrics.jsonl: give a run folder (output_dir of `rlsys train`) that "
                        "has trained or evaluated")
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    out = [plot_progress(metrics, run_dir / "progress.png")]
    timeline = read_jsonl(run_dir / "timeline.jsonl")
    if timeline:
        out.append(plot_timeline(timeline, run_dir / "timeline.png", last_steps, clock_name(metrics)))
    return out
