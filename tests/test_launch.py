"""Run configs in configs/ load and plan; `rlsys check`, `rlsys train --dry-run` and the launch/ scripts' --dry-run
check a config as a run would, print its GPU plan and what they would run.

A stand-in `ray` (and `sbatch`) first on PATH records any call, so the tests also show that a dry run
starts nothing.
"""
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rlsys.cli import main
from rlsys.placement import plan_from_config
from rlsys.startup import load_config

ROOT = Path(__file__).resolve().parent.parent
RUN_CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))  # configs/sim/ holds simulator configs
GPU8 = "configs/qwen2.5_math_1.5b_dapo_8gpu.yaml"  # one node of 8 GPUs, colocated


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


def test_check_prints_the_plan_of_a_gpu_config_on_this_cpu_host_quickly_and_starts_no_ray():
    """It plans logical GPUs: no Ray, so no wait for GPUs this host does not have (a run waits 120 s). It does not
    even import Ray, torch or what the trainer and engines need: a check takes about a second, not several."""
    script = ("import sys; from rlsys.cli import main; code = main(sys.argv[1:]); "
              "print('ray started:', 'ray' in sys.modules and sys.modules['ray'].is_initialized()); "
              "print('imported:', [m for m in ('ray', 'torch', 'transformers', 'deepspeed') if m in sys.modules]); "
              "sys.exit(code)")
    for config, node0 in (("configs/gpu/smoke.yaml", "engines 0 on GPUs 0; trainer ranks 0 on GPUs 0"),
                          ("examples/own_reward/gpu8.yaml", "engines 0-7 on GPUs 0-7; trainer ranks 0-7 on GPUs 0-7")):
        started = time.monotonic()
        out = subprocess.run([sys.executable, "-c", script, "check", config, "--other-machine"], cwd=ROOT,
                             capture_output=True,
                             text=True, timeout=120)
        assert out.returncode == 0, out.stdout + out.stderr
        assert time.monotonic() - started < 60
        assert f"  node 0: {node0}\n" in out.stdout and "ray started: False" in out.stdout
        assert "imported: []" in out.stdout
        assert "warning" not in out.stdout + out.stderr
    assert "user code imported: reward.fn=examples/own_reward/my_reward.py:score" in out.stdout


def test_check_says_which_gpus_would_sit_idle_and_what_to_raise(capsys):
    """The 8-GPU config on two nodes plans "node 1: idle"; it is said plainly, not fatal. (Its model and data are on
    the GPU machine's disks: --other-machine.)"""
    assert main(["check", str(ROOT / GPU8), "cluster.nodes=2", "--other-machine"]) == 0
    out = capsys.readouterr().out
    assert "  node 1: idle" in out
    assert ("warning: 8 of 16 GPUs would sit idle (node 1: all 8): trainer.world_size and rollout.num_workers must "
            "grow with cluster.nodes") in out
    assert out.rstrip().endswith("to use all 16, set rollout.num_workers=16 and trainer.world_size=16")
    assert main(["check", str(ROOT / GPU8), "cluster.nodes=2", "rollout.num_workers=16", "trainer.world_size=16",
                 "--other-machine"]) == 0
    out = capsys.readouterr().out
    assert "node 1: engines 8-15 on GPUs 0-7; trainer ranks 8-15 on GPUs 0-7" in out and "idle" not in out


def test_check_refuses_a_plan_that_does_not_fit_naming_the_fields(capsys):
    assert main(["check", str(ROOT / GPU8), "trainer.world_size=16"]) == 2
    err = capsys.readouterr().err
    assert "trainer.world_size=16 need 16 GPUs, more than cluster.nodes=1 x cluster.gpus_per_node=8 = 8 GPUs" in err
    line = (ROOT / GPU8).read_text().splitlines().index("  gpus_per_node: 8") + 1
    assert f"cluster.gpus_per_node line {line}; command-line override: trainer.world_size]" in err  # where each was set
    assert "Traceback" not in err


