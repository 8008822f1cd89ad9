"""The offline GPU bundle (benchmarks/gpu/): cheap checks that need neither the network nor a GPU. The bundle
itself is built and run by hand (benchmarks/gpu/build_bundle.py, then run.sh)."""
from __future__ import annotations

import base64
import hashlib
import importlib.util
import json
import re
import stat
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest
import yaml

from rlsys.config import ModelConfig
from rlsys.startup import load_config

ROOT = Path(__file__).resolve().parent.parent
GPU = ROOT / "benchmarks" / "gpu"
CONFIGS = ROOT / "configs" / "gpu"
CPU_LINE = "# On a machine without a GPU: "  # smoke.yaml's overrides, read by benchmarks/gpu/rehearse.sh too
CPU_OVERRIDES = next(line[len(CPU_LINE):].split() for line in (CONFIGS / "smoke.yaml").read_text().splitlines()
                     if line.startswith(CPU_LINE))

def load_module(name: str):
    spec = importlib.util.spec_from_file_location(name, GPU / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


build_bundle = load_module("build_bundle")


# --- configs -------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["smoke.yaml", "bench_0.5b.yaml"])
def test_gpu_configs_validate_as_one_gpu_colocated_cuda_runs(name):
    cfg = load_config(CONFIGS / name)
    assert (cfg.rollout.engine, cfg.rollout.device, cfg.trainer.dtype, cfg.trainer.zero_stage) == (
        "cpu", "cuda", "bf16", 2)
    assert (cfg.weights.transfer, cfg.cluster.layout, cfg.cluster.gpus_per_node) == ("cuda_ipc", "colocated", 1)


def test_smoke_config_runs_on_cpu_with_the_documented_overrides():
    cfg = load_config(CONFIGS / "smoke.yaml", CPU_OVERRIDES)
    assert cfg.trainer.dtype == "float32"
    assert (cfg.rollout.device, cfg.weights.transfer, cfg.cluster.gpus_per_node) == ("cpu", "object_store", 0)


def test_bench_model_is_a_half_billion_parameter_qwen2():
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    m = ModelConfig.model_validate(yaml.safe_load((CONFIGS / "bench_0.5b.yaml").read_text())["model"])
    config = Qwen2Config(vocab_size=259, hidden_size=m.hidden_size, num_hidden_layers=m.num_layers,
                         num_attention_heads=m.num_heads, num_key_value_heads=m.num_kv_heads,
                         intermediate_size=m.intermediate_size, tie_word_embeddings=True)
    with torch.device("meta"):  # shapes only: no memory, no init
        params = sum(p.numel() for p in Qwen2ForCausalLM(config).parameters())
    assert m.arch == "qwen2" and 0.4e9 < params < 0.6e9


# --- stripping Ray's wheel -----------------------------------------------------------------------
def record_line(name: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


FILES = {
    "ray/__init__.py": b"__version__ = '9.9.9'\n",
    "ray/core/src/ray/raylet/raylet": b"\x7fELF raylet",  # executable: must stay so
    "ray/jars/ray_dist.jar": b"jar" * 100,
    "ray/rllib/__init__.py": b"rllib",
    "ray/data/__init__.py": b"data",
    "ray/data_utils.py": b"kept: ray/data/ is a folder, not a prefix of every name",
    "ray/dashboard/head.py": b"kept: only the web UI's build goes",
    "ray/dashboard/client/build/index.html": b"<html>",
    "ray-9.9.9.dist-info/METADATA": b"Metadata-Version: 2.1\nName: ray\nVersion: 9.9.9\n",
    "ray-9.9.9.dist-info/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: false\nTag: py3-none-any\n",
}
EXECUTABLE = "ray/core/src/ray/raylet/raylet"


def make_wheel(path: Path) -> Path:
    record = "ray-9.9.9.dist-info/RECORD"
    lines = [record_line(name, data) for name, data in FILES.items()] + [f"{record},,"]
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        for name, data in FILES.items():
            info = zipfile.ZipInfo(name)
            info.external_attr = (stat.S_IFREG | (0o755 if name == EXECUTABLE else 0o644)) << 16
            zf.writestr(info, data, zipfile.ZIP_DEFLATED)
        zf.writestr(record, "\n".join(lines) + "\n")
    return path


def test_strip_wheel_removes_the_folders_and_their_record_lines(tmp_path):
    wheel = make_wheel(tmp_path / "ray-9.9.9-py3-none-any.whl")
    removed = build_bundle.strip_wheel(wheel, build_bundle.RAY_UNUSED)
    gone = {"ray/jars/ray_dist.jar", "ray/rllib/__init__.py", "ray/data/__init__.py",
            "ray/dashboard/client/build/index.html"}
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        record = zf.read("ray-9.9.9.dist-info/RECORD").decode().splitlines()
        kept = {name: zf.read(name) for name in names}
        mode = zf.getinfo(EXECUTABLE).external_attr >> 16
    assert removed == len(gone) and names == set(FILES) - gone | {"ray-9.9.9.dist-info/RECORD"}
    assert {name: FILES[name] for name in set(FILES) - gone} == {k: v for k, v in kept.items() if k in FILES}
    # RECORD lists every file left, each with its hash and size, and nothing else
    assert sorted(record) == sorted([record_line(n, FILES[n]) for n in set(FILES) - gone]
                                    + ["ray-9.9.9.dist-info/RECORD,,"])
    assert mode & stat.S_IXUSR


def test_stripped_wheel_installs_with_pip(tmp_path):
    wheel = make_wheel(tmp_path / "ray-9.9.9-py3-none-any.whl")
    build_bundle.strip_wheel(wheel, build_bundle.RAY_UNUSED)
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps", "--target",
                    str(target), str(wheel)], check=True)
    assert (target / "ray" / "data_utils.py").is_file() and not (target / "ray" / "jars").exists()
    assert (target / EXECUTABLE).stat().st_mode & stat.S_IXUSR


