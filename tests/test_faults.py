"""Worker faults, acted out on real Ray actors: a rollout worker is replaced and its requests run again;
a dead trainer rank stops the run with a message, and --resume goes on. (Reward workers: test_reward.py.)"""
import json
import re
import time
import zlib

import pytest
import ray
from helpers import kill_and_wait

from rlsys.cli import main
from rlsys.config import DEFAULT_CONFIG
from rlsys.rollout.builtin_engine import CPUEngine
from rlsys.rollout.manager import RolloutManager
from rlsys.train import Controller
from rlsys.trainer.worker import done_or_failed
from rlsys.types import Request, SamplingParams
from test_end_to_end import SMALL, rows
from test_rollout import models  # noqa: F401 - the fixture: 300-token responses, so a kill lands mid-generation

QUICK_EVAL = ["rollout.eval_samples=1", "rollout.eval_greedy=false"]


@pytest.fixture(scope="module")
def manager(ray_cluster, models):
    m = RolloutManager(models[0], num_workers=2, slots=4, torch_threads=1, drain_timeout_s=0.5)
    yield m
    m.shutdown()


def sampled(rid, n=300):
    seed = zlib.crc32(rid.encode())  # as the controller seeds its requests
    return Request(rid, "p", [1, 2, 3], SamplingParams(max_new_tokens=n, temperature=1.0, seed=seed))


def collect(manager, n, timeout_s=60):
    out, deadline = [], time.time() + timeout_s
    while len(out) < n and time.time() < deadline:
        ready, _ = ray.wait(manager.refs(), num_returns=1, timeout=1.0)
        out += manager.collect(ready)
    return {c.request_id: c for c in out}


def generating(manager, worker):
    deadline = time.time() + 30
    while manager.stats()[worker]["generated_tokens"] == 0:
        assert time.time() < deadline, "no tokens generated"
        time.sleep(0.005)


def test_a_killed_rollout_worker_is_replaced_and_its_requests_run_again(manager, models):
    path, other = models
    manager.load_weights(other, version=1)  # the replacement must start from these, not from the model dir
    requests = [sampled(f"k{i}") for i in range(4)]
    manager.submit(requests)
    victim, restarts = manager.workers[0], manager.restarts
    generating(manager, 0)
    kill_and_wait(victim)
    done = collect(manager, 4)
    assert sorted(done) == ["k0", "k1", "k2", "k3"] and manager.worker_of == {}  # each once, nothing more to come
    assert manager.restarts - restarts == 1 and manager.workers[0] != victim
    engine = CPUEngine(path, slots=4)  # same seeds, same weights: the same samples as if nothing happened
    engine.load_weights(other, 1)
    for r in requests:
        engine.add(r)
    expected = {}
    while engine.has_work():
        expected.update((c.request_id, c.token_ids) for c in engine.step())
    assert {rid: c.token_ids for rid, c in done.items()} == expected
    assert all(c.versions == [1] * c.num_tokens for c in done.values())


def test_requests_aborted_on_a_dead_worker_come_back_cut_and_do_not_run_again(manager):
    manager.submit([sampled(f"a{i}") for i in range(4)])
    lost = sorted(rid for rid, i in manager.worker_of.items() if i == 0)
    generating(manager, 0)
    kill_and_wait(manager.workers[0])
    assert manager.abort([lost[0]]) == [lost[0]]  # the abort finds the worker dead
    done = collect(manager, 4)
    assert sorted(done) == ["a0", "a1", "a2", "a3"] and manager.worker_of == {}
    assert (done[lost[0]].finish_reason, done[lost[0]].num_tokens) == ("abort", 0)
    assert manager.stats()[0]["generated_tokens"] == done[lost[1]].num_tokens  # the replacement ran only that one


def kill_and_collect(manager):
    """Kill worker 0 and collect until it is replaced (nothing can finish in between)."""
    restarts = manager.restarts
    kill_and_wait(manager.workers[0])
    while manager.restarts == restarts:
        ready, _ = ray.wait(manager.refs(), num_returns=1)
        manager.collect(ready)


