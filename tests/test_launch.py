"""Run configs in configs/ load and plan; the launch/ scripts' --dry-run prints what they would run.

A stand-in `ray` (and `sbatch`) first on PATH records any call, so the tests also show that a dry run
starts nothing.
"""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from rlsys.placement import plan_from_config
from rlsys.startup import load_config

ROOT = Path(__file__).resolve().parent.parent
RUN_CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))  # configs/sim/ holds simulator configs


@pytest.mark.parametrize("path", RUN_CONFIGS, ids=lambda p: p.name)
def test_every_run_config_loads(path):
    cfg = load_config(path)
    if cfg.rollout.engine == "vllm":  # the GPU workloads: a placement plan, bf16, files data
        plan = plan_from_config(cfg)
        assert plan is not None and plan.used_gpus == cfg.cluster.nodes * cfg.cluster.gpus_per_node
        assert cfg.trainer.dtype == "bf16" and cfg.data.task == "files" and cfg.model.path


def test_the_gpu_workloads_are_there():
    names = {p.name for p in RUN_CONFIGS}
    assert {"qwen2.5_math_1.5b_dapo_8gpu.yaml", "qwen2.5_7b_dapo_64gpu.yaml"} <= names
    assert load_config(ROOT / "configs" / "qwen2.5_7b_dapo_64gpu.yaml").trainer.zero_stage == 3