# --- pins ----------------------------------------------------------------------------------------
def test_lock_file_pins_win_over_the_builders_own(tmp_path):
    (tmp_path / "requirements").mkdir()
    (tmp_path / "requirements" / "lock-cpu.txt").write_text(
        "# a lock file\nray==2.61.1 ; python_version >= '3.10' \\\n    --hash=sha256:abc\n"
        "Pydantic_Core==2.51.0\ndeepspeed==0.19.9  # built without ops\nunrelated==1.0\n")
    wheels, deepspeed = build_bundle.pinned(tmp_path)
    assert (wheels["ray"], wheels["pydantic-core"], deepspeed) == ("2.61.1", "2.51.0", "0.19.9")
    assert wheels["click"] == build_bundle.WHEELS["click"] and "unrelated" not in wheels


# --- run.sh and its summary ----------------------------------------------------------------------
@pytest.mark.parametrize("script", ["run.sh", "rehearse.sh", "measure.sh"])
def test_scripts_are_valid_bash(script):
    subprocess.run(["bash", "-n", str(GPU / script)], check=True)


def test_rehearse_sh_reads_the_same_cpu_overrides_as_this_test():
    line = subprocess.run(["sed", "-n", "s/^# On a machine without a GPU: //p", str(CONFIGS / "smoke.yaml")],
                          capture_output=True, text=True, check=True).stdout
    assert "s/^# On a machine without a GPU: //p" in (GPU / "rehearse.sh").read_text()
    assert line.split() == CPU_OVERRIDES and "rollout.device=cpu" in CPU_OVERRIDES


def test_the_stored_rehearsal_ran_end_to_end_within_the_transfer_limit():
    record = json.loads((ROOT / "benchmarks" / "results" / "gpu_rehearsal_cpu.json").read_text())
    assert record["exit_status"] == 0 and record["overrides"] == CPU_OVERRIDES
    assert 0 < record["bundle_mib"] < 64 and record["summary"]["steps"] == load_config(CONFIGS / "smoke.yaml"
                                                                                         ).trainer.total_steps


def run_sh(bundle: Path, scratch: Path, *args: str) -> subprocess.CompletedProcess:
    args = args or (str(scratch.parent / "results"),)
    return subprocess.run(["bash", str(GPU / "run.sh"), str(bundle), *args], capture_output=True, text=True,
                          env={"PATH": "/usr/bin:/bin", "SCRATCH": str(scratch)})


def test_run_sh_takes_the_results_folder_as_an_argument(tmp_path):
    for args in [(), ("trainer.total_steps=2",)]:  # none, or an override where the folder belongs
        out = run_sh(tmp_path, tmp_path / "scratch", *args) if args else subprocess.run(
            ["bash", str(GPU / "run.sh"), str(tmp_path)], capture_output=True, text=True)
        assert out.returncode == 2 and "usage: benchmarks/gpu/run.sh BUNDLE_DIR RESULTS_DIR" in out.stderr
    assert not (tmp_path / "scratch").exists()


