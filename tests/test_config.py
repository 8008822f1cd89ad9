import pytest

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


def test_dynamic_sampling_refuses_groups_of_one_instead_of_hanging():
    """Every group of one sample has equal rewards, so dynamic sampling would drop them all, forever."""
    with pytest.raises(ValueError, match="group size of at least 2"):
        ControlConfig(group_size=1, dynamic_sampling={"enabled": True})
    ControlConfig(group_size=1)  # without dynamic sampling a group of one is allowed
