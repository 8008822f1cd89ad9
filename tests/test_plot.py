"""The accuracy plots (`progress.png`, the bench's `accuracy_vs_time.png`) draw each eval's standard error."""
import json

import pytest
from matplotlib.container import ErrorbarContainer
from matplotlib.figure import Figure

from rlsys.bench import plot_bench
from rlsys.logger import read_jsonl
from rlsys.plot import plot_progress

EVALS = [{"step": 0, "time_s": 0.0, "eval/accuracy": 0.25, "eval/accuracy_se": 0.05},
         {"step": 1, "time_s": 1.5, "reward/mean": 0.5},
         {"step": 2, "time_s": 3.0, "eval/accuracy": 0.5, "eval/accuracy_se": 0.1}]


@pytest.fixture
def saved(monkeypatch):
    """The figures the plots save, by file name (savefig still writes them)."""
    figures, save = {}, Figure.savefig

    def keep(fig, path, *args, **kwargs):
        figures[path.name] = fig
        return save(fig, path, *args, **kwargs)
    monkeypatch.setattr(Figure, "savefig", keep)
    return figures


def error_bars(ax) -> list[list[float]]:
    """Per curve, each point's x, low and high end as drawn, one after the other."""
    curves = [c for c in ax.containers if isinstance(c, ErrorbarContainer)]
    return [[v for seg in c.lines[2][0].get_segments() for v in (seg[0][0], seg[0][1], seg[1][1])] for c in curves]


def test_progress_draws_each_evals_standard_error(tmp_path, saved):
    assert plot_progress(EVALS, tmp_path / "progress.png").exists()
    [curve] = error_bars(saved["progress.png"].axes[0])
    assert curve == pytest.approx([0.0, 0.2, 0.3, 3.0, 0.4, 0.6])


def test_the_bench_accuracy_plot_draws_each_runs_standard_error(tmp_path, saved):
    for name, shift in [("sync", 0.0), ("async", 0.1)]:
        run = tmp_path / f"{name}-r0"
        run.mkdir()
        rows = [dict(r, **{"eval/accuracy": r["eval/accuracy"] + shift}) if "eval/accuracy" in r else r for r in EVALS]
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        (run / "timeline.jsonl").write_text(json.dumps({"step": 1, "worker": 0, "slot": 0, "start": 0.0, "end": 1.0})
                                            + "\n")
    report = {"results": {name: {"repeats": 1, "bubble_ratio": 0.1} for name in ("sync", "async")},
              "workload": {"target_accuracy": 0.5}}
    plot_bench(report, tmp_path)
    sync, async_ = error_bars(saved["accuracy_vs_time.png"].axes[0])
    assert sync == pytest.approx([0.0, 0.2, 0.3, 3.0, 0.4, 0.6])
    assert async_ == pytest.approx([0.0, 0.3, 0.4, 3.0, 0.5, 0.7])


def test_the_bench_plots_skip_the_timeline_of_a_preset_whose_runs_are_under_another_out_dir(tmp_path, saved):
    run = tmp_path / "tail-r0"  # "sync" was kept by --top-up from a file whose runs are elsewhere
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in EVALS))
    (run / "timeline.jsonl").write_text(json.dumps({"step": 1, "worker": 0, "slot": 0, "start": 0.0, "end": 1.0}) + "\n")
    report = {"results": {name: {"repeats": 1, "bubble_ratio": 0.1} for name in ("sync", "tail")},
              "workload": {"target_accuracy": 0.5}}
    plot_bench(report, tmp_path)
    [ax] = saved["timelines.png"].axes
    assert ax.get_title().startswith("tail: steps 1-1")


def test_the_timeline_has_a_legend_and_draws_requests_at_their_time_in_the_run(tmp_path, saved):
    from rlsys.plot import plot_run

    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in EVALS))
    rows = [{"step": 1, "worker": 0, "slot": 0, "start": 10.0, "end": 12.0},
            {"step": 2, "worker": 0, "slot": 1, "start": 20.0, "end": 21.0, "finish_reason": "abort"}]
    (tmp_path / "timeline.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    plot_run(tmp_path, last_steps=4)
    [ax] = saved["timeline.png"].axes
    assert sorted(bar.get_x() for bar in ax.patches) == [10.0, 20.0]  # not shifted to start at 0
    assert ax.get_xlabel() == "training wall time (s)"  # the metrics' clock, as progress.png's
    legend = ax.get_legend()
    assert [t.get_text() for t in legend.get_texts()] == ["step 1", "step 2", "aborted"]
    assert legend.get_window_extent().x0 >= ax.get_window_extent().x1  # beside the bars, not on them


@pytest.mark.slow
def test_a_runs_timeline_is_on_its_training_clock(two_step_run):
    """timeline.png's axis is the metrics' clock, which leaves evaluations and checkpoints out: every request of a
    step ends by the step's time_s, and step 1's first starts sooner than the eval before it lasted (its requests'
    times counted that eval, and the axis said wall)."""
    rows = read_jsonl(two_step_run / "metrics.jsonl")
    metrics = {r["step"]: r for r in rows if "timing/train_s" in r}
    [first_eval] = [r for r in rows if r["step"] == 0 and "timing/eval_s" in r]
    requests = read_jsonl(two_step_run / "timeline.jsonl")
    assert metrics and requests
    for r in requests:
        assert 0 <= r["start"] <= r["end"] <= metrics[r["step"]]["time_s"] + 1e-3, (r, metrics[r["step"]]["time_s"])
    assert min(r["start"] for r in requests if r["step"] == 1) < first_eval["timing/eval_s"]


def test_the_bench_accuracy_plot_labels_its_target_line(tmp_path, saved):
    run = tmp_path / "sync-r0"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in EVALS))
    report = {"results": {"sync": {"repeats": 1, "bubble_ratio": 0.1}}, "workload": {"target_accuracy": 0.5}}
    plot_bench(report, tmp_path)
    [ax, *_] = saved["accuracy_vs_time.png"].axes
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["target accuracy 0.500", "sync"]
