"""`rlsys train` with no config finds its default from an installed wheel, not only from the repository."""
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# What `rlsys train trainer.total_steps=2` loads: the default config and the override.
LOAD_DEFAULT = """
from rlsys.config import split_config_and_overrides
from rlsys.startup import load_config
path, overrides = split_config_and_overrides(["trainer.total_steps=2"])
cfg = load_config(path, overrides)
print(path, cfg.trainer.total_steps, cfg.trainer.micro_batch_tokens)
"""


def test_an_installed_wheel_finds_the_default_config_from_any_directory(tmp_path):
    source = tmp_path / "source"  # a copy, so the build leaves nothing in the repository
    shutil.copytree(REPO / "rlsys", source / "rlsys", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(tmp_path / "dist"), str(source)], check=True, cwd=tmp_path)
    site = tmp_path / "site"  # the wheel unpacked, as pip installs it: no configs/ folder beside rlsys/
    with zipfile.ZipFile(next((tmp_path / "dist").glob("rlsys-*.whl"))) as wheel:
        wheel.extractall(site)
    shutil.rmtree(source)

    env = {**os.environ, "PYTHONPATH": str(site)}
    out = subprocess.run([sys.executable, "-c", LOAD_DEFAULT], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    path, steps, micro_batch_tokens = out.stdout.split()
    assert Path(path) == site / "rlsys" / "configs" / "tiny.yaml"
    assert (steps, micro_batch_tokens) == ("2", "512")  # 512 is tiny.yaml's, not the Config default


def test_the_repository_config_is_the_packaged_one():
    assert (REPO / "configs" / "tiny.yaml").resolve() == (REPO / "rlsys" / "configs" / "tiny.yaml").resolve()