def test_run_sh_refuses_a_folder_without_wheels(tmp_path):
    out = run_sh(tmp_path, tmp_path / "scratch")
    assert out.returncode == 2 and f"no wheels in {tmp_path}" in out.stderr


def test_run_sh_refuses_wheels_that_do_not_match_their_checksums(tmp_path):
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    (bundle / "a-1.0-py3-none-any.whl").write_bytes(b"as built")
    build_bundle.describe(bundle, limit_mib=1)  # writes SHA256SUMS
    (bundle / "a-1.0-py3-none-any.whl").write_bytes(b"cut short")
    out = run_sh(bundle, tmp_path / "scratch")
    assert out.returncode == 2 and "do not match their SHA256SUMS" in out.stderr
    assert not (tmp_path / "scratch" / "site").exists()  # refused before pip ran
    assert not (tmp_path / "results").exists()


def test_summary_has_steps_step_times_and_peak_gpu_memory(tmp_path):
    rows = [{"step": 0, "time_s": 1.0, "eval/accuracy": 0.1},
            {"step": 1, "time_s": 3.0, "timing/step_s": 2.0, "timing/train_s": 0.5},
            {"step": 2, "time_s": 7.0, "timing/step_s": 4.0, "timing/train_s": 0.7},
            {"step": 2, "time_s": 8.0, "eval/accuracy": 0.3, "final": True}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "memory.csv").write_text("812\n20480\n1500\n")
    summary = load_module("summarize").summarize(tmp_path, tmp_path / "memory.csv")
    assert (summary["steps"], summary["step_s"], summary["median_step_s"]) == (2, [2.0, 4.0], 3.0)
    assert (summary["peak_gpu_memory_mib"], summary["final_eval_accuracy"], summary["training_clock_s"]) == (
        20480, 0.3, 8.0)
    assert load_module("summarize").summarize(tmp_path)["peak_gpu_memory_mib"] is None  # no GPU, no log


def measure_sh(tmp_path: Path, *phases: str, digest: str | None = None, **popen) -> subprocess.Popen:
    """measure.sh over a bundle of no wheels (counted as installed) whose RLSYS_SHA256 is `digest` (default:
    this checkout's), its phases' Python a stand-in that leaves a "raylet" behind, takes 3 s over a benchmark
    and fails: the harness is what is tested, not the benchmarks."""
    bundle, out, scratch = tmp_path / "bundle", tmp_path / "out", tmp_path / "scratch"
    bundle.mkdir(exist_ok=True)
    (bundle / "RLSYS_SHA256").write_text((digest or load_module("build_bundle").rlsys_digest(ROOT)) + "\n")
    (scratch / "site").mkdir(parents=True, exist_ok=True)  # the bundle counts as installed: no pip here
    python = tmp_path / "python"
    python.write_text('#!/bin/bash\ncase "$*" in *benchmarks/*) (exec -a raylet-of-a-phase sleep 120) &\n'
                      '  sleep 3 ;; esac\nexit 1\n')
    python.chmod(0o755)
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "PYTHON": str(python), "SCRATCH": str(scratch)}
    return subprocess.Popen(["bash", str(GPU / "measure.sh"), str(bundle), str(out), *phases], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen)


def test_measure_sh_runs_each_phase_under_its_limit_and_keeps_going(tmp_path):
    """A phase that passes its limit or fails is recorded, and the next phase still runs; the processes a phase
    leaves behind are ended, and no other Ray on the machine, one started while the phase runs included."""
    out = tmp_path / "out"
    others = [subprocess.Popen(["bash", "-c", "exec -a raylet-of-another-ray sleep 120"])]
    try:
        done = measure_sh(tmp_path, "engine:1", "live:60")
        deadline = time.monotonic() + 60
        while not (out / "live.log").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        others.append(subprocess.Popen(["bash", "-c", "exec -a raylet-started-meanwhile sleep 120"]))
        stdout, stderr = done.communicate(timeout=120)
        assert [p.poll() for p in others] == [None, None]  # still running
    finally:
        for p in others:
            p.kill()
    left = subprocess.run(["pgrep", "-f", "raylet-of-a-phase"], capture_output=True, text=True).stdout
    assert left == ""
    assert done.returncode == 0, stderr
    phases = (out / "phases.txt").read_text().splitlines()
    assert len(phases) == 2 and phases[0].startswith("engine: exit 124")  # cut at its 1 s
    assert phases[1].startswith("live: exit 1 ")  # ran to its end
    assert (out / "records.tgz").is_file() and (out / "engine.log").is_file() and (out / "live.log").is_file()


