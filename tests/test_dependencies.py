"""Every third-party package the code imports is declared, in the right extra, and the lock pins what the
ranges admit: a fresh machine installs exactly what CI tested (requirements/lock-cpu.txt)."""
from __future__ import annotations

import ast
import importlib.metadata as metadata
import re
import sys
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parent.parent
LOCK = ROOT / "requirements" / "lock-cpu.txt"
# Imported modules whose distribution `make test` does not install (extras gpu, bench, logging), so the
# environment cannot name it: module -> distribution.
NOT_INSTALLED_BY_MAKE_TEST = {"vllm": "vllm", "wandb": "wandb", "trl": "trl", "datasets": "datasets"}
# Packages a library loads by itself on a path rlsys uses, so no import of ours names them:
# transformers reads GGUF weights only when both gguf and accelerate are installed, and builds a ZeRO-3
# model under deepspeed.zero.Init (HfDeepSpeedConfig) only with accelerate.
NEEDED_BESIDE = {"gguf": {"accelerate"}, "deepspeed": {"accelerate"}}


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def declared() -> dict[str, set[str]]:
    """{extra ("" for the core): canonical distribution names}."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    groups = {"": project["dependencies"], **project["optional-dependencies"]}
    return {extra: {canonical(Requirement(r).name) for r in reqs} for extra, reqs in groups.items()}


def imported_modules(folder: str) -> set[str]:
    """Top-level names of the absolute imports in every .py file under `folder`."""
    names = set()
    for path in (ROOT / folder).rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
    return names


def own_modules(folder: str) -> set[str]:
    """Modules and packages that live in the repository itself (rlsys, test helpers, benchmark scripts and
    benchmarks/doc_tables)."""
    here = ROOT / folder
    return {"rlsys", "tests", "benchmarks"} | {p.stem for p in here.rglob("*.py")} | {
        p.parent.name for p in here.rglob("__init__.py")}


def third_party(folder: str) -> dict[str, str]:
    """{module: canonical distribution} for the third-party imports under `folder`."""
    providers = metadata.packages_distributions()
    found = {}
    for module in imported_modules(folder) - own_modules(folder) - set(sys.stdlib_module_names):
        dists = providers.get(module) or [NOT_INSTALLED_BY_MAKE_TEST.get(module, "")]
        assert dists[0], (f"{folder}/ imports {module!r}, which no installed distribution provides: "
                          "install it, or name its distribution in NOT_INSTALLED_BY_MAKE_TEST")
        found[module] = canonical(dists[0])
    return found


def test_every_import_of_the_code_is_declared():
    extras = declared()
    anywhere = set().union(*extras.values())
    for folder in ("rlsys", "benchmarks"):
        missing = {m: d for m, d in third_party(folder).items() if d not in anywhere}
        assert not missing, f"{folder}/ imports packages that pyproject.toml does not declare: {missing}"


def test_every_import_of_the_tests_is_installed_by_make_test():
    """`make test` installs the core and the `dev` extra: what the tests import must be among them."""
    extras = declared()
    installed_by_make = extras[""] | extras["dev"]
    missing = {m: d for m, d in third_party("tests").items()
               if d not in installed_by_make and d not in NOT_INSTALLED_BY_MAKE_TEST.values()}
    assert not missing, f"tests/ import packages outside the core and the dev extra: {missing}"


def test_packages_needed_beside_others_are_declared_with_them():
    """In the same extra or in the core, which every extra installs."""
    extras = declared()
    for extra, names in extras.items():
        for package, companions in NEEDED_BESIDE.items():
            if package in names:
                missing = companions - names - extras[""]
                assert not missing, (f"extra {extra or '(core)'!r} declares {package} but not "
                                     f"{sorted(missing)}, which it needs")


def locked() -> dict[str, Version]:
    pins = {}
    for number, line in enumerate(LOCK.read_text().splitlines(), 1):
        if line.strip() and not line.startswith("#"):
            name, sep, version = line.partition("==")
            assert sep, f"{LOCK.name}, line {number}: {line!r} is not an exact pin (name==version)"
            pins[canonical(name)] = Version(version)
    return pins


def test_the_lock_pins_every_declared_package_within_its_range():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    pins = locked()
    groups = {"": project["dependencies"], **project["optional-dependencies"]}
    for extra in ("", "dev", "real", "bench"):  # what the CPU machine installs; gpu and logging are not locked
        for text in groups[extra]:
            req = Requirement(text)
            name = canonical(req.name)
            assert name in pins, f"{LOCK.name} does not pin {name} (pyproject.toml, extra {extra or '(core)'!r})"
            assert req.specifier.contains(pins[name], prereleases=True), (
                f"{LOCK.name} pins {name}=={pins[name]}, outside pyproject.toml's {text!r}")


def test_the_environment_matches_the_lock():
    """What `make test` runs in is what the lock says: a drifted environment would hide a broken lock."""
    pins = locked()
    for name in ("torch", "transformers", "ray", "deepspeed", "accelerate", "gguf"):
        installed = Version(metadata.version(name))
        assert Version(installed.base_version) == pins[name], (
            f"{name} {installed} is installed but {LOCK.name} pins {pins[name]}: run `make setup`")
