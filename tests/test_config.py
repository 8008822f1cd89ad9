import pytest

from rlsys.cli import main
from rlsys.config import DEFAULT_CONFIG, ConfigError, ControlConfig, parse_overrides
from rlsys.startup import load_config


def test_default_config_loads_and_overrides_apply():
    cfg = load_config(None, ["trainer.total_steps=2", "output_dir=/tmp/run", "rollout.temperature=0.5"])
    assert cfg.trainer.total_steps == 2 and cfg.output_dir == "/tmp/run" and cfg.rollout.temperature == 0.5
    assert load_config(DEFAULT_CONFIG).control.scheduler == "sync"


def test_unknown_key_names_the_dotted_field_and_line(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("trainer:\n  total_steps: 3\n  lrr: 0.1\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert "trainer.lrr: unknown key" in str(err.value)
    assert f"{path}, line 3" in str(err.value)


def test_wrong_type_from_override_is_named():
    with pytest.raises(ConfigError) as err:
        load_config(None, ["control.group_size=many"])
    assert "control.group_size" in str(err.value) and "command-line override" in str(err.value)


def test_out_of_range_and_cross_field_checks():
    with pytest.raises(ConfigError, match="rollout.slots"):
        load_config(None, ["rollout.slots=0"])
    with pytest.raises(ConfigError, match="num_heads"):
        load_config(None, ["model.num_heads=3"])


def test_bad_override_syntax_and_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="key=value"):
        parse_overrides(["trainer.total_steps"])
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.yaml")
    (tmp_path / "list.yaml").write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(tmp_path / "list.yaml")


@pytest.mark.parametrize("dynamic", [False, True])
def test_a_group_of_one_is_refused_as_the_config_loads(dynamic):
    """A group of one has no advantage (nothing learned); with dynamic sampling it would even be dropped forever."""
    with pytest.raises(ConfigError) as refused:
        load_config(None, ["control.group_size=1", f"control.dynamic_sampling.enabled={dynamic}"])
    assert ("control.group_size: Value error, must be at least 2: a group of one sample has no advantage"
            in str(refused.value)) and "[command-line override]" in str(refused.value)
    assert load_config(None, ["control.group_size=2"]).control.group_size == 2


def test_staged_answer_caps_apply_from_their_step_and_are_checked(tmp_path):
    cfg = load_config(None, ["rollout.max_new_tokens=48", "rollout.max_new_tokens_stages=[[2, 16], [5, 32]]"])
    assert [cfg.rollout.max_new_tokens_at(s) for s in range(7)] == [48, 48, 16, 16, 16, 32, 32]
    with pytest.raises(ConfigError, match=r"max_new_tokens_stages: steps must be distinct, >= 0 and ascending"):
        load_config(None, ["rollout.max_new_tokens_stages=[[3, 8], [1, 16]]"])
    path = tmp_path / "stages.yaml"
    path.write_text("rollout:\n  max_new_tokens: 48\n  max_new_tokens_stages: [[0, 16], [4, 64]]\n")
    with pytest.raises(ConfigError) as refused:
        load_config(path)
    assert "the cap from step 4 (64) must be between 1 and rollout.max_new_tokens (48)" in str(refused.value)
    assert str(path) in str(refused.value)


@pytest.mark.parametrize("scheduler", ["sync", "sorted", "async"])
def test_streamed_training_under_a_scheduler_that_streams_nothing_is_refused_naming_both_fields(scheduler, capsys):
    """Only tail hands its groups to the trainer as they complete (Accumulate): under another scheduler
    trainer.streamed would change nothing, while its user believes the step streams."""
    overrides = [f"control.scheduler={scheduler}", "trainer.streamed=true", "trainer.loss=decoupled_ppo"]
    assert main(["check", *overrides]) == 2
    err = capsys.readouterr().err
    assert (f"trainer.streamed=true needs control.scheduler=tail (got control.scheduler={scheduler})" in err
            and "set control.scheduler=tail or trainer.streamed=false" in err), err
    assert "command-line override: trainer.streamed, control.scheduler" in err and "Traceback" not in err
    assert load_config(None, overrides[1:] + ["control.scheduler=tail"]).trainer.streamed
