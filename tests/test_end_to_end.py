"""The whole system through the CLI: Ray actors, the CPU engine, the reward pool, DeepSpeed trainers."""
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rlsys.bench import summarise_run
from rlsys.cli import main
from rlsys.config import DEFAULT_CONFIG
from rlsys.rollout.builtin_engine import CPUEngine
from rlsys.rollout.registry import register_engine

from helpers import SMALL

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parent.parent

STEP_KEYS = ["step", "time_s", "policy_version", "samples", "reward/mean", "response_length/mean",
             "response_length/max", "response_length/p99", "group_size", "rollout/bubble_ratio",
             "rollout/straggler_rate", "timing/rollout_s", "timing/reward_s", "timing/train_s",
             "timing/weight_sync_s", "timing/generating_during_train", "throughput/tokens_per_s", "reward/errors",
             "rollout/decode_steps", "rollout/decode_step_ms", "rollout/engine_busy_share"]


def rows(run_dir, name="metrics.jsonl"):
    return [json.loads(line) for line in (run_dir / name).read_text().splitlines() if line]


def test_two_step_run_writes_metrics_checkpoint_export_and_plots(two_step_run):
    out = two_step_run  # answers capped at 4 tokens in step 1, at SMALL's 48 in step 2 (conftest.py)
    metrics = rows(out)
    steps = [r for r in metrics if "timing/train_s" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for key in STEP_KEYS:
        assert all(key in r for r in steps), key
    assert "eval/accuracy" in metrics[0] and "eval/accuracy" in metrics[-1]
    assert steps[-1]["policy_version"] == 2 and steps[0]["samples"] == 16
    assert 0.0 <= steps[0]["rollout/bubble_ratio"] < 1.0
    for r in steps:  # the longest response took a decode step per token after its prefill's
        assert r["rollout/decode_steps"] >= r["response_length/max"] - 1
        assert r["rollout/decode_step_ms"] > 0 and 0 < r["rollout/engine_busy_share"] <= 1
    for r in (metrics[0], metrics[-1]):
        assert r["eval/decode_step_ms"] > 0 and 0 < r["eval/engine_busy_share"] <= 1
    assert (out / "checkpoints" / "step_000002" / "controller.json").exists()
    assert (out / "progress.png").stat().st_size > 0 and (out / "timeline.png").stat().st_size > 0
    timeline = rows(out, "timeline.jsonl")
    assert len(timeline) == 32 and all(r["end"] >= r["start"] for r in timeline)
    assert [r["rollout/max_new_tokens"] for r in steps] == [4, 48]
    assert max(r["tokens"] for r in timeline if r["step"] == 1) <= 4 < max(r["tokens"] for r in timeline)
    from transformers import AutoModelForCausalLM, AutoTokenizer
    model = AutoModelForCausalLM.from_pretrained(out / "export")
    AutoTokenizer.from_pretrained(out / "export")
    trained = load_file(str(out / "checkpoints" / "step_000002" / "trainer" / "model.safetensors"))
    for name, param in model.state_dict().items():
        if name in trained:
            torch.testing.assert_close(param, trained[name])

    # `rlsys eval` on the exported model reproduces the run's final evaluation exactly (fixed seeds).
    from rlsys.evaluate import evaluate_path
    final = metrics[-1]
    again, n = evaluate_path(str(out), [])
    assert n == 16 and set(again) == {"eval/accuracy", "eval/accuracy_se"}
    assert again == {k: final[k] for k in again}


def trained_order(run_dir):
    """(step, request id, reward-relevant tokens) of every trained request, in step order."""
    return sorted((r["step"], r["request_id"], r["tokens"]) for r in rows(run_dir, "timeline.jsonl"))


def test_killed_run_resumes_with_the_same_data_order(tmp_path, ray_address):
    """SIGKILL after the step-2 checkpoint, then --resume: same prompts, samples and weights as a run
    that was never interrupted."""
    common = [str(DEFAULT_CONFIG), "trainer.total_steps=4", "control.save_every=2", "control.eval_every=0", *SMALL]
    whole, broken = tmp_path / "whole", tmp_path / "broken"
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "rlsys.cli", "train", *common, f"output_dir={broken}",
           f"cluster.address={ray_address}"]  # the shared Ray: the kill ends the driver, and Ray its actors
    proc = subprocess.Popen(cmd, env=env, start_new_session=True)
    ended_first = []  # the broken run finished, or ran out of time, before its step-2 checkpoint

    def kill_at_the_checkpoint():
        deadline = time.time() + 600
        while not (broken / "checkpoints" / "step_000002" / "controller.json").exists():
            if proc.poll() is not None or time.time() > deadline:
                ended_first.append(proc.poll())
                break
            time.sleep(0.2)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()

    # The uninterrupted run here meanwhile (the signal handlers it installs need the main thread): the two overlap.
    killer = threading.Thread(target=kill_at_the_checkpoint)
    killer.start()
    try:
        assert main(["train", *common, f"output_dir={whole}"]) == 0
    finally:
        killer.join()
    assert not ended_first, f"the run ended before its first checkpoint (exit code {ended_first[0]})"
    subprocess.run(cmd + ["--resume"], check=True, env=env, timeout=600)

    assert trained_order(broken) == trained_order(whole)
    a = load_file(str(whole / "export" / "model.safetensors"))
    b = load_file(str(broken / "export" / "model.safetensors"))
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=1e-5, rtol=1e-4)
    resumed_steps = [r["step"] for r in rows(broken) if "timing/train_s" in r]
    assert resumed_steps == [1, 2, 3, 4]


