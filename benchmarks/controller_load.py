"""Can the controller keep up at scale? Its schedulers driven by the simulator's engines, timed alone.

    python benchmarks/controller_load.py [--prompts 12500] [--group-size 8] [--engines 40] [--steps 3]

By default 40 simulated engines of 256 sequences run up to 10,240 requests at once, and each step
trains 12,500 prompts x 8 samples: 100,000 completion events per step (more for schedulers that
over-draw and abort). Only the scheduler's own calls are timed (on_sample, on_abort, on_trained,
start and the group sizer), as the simulator does, so the figures are the controller's processing
cost per event, free of simulated time and of the simulator's own bookkeeping: wall time, and the
thread's CPU time beside it, which other jobs on a shared machine disturb less. Also reports its
targets, met or missed (timings: a test on a shared machine could only guess them), and writes
benchmarks/results/controller_load_cpu.json.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

from rlsys.bench import machine
from rlsys.control.events import Scored
from rlsys.sim.config import load_sim_config
from rlsys.sim.run import simulate
from rlsys.sim.simulator import Simulation

RESULTS = Path(__file__).resolve().parent / "results" / "controller_load_cpu.json"
SCHEDULERS = ["sync", "tail", "sorted", "async"]
EVENTS = ("on_sample", "on_abort")  # one call per completion or aborted request
TARGETS = {"controller_share_of_simulated_time": 0.01,  # the worst scheduler's calls: under 1%
           "quick_run_s": 5.0}  # QUICK_RUN simulates in under 5 s of wall time
QUICK_RUN = {"name": "quick", "steps": 5, "model": "qwen2.5-1.5b", "cluster": {"gpus": 4, "tp": 1},
             "workload": {"max_tokens": 4096, "median_tokens": 600},
             "control": {"prompts_per_step": 64, "group_size": 8}}


def load_config(prompts: int, group_size: int, engines: int, steps: int, schedulers: list[str]) -> dict:
    """Short responses (median 1,000 tokens) so that every engine can hold its 256 sequences."""
    runs = [{"name": s, "cluster": {"gpus": engines + engines // 4, "trainer_gpus": engines // 4}}
            if s == "async" else s for s in schedulers]  # async trains on GPUs of its own
    return {"name": "controller_load", "steps": steps, "schedulers": runs, "model": "qwen2.5-7b",
            "cluster": {"gpu": "h800", "gpus": engines, "tp": 1}, "engine": {"max_seqs": 256},
            "workload": {"max_tokens": 4096, "median_tokens": 1000, "dataset_size": 20 * prompts},
            "control": {"prompts_per_step": prompts, "group_size": group_size}}


class Probe:
    """Times each scheduler call by name, and samples how many requests are in flight."""

    def __init__(self, sim: Simulation):
        self.sim = sim
        self.seconds, self.calls, self.slowest = defaultdict(float), defaultdict(int), defaultdict(float)
        self.cpu_s = 0.0
        self.peak_in_flight = self.peak_running = self.delivered = 0
        self._deliver = sim._deliver
        sim._call, sim._deliver = self.call, self.deliver  # the loop looks them up on the instance

    def call(self, fn, *args):
        start, cpu = time.perf_counter(), time.thread_time()
        actions = fn(*args)
        spent = time.perf_counter() - start
        self.cpu_s += time.thread_time() - cpu
        name = fn.__name__
        if name == "handle":  # an event, named as the scheduler's method that takes it
            name = "on_sample" if isinstance(args[0], Scored) else "on_abort"
        self.seconds[name] += spent
        self.calls[name] += 1
        self.slowest[name] = max(self.slowest[name], spent)
        return actions

    def deliver(self, req) -> None:
        self.peak_in_flight = max(self.peak_in_flight, len(self.sim.scheduler.prompt_of))
        if self.delivered % 256 == 0:
            self.peak_running = max(self.peak_running, sum(e.n for e in self.sim.engines))
        self.delivered += 1
        self._deliver(req)


def measure(cfg, run) -> dict:
    sim = Simulation(cfg, run)
    probe = Probe(sim)
    wall = time.perf_counter()
    figures = sim.run()  # checks request accounting and the prompt ledger at the end
    wall = time.perf_counter() - wall
    events = sum(probe.calls[name] for name in EVENTS)
    controller_s = sum(probe.seconds.values())
    return {
        "steps": figures["steps"],
        "completion_events": events,
        "events_per_step": events / figures["steps"],
        "peak_requests_in_flight": probe.peak_in_flight,  # submitted and awaited by the scheduler
        "peak_requests_running": probe.peak_running,  # on the engines, sampled every 256 deliveries
        "controller_s": controller_s,
        "controller_us_per_event": 1e6 * controller_s / events,
        "events_per_s": events / controller_s,
        "controller_cpu_s": probe.cpu_s,
        "events_per_cpu_s": events / probe.cpu_s,
        "event_calls_us": {name: 1e6 * probe.seconds[name] / probe.calls[name] for name in EVENTS if probe.calls[name]},
        "slowest_call_ms": {name: 1e3 * s for name, s in probe.slowest.items()},
        "simulated_step_s": figures["step_time_s"],
        "needed_events_per_s": events / figures["sim_time_s"],  # to keep pace with the simulated cluster
        "controller_share_of_simulated_time": controller_s / figures["sim_time_s"],
        "simulator_wall_s": wall,
        "prompts": figures["prompts"],
    }


def targets(results: dict) -> dict:
    """Each target's limit, the measured value and whether it was met."""
    start = time.perf_counter()
    simulate(QUICK_RUN, quiet=True)
    measured = {"controller_share_of_simulated_time": max(r["controller_share_of_simulated_time"]
                                                          for r in results.values()),
                "quick_run_s": time.perf_counter() - start}
    return {name: {"max": TARGETS[name], "measured": value, "met": value < TARGETS[name]}
            for name, value in measured.items()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=12500, help="prompts per step")
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--engines", type=int, default=40, help="engines of 256 sequences each")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--schedulers", nargs="+", default=SCHEDULERS)
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    raw = load_config(args.prompts, args.group_size, args.engines, args.steps, args.schedulers)
    cfg = load_sim_config(raw)
    command = " ".join(["python benchmarks/controller_load.py"] + (sys.argv[1:] if argv is None else argv))
    report = {"machine": machine(), "command": command, "config": raw, "results": {}}
    print(f"{'scheduler':<10}{'events/step':>12}{'peak in flight':>15}{'peak running':>13}{'us/event':>9}"
          f"{'events/s':>10}{'events/cpu s':>13}{'needed/s':>9}{'slowest call ms':>16}")
    for run in cfg.runs():
        r = report["results"][run.label] = measure(cfg, run)
        print(f"{run.label:<10}{r['events_per_step']:>12,.0f}{r['peak_requests_in_flight']:>15,}"
              f"{r['peak_requests_running']:>13,}{r['controller_us_per_event']:>9.2f}{r['events_per_s']:>10,.0f}"
              f"{r['events_per_cpu_s']:>13,.0f}{r['needed_events_per_s']:>9,.0f}"
              f"{max(r['slowest_call_ms'].values()):>16.1f}")
    report["targets"] = targets(report["results"])
    for name, t in report["targets"].items():
        print(f"target {name} < {t['max']}: {t['measured']:.4g}, {'met' if t['met'] else 'MISSED'}")
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
