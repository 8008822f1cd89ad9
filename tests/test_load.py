"""The controller under load: 10,000 requests in flight on simulated engines, every event handled once.

Each scheduler is driven by the simulator exactly as the live controller drives it; a recorder between
the two checks every event and action. Timings live in benchmarks/controller_load.py, not here.
"""
from collections import Counter

import pytest

from rlsys.control.actions import Submit, Train
from rlsys.control.events import Scored
from rlsys.sim.config import load_sim_config
from rlsys.sim.simulator import ABORTED_OUT, SAMPLE, Simulation

PROMPTS, GROUP, ENGINES, STEPS = 1250, 8, 40, 2  # 10,000 requests per step; 40 engines x 256 sequences


def load_config(scheduler: str):
    cluster = {"gpus": ENGINES, "tp": 1}
    if scheduler == "async":  # trains on GPUs of its own
        cluster.update(gpus=ENGINES + 10, trainer_gpus=10)
    return load_sim_config({
        "steps": STEPS, "schedulers": [scheduler], "model": "qwen2.5-7b", "cluster": cluster,
        "engine": {"max_seqs": 256}, "workload": {"max_tokens": 4096, "median_tokens": 1000, "dataset_size": 25000},
        "control": {"prompts_per_step": PROMPTS, "group_size": GROUP}})


class Recorder:
    """Sits where the simulator calls the scheduler; checks each event against the actions before it."""

    def __init__(self, sim: Simulation):
        self.sim = sim
        self.owner: dict[str, str] = {}  # request id -> prompt uid, for every request submitted
        self.answered: set[str] = set()  # requests whose Scored or Aborted event reached the scheduler
        self.scored: set[str] = set()  # ... Scored
        self.trained_prompts: Counter[str] = Counter()
        self.trained_requests: Counter[str] = Counter()
        self.peak_in_flight = self.peak_running = 0
        sim._call = self.call  # the loop looks it up on the instance

    def call(self, fn, *args):
        if fn.__name__ == "handle":  # a Scored or an Aborted event, as the live controller hands them
            event = args[0]
            scored = isinstance(event, Scored)
            rid = (event.sample.completion if scored else event.completion).request_id
            assert rid in self.owner and rid not in self.answered, f"{type(event).__name__} for {rid}"
            self.peak_in_flight = max(self.peak_in_flight, len(self.owner) - len(self.answered))
            self.peak_running = max(self.peak_running, sum(e.n for e in self.sim.engines))
            self.answered.add(rid)
            if scored:
                self.scored.add(rid)
        actions = fn(*args) or []  # the sizer's observe returns None
        for action in actions:
            if isinstance(action, Submit):
                assert not self.owner.keys() & action.request_ids, "a request id was submitted twice"
                self.owner.update((rid, action.prompt.uid) for rid in action.request_ids)
            elif isinstance(action, Train):
                self.record_train(action)
        return actions

    def record_train(self, action: Train) -> None:
        for group in action.groups:
            self.trained_prompts[group.prompt.uid] += 1
            assert len(group.samples) == GROUP
            for sample in group.samples:
                rid = sample.completion.request_id
                assert self.owner[rid] == group.prompt.uid and rid in self.scored
                self.trained_requests[rid] += 1

    def unanswered_in_the_simulator(self) -> set[str]:
        """Requests still generating, or finished with their event still queued."""
        queued = {obj.rid if kind == SAMPLE else obj.request_id
                  for _, _, kind, obj, _ in self.sim.events if kind in (SAMPLE, ABORTED_OUT)}
        return set(self.sim.requests) | queued


@pytest.mark.parametrize("scheduler", ["sync", "tail", "sorted", "async"])
def test_ten_thousand_requests_in_flight_every_event_handled_once(scheduler):
    cfg = load_config(scheduler)
    sim = Simulation(cfg, cfg.runs()[0])
    recorder = Recorder(sim)
    sim.run()  # itself checks request accounting and the prompt ledger after every step

    assert recorder.peak_in_flight >= PROMPTS * GROUP and recorder.peak_running >= 9000  # at once, on the engines
    assert set(recorder.owner) - recorder.answered == recorder.unanswered_in_the_simulator()
    assert len(recorder.answered) >= STEPS * PROMPTS * GROUP
    ledger = sim.scheduler.ledger
    assert ledger.trained == STEPS * PROMPTS == sum(recorder.trained_prompts.values())
    assert ledger.drawn == ledger.trained + sum(ledger.dropped.values()) + sim.scheduler.in_flight_prompts()
    assert set(recorder.trained_prompts.values()) == {1}  # each prompt trained once (none drawn twice here)
    assert set(recorder.trained_requests.values()) == {1}  # and each sample once