@pytest.mark.parametrize("phases, digest, message", [
    (["bogus"], None, "unknown phase bogus"),
    (["engine:300", "live:241"], None, "the phases' limits add up to 541 s, over MEASURE_BUDGET_S=540 s"),
    (["engine:10"], "0" * 64, "the bundle's rlsys"),
])
def test_measure_sh_refuses_before_anything_runs(tmp_path, phases, digest, message):
    """An unknown phase, limits past one lent command, a bundle built from other rlsys sources: refused at once."""
    done = measure_sh(tmp_path, *phases, digest=digest)
    _, stderr = done.communicate(timeout=60)
    assert done.returncode == 2 and message in stderr and not (tmp_path / "out").exists()


def test_the_plan_in_measure_sh_fits_its_commands():
    """The header's plan: each command within the budget, cuda_tests and the engine grid first."""
    script = (GPU / "measure.sh").read_text()
    plan = re.findall(r'^#   benchmarks/gpu/measure\.sh build/gpu_bundle "\$OUT" (.*)$', script, re.M)
    budget = int(re.search(r"MEASURE_BUDGET_S:-(\d+)", script).group(1))
    assert budget <= 600 - 60 and [p.split()[0].split(":")[0] for p in plan] == ["cuda_tests", "prepare"]
    assert all(sum(int(item.split(":")[1]) for item in command.split()) <= budget for command in plan)
    runs = [item.split(":")[0] for item in plan[1].split()]
    assert runs.index("prepare") < runs.index("sched_sync") < runs.index("sched_tail")  # built before it is read


def test_the_prepare_phase_builds_the_model_the_scheduler_runs_read():
    """prepare's overrides and each sched phase's give one model cache entry: a run after prepare builds nothing."""
    from rlsys.models import cache_key
    from rlsys.startup import load_config

    script = (GPU / "measure.sh").read_text()
    sched = re.search(r"^sched=\((.*)\)$", script, re.M).group(1).split()
    prepare = re.search(r'"\$bench" "\$\{sched\[@\]\}" (\S+) ', script).group(1)
    config = ROOT / "configs" / "gpu" / "bench_0.5b.yaml"
    built = cache_key(load_config(config, [*sched, prepare]))
    for name in ("sync", "tail"):
        own = re.search(rf'^phase_sched_{name}\(\) {{.*"\$\{{sched\[@\]\}}" (.*); }}$', script, re.M).group(1).split()
        assert cache_key(load_config(config, [*sched, *own])) == built


def test_the_bundles_rlsys_digest_is_the_one_measure_sh_computes():
    """build_bundle.py's digest of the sources against measure.sh's own pipeline, run in this checkout."""
    pipeline = re.search(r'^digest=\$\(cd "\$repo" && (.*)\)$', (GPU / "measure.sh").read_text(), re.M).group(1)
    shell = subprocess.run(pipeline, shell=True, cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert load_module("build_bundle").rlsys_digest(ROOT) == shell.strip() != ""


def test_every_schedule_of_the_bench_phase_is_a_valid_config():
    """measure.sh's bench phase runs each preset on configs/gpu/bench_0.5b.yaml with the sched phases' overrides and
    its own; a preset its config refuses would end the phase, and a lent GPU's window, at its start."""
    from rlsys.bench import preset_overrides

    script = (GPU / "measure.sh").read_text()
    sched = re.search(r"^sched=\((.*)\)$", script, re.M).group(1).split()
    own, presets = re.search(r'"\$\{sched\[@\]\}" (.*?) ?--presets (\S+)', script).groups()
    assert presets.split(",") == ["sync", "tail", "async", "sorted"]
    for preset in presets.split(","):
        cfg = load_config(str(CONFIGS / "bench_0.5b.yaml"), sched + own.split() + preset_overrides(preset))
        assert cfg.cluster.layout == "colocated" and cfg.trainer.total_steps == 3, preset