def test_train_dry_run_checks_config_and_output_dir_as_the_run_would_and_starts_nothing(tmp_path, capsys):
    run_dir = tmp_path / "run"
    argv = ["train", str(ROOT / GPU8), f"output_dir={run_dir}", "--dry-run", "--other-machine"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "node 0: engines 0-7 on GPUs 0-7" in out and out.rstrip().endswith("dry run: nothing started")
    assert not run_dir.exists()
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text('{"step": 1}\n')
    assert main(argv) == 2
    assert f"output_dir {run_dir} holds a run (metrics.jsonl; no checkpoint)" in capsys.readouterr().err
    assert main(argv + ["--resume"]) == 2
    assert "--resume: no complete checkpoint" in capsys.readouterr().err
    assert main(argv + ["--overwrite"]) == 0  # the run would move it aside; the dry run moves nothing
    assert (run_dir / "metrics.jsonl").exists() and len(list(tmp_path.iterdir())) == 1
    assert main(["train", str(ROOT / GPU8), "trainer.lrr=3", "--dry-run"]) == 2
    assert "trainer.lrr: unknown key (got 3) [command-line override]" in capsys.readouterr().err


@pytest.fixture
def env(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("ray", "sbatch"):
        stub = bin_dir / tool
        stub.write_text(f'#!/bin/sh\necho "$0 $*" >> {tmp_path}/called\n')
        stub.chmod(0o755)
    # then this interpreter's environment, whose `rlsys` sbatch.sh runs to check the config
    path = os.pathsep.join([str(bin_dir), str(Path(sys.executable).parent), os.environ["PATH"]])
    yield dict(os.environ, PATH=path)
    assert not (tmp_path / "called").exists(), (tmp_path / "called").read_text()


def run(args, env, ok=True, cwd=ROOT) -> subprocess.CompletedProcess:
    out = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=60)
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


def files_of(config: str, project: Path) -> Path:
    """`project` holding `config` and stand-ins for the model folder and data files it names, as the cluster's
    shared disk would: sbatch.sh checks them as `rlsys check` does, and refuses a job that would fail at start-up."""
    cfg = load_config(ROOT / config)
    (project / config).parent.mkdir(parents=True, exist_ok=True)
    (project / config).write_text((ROOT / config).read_text())
    model = project / cfg.model.path
    model.mkdir(parents=True)
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        (model / name).write_text("{}")
    for path in (cfg.data.train_path, cfg.data.eval_path):
        (project / path).parent.mkdir(parents=True, exist_ok=True)
        (project / path).write_text("")
    return project


def test_sbatch_dry_run_renders_a_valid_script(env, tmp_path):
    config = "configs/qwen2.5_7b_dapo_64gpu.yaml"
    args = ["bash", str(ROOT / "launch" / "sbatch.sh"), "--dry-run", "--config", config, "--nodes", "8"]
    missing = run(args, env, ok=False)  # here, without its model and data: nothing to submit
    assert "a run would fail at start-up:\n  model.path: models/Qwen2.5-7B is not a directory" in missing.stderr
    out = run(args + ["--partition", "gpu", "trainer.total_steps=10", "output_dir=runs/a b&c"], env,
              cwd=files_of(config, tmp_path / "project"))
    script = out.stdout
    assert "#SBATCH --nodes=8" in script and "#SBATCH --gpus-per-node=8" in script
    assert "#SBATCH --partition=gpu" in script and not re.search(r"@[A-Z_]+@", script)  # all filled in
    assert ('rlsys train configs/qwen2.5_7b_dapo_64gpu.yaml cluster.address="$address" cluster.nodes=8 '
            "cluster.gpus_per_node=8 trainer.total_steps=10 output_dir=runs/a\\ b\\&c") in script
    assert f"{ROOT}/launch/ray_head.sh" in script and f"{ROOT}/launch/ray_worker.sh" in script
    # checked first, on the cluster the job asks for: 8 nodes of 8 GPUs, all used by this config
    assert "configs/qwen2.5_7b_dapo_64gpu.yaml cluster.nodes=8 cluster.gpus_per_node=8 trainer.total_steps=10" in out.stderr
    assert "placement: 8 node(s) x 8 GPUs = 64" in out.stderr and "idle" not in out.stderr
    assert "would write runs/slurm/rlsys-" in script.splitlines()[-1]
    (tmp_path / "job.sbatch").write_text(script)
    run(["bash", "-n", str(tmp_path / "job.sbatch")], env)  # it parses
    assert "--config CONFIG is required" in run(["bash", "launch/sbatch.sh", "--dry-run"], env, False).stderr


def test_submit_dry_run_checks_the_config_and_prints_the_job(env):
    out = run([sys.executable, "launch/submit.py", "configs/qwen2.5_math_1.5b_dapo_8gpu.yaml",
               "trainer.total_steps=5", "--dry-run", "--no-wait"], env)
    *plan, job = out.stdout.strip().splitlines()
    assert "  node 0: engines 0-7 on GPUs 0-7; trainer ranks 0-7 on GPUs 0-7" in plan
    assert job.startswith("ray job submit --address http://127.0.0.1:8265 --runtime-env-json ")
    assert job.endswith("--no-wait -- rlsys train configs/qwen2.5_math_1.5b_dapo_8gpu.yaml "
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


@pytest.mark.parametrize("args, message", [
    (["--config", "configs/nope.yaml"], "rlsys: config file not found: configs/nope.yaml"),
    (["--config", "configs/tiny.yaml", "trainer.lrr=3"], "trainer.lrr: unknown key (got 3) [command-line override]"),
    (["--config", GPU8, "--gpus-per-node", "4"], "need 8 GPUs, more than cluster.nodes=1 x cluster.gpus_per_node=4")])
def test_sbatch_checks_the_config_before_printing_or_submitting_a_job(env, args, message):
    """--dry-run once printed the job for any config, even a missing one; the check runs without --dry-run too."""
    for dry_run in (["--dry-run"], []):
        out = run(["bash", "launch/sbatch.sh", *dry_run, *args], env, ok=False)
        assert message in out.stderr and out.stderr.rstrip().endswith("sbatch.sh: nothing submitted"), out.stderr
        assert "Traceback" not in out.stderr and "#SBATCH" not in out.stdout


def test_launch_scripts_resolve_paths_from_the_working_directory(env, tmp_path):
    """A project folder outside the repository holding its config and reward file, both named relative to it."""
    project = tmp_path / "project"
    (project / "sub").mkdir(parents=True)
    (project / "reward.py").write_text("def score(response, answer):\n    return float(response == answer)\n")
    (project / "my.yaml").write_text("reward:\n  fn: reward.py:score\n")
    out = run([sys.executable, str(ROOT / "launch" / "submit.py"), "my.yaml", "--dry-run"], env, cwd=project)
    assert "user code imported: reward.fn=reward.py:score" in out.stdout
    assert out.stdout.rstrip().endswith("-- rlsys train my.yaml cluster.address=auto")
    out = run(["bash", str(ROOT / "launch" / "sbatch.sh"), "--dry-run", "--config", "my.yaml", "--gpus-per-node", "1"],
              env, cwd=project)
    assert "rlsys train my.yaml cluster.address=" in out.stdout and "user code imported: reward.fn" in out.stderr
    # the repository's configs are not where these scripts look from another folder (they once were)
    out = run([sys.executable, str(ROOT / "launch" / "submit.py"), "configs/tiny.yaml", "--dry-run"], env, False,
              cwd=project)
    assert "config file not found: configs/tiny.yaml" in out.stderr
    out = run(["bash", str(ROOT / "launch" / "sbatch.sh"), "--dry-run", "--config", "configs/tiny.yaml"], env, False,
              cwd=project)
    assert "config file not found: configs/tiny.yaml" in out.stderr
    # the job receives the working directory: a config above it would not travel with it
    out = run([sys.executable, str(ROOT / "launch" / "submit.py"), "../my.yaml", "--dry-run"], env, False,
              cwd=project / "sub")
    assert "config ../my.yaml lies outside the working directory" in out.stderr