def test_a_rollout_worker_that_keeps_dying_stops_the_run(manager, monkeypatch):
    """Last of the manager tests: it leaves worker 0 dead."""
    monkeypatch.setattr(manager, "max_restarts", 1)
    manager.submit([sampled("d")])
    kill_and_collect(manager)
    assert manager.worker_of == {"d": 0}
    with pytest.raises(RuntimeError, match=r"rollout worker 0 died 2 times in a row without finishing a "
                                           r"request \(rollout.max_restarts=1\); the last time: .*ray.kill"):
        kill_and_collect(manager)


@pytest.mark.slow
def test_a_run_goes_on_when_its_rollout_worker_dies_mid_step(tmp_path, ray_cluster, monkeypatch):
    """Killed once step 2's first requests are in: the run finishes, each prompt trained once."""
    submit, submitted = RolloutManager.submit, []

    def submit_then_kill(self, requests):
        submit(self, requests)
        submitted.extend(r.request_id for r in requests if r.prompt_uid.startswith("train"))
        if len(submitted) == 16 + len(requests):  # 16 samples a step: this is step 2's first prompt
            ray.kill(self.workers[0])
    monkeypatch.setattr(RolloutManager, "submit", submit_then_kill)
    out = tmp_path / "run"
    assert main(["train", str(DEFAULT_CONFIG), "trainer.total_steps=2", "control.eval_every=0", f"output_dir={out}",
                 *SMALL, *QUICK_EVAL]) == 0
    steps = [r for r in rows(out) if "timing/train_s" in r]
    assert [r["rollout/restarts"] for r in steps] == [0, 1]
    assert all(r["samples"] == 16 for r in steps) and steps[-1]["prompts/trained"] == steps[-1]["prompts/drawn"] == 8
    trained = [r["request_id"] for r in rows(out, "timeline.jsonl")]
    prompts = {rid.split("#")[0] for rid in trained}
    assert len(trained) == len(set(trained)) == 32 and len(prompts) == 8  # each sample once, 4 per prompt


def test_a_train_step_is_over_when_a_rank_dies_though_its_peers_wait_forever(ray_cluster):
    """As under NCCL, where a dead rank's peers wait in the collective until a timeout of minutes."""
    @ray.remote(num_cpus=0)
    class Rank:
        def step(self):
            time.sleep(600)
    waiting, dying = Rank.remote(), Rank.remote()
    refs = [waiting.step.remote(), dying.step.remote()]
    try:
        assert not done_or_failed(refs)
        ray.kill(dying)
        ray.wait(refs[1:])
        assert done_or_failed(refs)
    finally:
        ray.kill(waiting)


@pytest.mark.slow
def test_a_dead_trainer_rank_stops_the_run_and_resume_goes_on(tmp_path, ray_cluster, monkeypatch, capsys):
    """Rank 1 of 2 killed after the step-1 checkpoint: step 2 fails at once, naming it; --resume ends the run."""
    save, killed = Controller.save, []

    def save_then_kill(self):
        path = save(self)
        if not killed:
            killed.append(self.step)
            ray.kill(self.trainer.workers[1])
        return path
    monkeypatch.setattr(Controller, "save", save_then_kill)
    out = tmp_path / "run"
    args = ["train", str(DEFAULT_CONFIG), "trainer.total_steps=2", "control.save_every=1", "control.eval_every=0",
            "trainer.world_size=2", f"output_dir={out}", *SMALL, *QUICK_EVAL]
    assert main(args) == 1
    assert re.search(r"rlsys: trainer rank 1 died in step 2 \(.*ray.kill.*\)\. The run stopped; `rlsys train` with "
                     r"the same config and --resume continues from the last checkpoint, step 1\.$",
                     capsys.readouterr().err.strip())
    assert killed == [1]
    assert main(args + ["--resume"]) == 0
    assert [r["step"] for r in rows(out) if "timing/train_s" in r] == [1, 2]
    assert json.loads((out / "checkpoints" / "step_000002" / "controller.json").read_text())["step"] == 2
