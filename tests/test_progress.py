"""The progress bars a user watches: every time on them says which clock it is on."""
from rlsys.config import LoggingConfig
from rlsys.logger import RunLogger


def bar_text(tmp_path, capsys, clock: str) -> str:
    log = RunLogger(tmp_path, LoggingConfig(), total_steps=4, clock=clock)
    log.write(1, 2.0, {"timing/step_s": 12.5, "reward/mean": 0.5})
    log.close()
    return capsys.readouterr().err.replace("\r", "\n").strip().splitlines()[-1]


def test_an_emulated_runs_bar_labels_its_step_time_emulated_and_tqdms_times_wall(tmp_path, capsys):
    text = bar_text(tmp_path, capsys, "emulated h100/qwen2.5-7b")
    assert "step_s (emulated h100/qwen2.5-7b)=12.5" in text and "[wall 00:" in text, text


def test_a_wall_clock_runs_bar_has_one_clock_and_no_labels(tmp_path, capsys):
    text = bar_text(tmp_path, capsys, "wall")
    assert "step_s=12.5" in text and "wall" not in text and "emulated" not in text, text