@pytest.fixture
def env(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("ray", "sbatch"):
        stub = bin_dir / tool
        stub.write_text(f'#!/bin/sh\necho "$0 $*" >> {tmp_path}/called\n')
        stub.chmod(0o755)
    yield dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    assert not (tmp_path / "called").exists(), (tmp_path / "called").read_text()


def run(args, env, ok=True) -> subprocess.CompletedProcess:
    out = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert (out.returncode == 0) == ok, out.stdout + out.stderr
    return out


def test_ray_head_dry_run_keeps_the_dashboard_on_localhost(env):
    out = run(["bash", "launch/ray_head.sh", "--dry-run", "--num-gpus", "8", "--block"], env)
    assert out.stdout.strip() == ("ray start --head --port=6379 --dashboard-host=127.0.0.1 --dashboard-port=8265 "
                                  "--disable-usage-stats --num-gpus=8 --block")
    out = run(["bash", "launch/ray_head.sh", "--dry-run", "--dashboard-host", "0.0.0.0"], env)
    assert "--dashboard-host=0.0.0.0" in out.stdout  # only when asked for explicitly


def test_ray_worker_dry_run_and_a_missing_address(env):
    out = run(["bash", "launch/ray_worker.sh", "--dry-run", "--address", "10.0.0.1:6379", "--num-gpus", "8"], env)
    assert out.stdout.strip() == "ray start --address=10.0.0.1:6379 --disable-usage-stats --num-gpus=8"
    assert "--address HEAD_IP:PORT is required" in run(["bash", "launch/ray_worker.sh", "--dry-run"], env, False).stderr


def test_sbatch_dry_run_renders_a_valid_script(env, tmp_path):
    out = run(["bash", "launch/sbatch.sh", "--dry-run", "--config", "configs/qwen2.5_7b_dapo_64gpu.yaml",
               "--nodes", "8", "--partition", "gpu", "trainer.total_steps=10", "output_dir=runs/a b&c"], env)
    script = out.stdout
    assert "#SBATCH --nodes=8" in script and "#SBATCH --gpus-per-node=8" in script
    assert "#SBATCH --partition=gpu" in script and not re.search(r"@[A-Z_]+@", script)  # all filled in
    assert ('rlsys train configs/qwen2.5_7b_dapo_64gpu.yaml cluster.address="$address" cluster.nodes=8 '
            "cluster.gpus_per_node=8 trainer.total_steps=10 output_dir=runs/a\\ b\\&c") in script
    assert "launch/ray_head.sh" in script and "launch/ray_worker.sh" in script
    assert "would write runs/slurm/rlsys-" in script.splitlines()[-1]
    (tmp_path / "job.sbatch").write_text(script)
    run(["bash", "-n", str(tmp_path / "job.sbatch")], env)  # it parses
    assert "--config CONFIG is required" in run(["bash", "launch/sbatch.sh", "--dry-run"], env, False).stderr


def test_submit_dry_run_checks_the_config_and_prints_the_job(env):
    out = run([sys.executable, "launch/submit.py", "configs/qwen2.5_math_1.5b_dapo_8gpu.yaml",
               "trainer.total_steps=5", "--dry-run", "--no-wait"], env)
    assert out.stdout.strip().startswith("ray job submit --address http://127.0.0.1:8265 --runtime-env-json ")
    assert out.stdout.strip().endswith("--no-wait -- rlsys train configs/qwen2.5_math_1.5b_dapo_8gpu.yaml "
                                       "trainer.total_steps=5 cluster.address=auto")
    bad = run([sys.executable, "launch/submit.py", "configs/tiny.yaml", "trainer.zero_stage=9", "--dry-run"],
              env, ok=False)
    assert "trainer.zero_stage" in bad.stderr


def test_the_slurm_job_starts_the_head_then_the_workers_then_training(env, tmp_path):
    """The generated job run under stand-ins for Slurm (srun, scontrol), Ray's node count (python) and rlsys,
    which record each call: head first, workers only once the head answers, training once all have joined."""
    script = run(["bash", "launch/sbatch.sh", "--dry-run", "--config", "configs/tiny.yaml", "--nodes", "3",
                  "--gpus-per-node", "2", "trainer.total_steps=4"], env).stdout
    job = tmp_path / "job.sbatch"
    job.write_text(script.rsplit("\n# would write", 1)[0])
    calls, stubs = tmp_path / "calls", tmp_path / "slurm_bin"
    stubs.mkdir()
    bodies = {
        "scontrol": 'printf "n1\\nn2\\nn3\\n"',
        "srun": (f'echo "srun $*" >> {calls}\n'
                 'case "$*" in *hostname*) echo 10.9.8.7 ;; *ray_head.sh*) touch "$STATE/head" ;;'
                 ' *ray_worker.sh*) touch "$STATE/workers" ;; esac'),
        # Ray's node count as the job polls it: none until the head runs, then 1, then all 3.
        "python": (f'echo "poll" >> {calls}\n'
                   'if [ -e "$STATE/workers" ]; then echo 3; elif [ -e "$STATE/head" ]; then echo 1; else echo 0; fi'),
        "rlsys": f'echo "rlsys $*" >> {calls}',
    }
    for name, body in bodies.items():
        (stubs / name).write_text(f"#!/bin/sh\n{body}\n")
        (stubs / name).chmod(0o755)
    job_env = dict(env, PATH=f"{stubs}{os.pathsep}{env['PATH']}", STATE=str(tmp_path), SLURM_SUBMIT_DIR=str(ROOT),
                   SLURM_JOB_NODELIST="n[1-3]", RLSYS_JOIN_POLL_S="1")
    out = subprocess.run(["bash", str(job)], cwd=ROOT, env=job_env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    lines = calls.read_text().splitlines()
    steps = [next(i for i, line in enumerate(lines) if key in line)
             for key in ("hostname", "ray_head.sh", "poll", "ray_worker.sh", "rlsys train")]
    assert steps == sorted(steps), lines  # head, a poll that found it, workers, then training
    worker = lines[steps[3]]
    assert "--exclude=n1" in worker and "--nodes=2" in worker and "--address 10.9.8.7:6379" in worker
    assert lines[steps[3] - 1] == "poll" and lines[steps[4] - 1] == "poll"  # each start waited on a poll
    assert lines[-1] == ("rlsys train configs/tiny.yaml cluster.address=10.9.8.7:6379 cluster.nodes=3 "
                         "cluster.gpus_per_node=2 trainer.total_steps=4")