def test_tail_with_streamed_training_trains_every_announced_group(tmp_path, ray_cluster, capsys):
    """trainer.streamed: each prompt's gradients are computed as it completes; each of the round's two
    mini-batches is updated once its groups are in."""
    out = tmp_path / "streamed"
    assert main(["train", str(DEFAULT_CONFIG), "trainer.total_steps=2", f"output_dir={out}", "control.eval_every=0",
                 "control.scheduler=tail", "trainer.streamed=true", "trainer.mini_batches=2", *SMALL]) == 0
    said = capsys.readouterr().out
    assert f"done: step 2; run folder {out}" in said and "stopped at step" not in said  # finished, with no eval
    steps = [r for r in rows(out) if "timing/train_s" in r]
    assert [r["policy_version"] for r in steps] == [1, 2]
    assert all(r["train/sequences"] == 16 and r["train/tokens"] > 0 and "train/loss" in r for r in steps)
    # control.eval_every=0: no eval at all, not even before and after training; the first and final rows remain
    logged = rows(out)
    assert logged[0]["step"] == 0 and logged[-1]["final"] and not any("eval/accuracy" in r for r in logged)
    # the built model the run started from, for a results file to tell runs of one start from another's
    assert logged[0]["model/fingerprint"] == logged[-1]["model/fingerprint"] == summarise_run(logged, 0.5)[
        "model_fingerprint"] and len(logged[0]["model/fingerprint"]) == 16


def test_async_generates_while_the_trainer_trains(tmp_path, ray_cluster):
    """The asynchronous schedule's point, measured: the engines decode during train steps (sync: never)."""
    out = tmp_path / "run"
    assert main(["train", str(DEFAULT_CONFIG), "trainer.total_steps=4", f"output_dir={out}", "control.eval_every=0",
                 "control.save_every=0", "control.scheduler=async", "trainer.loss=decoupled_ppo", *SMALL]) == 0
    steps = [r for r in rows(out) if "timing/train_s" in r]
    assert len(steps) == 4 and max(r["staleness/max"] for r in steps) <= 1
    assert all(0.0 <= r["timing/generating_during_train"] <= 1.0 for r in steps)
    assert sum(r["timing/generating_during_train"] for r in steps) > 0, steps


