"""A simulated runaway (a sample that loops until the cap) stays one when it is resumed or regenerated, so that no
scheduler trains fewer of them by cutting long samples short (rlsys/sim/workload.py says why)."""
import pytest

from rlsys.control.actions import Abort, Train
from rlsys.control.scheduler import Scheduler
from rlsys.sim.config import load_sim_config
from rlsys.sim.run import simulate
from rlsys.sim.simulator import Simulation
from rlsys.types import Request

SAMPLES = 16
RUNAWAY_PRONE = {"max_tokens": 4096, "median_tokens": 300, "sigma": 0.5, "runaway_share": 0.3}


def small(**extra):
    cfg = {"name": "runaways", "steps": 1, "model": "qwen2.5-1.5b", "cluster": {"gpus": 1, "tp": 1},
           "workload": RUNAWAY_PRONE, "control": {"prompts_per_step": 1, "group_size": SAMPLES}}
    cfg.update(extra)
    return cfg


class CutThenGoOn(Scheduler):
    """One prompt's samples, all cut once the first has finished; then every other cut one is resumed with its
    tokens and the rest are regenerated from scratch; one Train when all are back."""

    def start(self, now):
        if self.version:
            return []
        self.prompt = self.draw(1)[0]
        self.finished, self.partials, self.resumed_from = [], [], {}
        return [self.submit(self.prompt, SAMPLES)]

    def on_sample(self, sample, now):
        self.finish(sample.completion.request_id)
        self.finished.append(sample.completion)
        if len(self.finished) == 1:
            return [Abort(sorted(self.prompt_of))]
        return [Train([])] if len(self.finished) == SAMPLES else []

    def on_abort(self, completion, now):
        self.finish(completion.request_id)
        self.partials.append(completion)
        if len(self.partials) < SAMPLES - 1:
            return []
        resumes = [c for c in self.partials if c.num_tokens][::2]
        fresh = SAMPLES - 1 - len(resumes)
        action = self.submit(self.prompt, fresh + len(resumes))
        for rid, c in zip(action.request_ids[fresh:], resumes):
            action.resume[rid] = Request(rid, c.prompt_uid, c.prompt_ids, **c.resume_fields())
            self.resumed_from[rid] = c
        self.regenerated_from = [c for c in self.partials if c not in resumes]
        self.ledger.drop("sketch")
        return [action]

    def in_flight_prompts(self):
        return len(self.prompt_of)


def test_a_cut_runaway_runs_away_again_resumed_or_regenerated():
    cfg = load_sim_config(small())
    sim = Simulation(cfg, cfg.runs()[0])
    s = sim.scheduler = CutThenGoOn(sim.scheduler.cfg, sim.scheduler.cursor, sim.scheduler.sizer)
    sim.run()
    cap = cfg.workload.max_tokens
    drawn = sim.workload.samples(s.prompt, 0, SAMPLES)  # the first draws: common random numbers by ordinal
    first_draw = lambda partial: drawn[partial.token_ids[0]]  # noqa: E731  a cut sample's tokens name its ordinal
    final = {c.request_id: c for c in s.finished}
    assert len(s.resumed_from) >= 3 and len(s.regenerated_from) >= 3
    # resumed: the same sample goes on to its own length, at the cap if it was a runaway
    resumed = [(final[rid], first_draw(c)) for rid, c in s.resumed_from.items()]
    assert any(d.truncated for _, d in resumed) and any(not d.truncated for _, d in resumed)
    for c, d in resumed:
        assert c.num_tokens == d.length and (c.finish_reason == "length") == d.truncated
    # regenerated: each cut runaway's replacement runs to the cap too, whatever its own coin
    regenerated = [final[rid] for rid in final if rid not in s.resumed_from and rid.endswith(
        tuple(f"#{n}" for n in range(SAMPLES, 2 * SAMPLES)))]
    cut_runaways = sum(first_draw(c).truncated for c in s.regenerated_from)
    assert cut_runaways > 0 and len(regenerated) == len(s.regenerated_from)
    assert sum(c.num_tokens == cap for c in regenerated) >= cut_runaways


def test_a_new_visit_of_a_prompt_samples_afresh():
    """Samples cut in one visit of a prompt (tail's extras of a complete prompt) are replaced by none of the
    prompt's next visit: it is sampled afresh."""
    cfg = load_sim_config(small(workload={**RUNAWAY_PRONE, "dataset_size": 1}))
    sim = Simulation(cfg, cfg.runs()[0])
    prompt = sim.workload.prompts()[0]
    sim.cut[prompt.uid][0] = sim.workload.samples(prompt, 0, 1)[0]._replace(length=4096, truncated=True)
    assert sim.scheduler.cursor.take(1) == [prompt] and prompt.uid not in sim.cut


@pytest.mark.parametrize("run", [{"name": "sorted", "control": {"sorted": {"mode": "partial", "max_versions": 2}}},
                                 {"name": "tail"}])
def test_schedulers_that_cut_long_samples_train_runaways_as_sync_does(run):
    """Sorted's partial rollouts resume and regenerate long samples, tail's long round regenerates them; each
    trains about sync's share of runaways, not the fewer that drawing their coins again gave."""
    cfg = small(steps=6, cluster={"gpus": 4, "tp": 1}, engine={"max_seqs": 16},
                workload={**RUNAWAY_PRONE, "runaway_share": 0.05},
                control={"prompts_per_step": 16, "group_size": 4},
                schedulers=["sync", {**run, "label": "x"}])
    r = simulate(cfg, quiet=True)["results"]
    sync, x = r["sync"]["truncated_share"], r["x"]["truncated_share"]
    assert x > 0.6 * sync > 0


def test_the_simulator_shows_the_length_account_every_sample_it_aborts():
    """The simulator drives a scheduler as the live controller does (Scheduler.handle): the samples tail aborts
    reach length/selection as generated and not trained, and tail still trains what it generates, prompt by prompt."""
    cfg = load_sim_config(small(steps=6, cluster={"gpus": 4, "tp": 1}, engine={"max_seqs": 16},
                                workload={**RUNAWAY_PRONE, "runaway_share": 0.05},
                                control={"prompts_per_step": 8, "group_size": 4, "tail": {"eta_p": 1.5}},
                                schedulers=[{"name": "tail"}]))
    sim = Simulation(cfg, cfg.runs()[0])
    sim.run()
    selection = sim.scheduler.selection
    assert sum(selection.dropped.values()) > 0  # the aborted prompts' samples were seen
    assert sim.scheduler.metrics()["length/selection_run"] == pytest.approx(1.0, abs=0.05)
