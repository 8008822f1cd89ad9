"""The Makefile has every target it declares and every target the docs tell a user to run."""
import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
MAKEFILE = (REPO / "Makefile").read_text()


def rules() -> set[str]:
    return set(re.findall(r"^([\w-]+)\s*:", MAKEFILE, re.M))


def test_every_phony_target_has_a_rule():
    phony = {name for line in re.findall(r"^\.PHONY\s*:(.*)$", MAKEFILE, re.M) for name in line.split()}
    assert phony and phony <= rules(), f".PHONY names targets without a rule: {sorted(phony - rules())}"


def test_every_make_command_in_the_docs_names_a_target():
    docs = [REPO / "Makefile", REPO / "README.md", *REPO.glob("docs/**/*.md"), *REPO.glob("*/README.md")]
    named = {(path.relative_to(REPO).as_posix(), target) for path in docs if path.is_file()
             for target in re.findall(r"`make ([\w-]+)", path.read_text())}
    missing = sorted((where, t) for where, t in named if t not in rules())
    assert named and not missing, f"`make X` in the docs without a rule X: {missing}"


def test_a_hanging_test_fails_at_the_suites_time_limit_instead_of_hanging(pytestconfig, tmp_path):
    """`make test` sets a per-test limit (pyproject.toml); a test that waits forever fails with a stack dump."""
    import subprocess
    import sys

    assert float(pytestconfig.getini("timeout")) > 0
    (tmp_path / "test_hang.py").write_text("import time\n\ndef test_waits_forever():\n    time.sleep(3600)\n")
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-o", "timeout=2", "-p", "no:cacheprovider",
                           str(tmp_path / "test_hang.py")], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and "Timeout (>2.0s) from pytest-timeout" in done.stdout, done.stdout[-2000:]


def test_setup_with_new_extras_installs_them_into_an_existing_venv(tmp_path):
    """Each set of extras has its stamp: `make setup EXTRAS=dev,logging` after `make setup` is not "nothing to do"."""
    import subprocess

    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text("")  # make -n runs nothing: the venv only has to be there
    (venv / ".installed-dev").touch()  # `make setup` done, after the lock and pyproject.toml changed last

    def plan(extras: str) -> str:
        return subprocess.run(["make", "-n", "-C", str(REPO), "setup", f"VENV={venv}", f"EXTRAS={extras}"],
                              capture_output=True, text=True, check=True).stdout
    assert "pip install" not in plan("dev")
    assert '-e ".[dev,logging]"' in plan("dev,logging")
