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


def test_a_resumed_runs_bar_counts_its_rate_from_the_resumed_step_and_says_so_on_its_own_line(tmp_path, capsys):
    """It showed "38 it/s, ETA 00:01" after a resume at step 6 of 10 (six steps in a second), the message over it."""
    import re
    import time

    log = RunLogger(tmp_path, LoggingConfig(), total_steps=10)
    log.resumed(6, "resumed from step_000006 at step 6")
    time.sleep(0.5)
    log.write(7, 1.0, {"reward/mean": 0.5})
    log.close()
    out, err = capsys.readouterr()
    assert out == "resumed from step_000006 at step 6\n"  # a line of its own, above the bar
    bar = err.replace("\r", "\n").strip().splitlines()[-1]
    assert " 7/10 " in bar, bar
    per_s = re.search(r"([\d.]+)(it/s|s/it)", bar)
    rate = float(per_s[1]) if per_s[2] == "it/s" else 1 / float(per_s[1])
    assert rate <= 1 / 0.5, bar  # one step in half a second at least, not seven