@register_engine("unhurried")
class UnhurriedEngine(CPUEngine):
    """The built-in engine, 20 ms slower a step while it runs training requests: they are still generating when a
    step's weights are published, so a mid-run eval runs beside them."""

    def step(self):
        if any("#" in rid for rid in self.running):
            time.sleep(0.02)
        return super().step()


def test_an_eval_runs_beside_async_training_on_its_steps_weights(tmp_path, ray_cluster, monkeypatch):
    """Eval mid-run goes through the controller's pump: async's requests in flight wait, suspended with their
    tokens, and none is lost, the training clock stands still, and each eval equals `rlsys eval` of its step's
    checkpoint."""
    from rlsys.evaluate import evaluate_path
    from rlsys.train import Controller

    # (evaluating mid-run, training's requests held suspended, their cuts still on the way, training clock) at each
    # turn of the pump
    seen = []
    next_events = Controller.next_events

    def spy(self):
        events = next_events(self)
        seen.append((self.evaluation is not None and not self.done, len(self.rollout.suspended),
                     len(self.rollout.suspending), self.now()))
        return events
    monkeypatch.setattr(Controller, "next_events", spy)
    ray_cluster.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the engine, to the Ray workers
    out = tmp_path / "run"
    assert main(["train", str(DEFAULT_CONFIG), "trainer.total_steps=3", f"output_dir={out}", "control.eval_every=1",
                 "control.save_every=1", "control.scheduler=async", "control.staleness.eta=2", "rollout.eval_samples=2",
                 "rollout.engine=unhurried", *SMALL]) == 0
    steps = [r for r in rows(out) if "timing/train_s" in r]
    assert [r["policy_version"] for r in steps] == [1, 2, 3] and all(r["samples"] == 16 for r in steps)
    assert max(held + cut for evaluating, held, cut, _ in seen if evaluating) > 0, "nothing in flight at an eval"
    # All resumed once eval is done: none held back; a cut still on its way is given back as it arrives
    assert all(held == 0 for evaluating, held, _, _ in seen if not evaluating) and seen[-1][2] == 0
    clock = [t for *_, t in seen]
    assert clock == sorted(clock)  # it never runs back
    assert all(a[3] == b[3] for a, b in zip(seen, seen[1:]) if a[0] and b[0])  # and stands still in an eval
    collected = [r["request_id"] for r in rows(out, "timeline.jsonl")]
    assert len(collected) == len(set(collected))  # each sample once (the ledger balanced at every step)
    again, _ = evaluate_path(str(out / "checkpoints" / "step_000002"), [])  # the last two are kept
    assert set(again) == {"eval/accuracy", "eval/accuracy_se"}
    assert again == {key: steps[1][key] for key in again}


def test_the_after_round_baseline_scores_a_round_only_once_it_has_generated(tmp_path, ray_cluster, monkeypatch):
    """benchmarks/reward_overlap.py's baseline: no completion reaches the reward pool while a training request of
    the run is still generating."""
    import importlib.util

    from rlsys.bench import run_preset
    from rlsys.train import Controller

    spec = importlib.util.spec_from_file_location("reward_overlap", REPO / "benchmarks" / "reward_overlap.py")
    overlap = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(overlap)
    generating = []  # training requests in the engines at each completion sent to the reward pool
    score = Controller.score

    def spy(self, completions):
        generating.extend([sum("#" in rid for rid in self.rollout.worker_of)] * len(completions))
        score(self, completions)
    monkeypatch.setattr(Controller, "score", spy)
    metrics = run_preset(None, ["trainer.total_steps=2", "control.eval_every=0", *SMALL], tmp_path / "run",
                         overlap.ScoreAfterRound)
    assert [r["samples"] for r in metrics if "timing/train_s" in r] == [16, 16]
    assert len(generating) == 32 and set(generating) == {0}
