"""RollPacker's response-level rule (rlsys/sim/first_r.py): simulated only, to validate against RollPacker's rows."""
import pytest

from rlsys.config import ControlConfig
from rlsys.control.actions import Abort, Accumulate, Submit, Train
from rlsys.data.cursor import PromptCursor
from rlsys.sim.config import SimControlConfig, load_sim_config
from rlsys.sim.first_r import FirstRTail, build
from rlsys.sim.run import simulate
from rlsys.types import Completion, Prompt, ScoredSample


def scored(rid: str, uid: str, tokens: int) -> ScoredSample:
    return ScoredSample(Completion(rid, uid, [1], [2] * tokens, [-0.1] * tokens, [0] * tokens, "stop"), 1.0)


def of(actions, kind):
    return [a for a in actions if isinstance(a, kind)]


def test_first_r_keeps_each_prompts_first_r_finishers_and_aborts_the_rest():
    control = SimControlConfig(scheduler="tail", prompts_per_step=2, group_size=4, tail_eta_r=1.25)
    sched = build(control, PromptCursor([Prompt(f"p{i}", f"q{i}", str(i), index=i) for i in range(50)], seed=1))
    assert isinstance(sched, FirstRTail)
    submits = of(sched.start(0.0), Submit)
    # ceil(1.25 x 2) prompts, each ceil(1.25 x 4) = 5 samples: every prompt's first 4 queued ahead of the extras
    assert [len(s.request_ids) for s in submits] == [4, 4, 4, 1, 1, 1]
    ids = {s.prompt.uid: [] for s in submits}
    for s in submits:
        ids[s.prompt.uid] += s.request_ids
    first, second, third = ids
    # the first prompt's extra finishes first: it is in the group, the one still running is aborted
    order = [ids[first][4], ids[first][0], ids[first][2], ids[first][3]]
    for rid in order[:-1]:
        assert sched.on_sample(scored(rid, first, 10), 0.0) == []
    actions = sched.on_sample(scored(order[-1], first, 10), 0.0)
    [accumulate] = of(actions, Accumulate)
    assert [s.completion.request_id for s in accumulate.groups[0].samples] == order
    assert [a.request_ids for a in of(actions, Abort)] == [[ids[first][1]]]
    assert sched.on_sample(scored(ids[first][1], first, 10), 0.0) == []  # finished in flight: not trained
    # the second prompt completes the round: its slowest and the unfinished third prompt are aborted, the third deferred
    for rid in ids[second][:3]:
        sched.on_sample(scored(rid, second, 10), 0.0)
    actions = sched.on_sample(scored(ids[second][4], second, 10), 0.0)
    [train] = of(actions, Train)
    assert [len(g.samples) for g in train.groups] == [4, 4]
    aborted = sorted(rid for a in of(actions, Abort) for rid in a.request_ids)
    assert aborted == sorted([ids[second][3]] + ids[third])
    assert [d.prompt.uid for d in sched.queue] == [third]
    assert sched.metrics()["tail/aborted_samples"] == 1 + 6


def test_live_tail_refuses_the_response_level_rule():
    with pytest.raises(ValueError, match="control.tail.eta_r is gone"):
        ControlConfig(tail={"eta_r": 1.25})
    with pytest.raises(ValueError, match="tail_eta_r"):
        ControlConfig(tail_eta_r=1.25)  # the simulator's option is no live control field
    with pytest.raises(ValueError, match="tail_eta_r is RollPacker's response-level rule for the tail"):
        load_sim_config({"schedulers": [{"name": "sync", "control": {"tail_eta_r": 1.25}}]})


def test_first_r_trains_shorter_answers_than_whole_groups():
    """The bias the rule is refused for live: the same prompts' groups, without their slowest samples, are shorter."""
    cfg = {"steps": 4, "model": "qwen2.5-7b", "cluster": {"gpus": 8, "tp": 1},
           "workload": {"max_tokens": 8192, "median_tokens": 600},
           "control": {"prompts_per_step": 32, "group_size": 8},
           "schedulers": ["tail", {"name": "tail", "label": "first-r", "control": {"tail_eta_r": 1.25}}]}
    r = simulate(cfg, quiet=True)["results"]
    whole, first = r["tail"], r["first-r"]
    assert first["trained_samples"] == whole["trained_samples"]
    assert first["response_tokens"]["mean"] < 0.95 * whole["response_tokens"]["mean"]
    assert first["prompts"]["tail/aborted_samples"] > whole["prompts"]["tail/aborted_samples"]
