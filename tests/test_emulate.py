"""Live runs on a GPU's clock: one cost model for the simulator and the pacers, paced steps never end before their
modelled time, and the overrun share that says whether a run emulated."""
import json
import threading
import time
import typing
from pathlib import Path

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from rlsys import costs
from rlsys.config import ConfigError, EmulateConfig
from rlsys.emulate import Budget, Emulation, EnginePacer, GPUTimeline, Overruns, Pacer
from rlsys.placement import lent_engines
from rlsys.rollout.builtin_engine import CPUEngine
from rlsys.rollout.worker import RolloutWorker
from rlsys.sim.config import load_sim_config
from rlsys.sim.simulator import Simulation
from rlsys.startup import load_config
from rlsys.trainer.backend import TorchBackend
from rlsys.trainer.batching import StepTotals, build_samples, pack_micro_batches, plan_step
from rlsys.trainer.logprobs import Scoring
from rlsys.types import Request, SamplingParams

from test_trainer import make_groups, model_dir, trainer_config  # noqa: F401 - the module fixture

H100_7B = EmulateConfig(gpu="h100", model="qwen2.5-7b", time_scale=2.0, tokens_per_token=4, trainer_gpus=8)


def test_the_config_names_the_cost_models_gpus_and_models():
    assert set(typing.get_args(typing.get_args(EmulateConfig.model_fields["gpu"].annotation)[0])) == set(costs.GPUS)
    assert set(typing.get_args(EmulateConfig.model_fields["model"].annotation)) == set(costs.MODELS)


def test_the_simulator_and_the_pacers_take_the_same_costs():
    cfg = load_sim_config({"model": "qwen2.5-7b", "cluster": {"gpu": "h100", "gpus": 8, "tp": 1}})
    sim = Simulation(cfg, cfg.runs()[0])
    emulation = Emulation(H100_7B)
    assert cfg.engine_cost(cfg.cluster) == emulation.engine_cost  # every field: weights, KV, prefill, overhead
    assert sim.sync_s == emulation.sync_s
    # The simulator's step of 1,000 tokens on 8 GPUs is the pacer's micro-batch of 1,000 / k tokens on them
    pacer = emulation.trainer_pacer(world_size=1)
    flops = cfg.trainer.flops_per_param_token
    assert sim._gpu_s(1000) / 8 == pytest.approx(pacer.micro_batch_s(1000 / H100_7B.tokens_per_token, flops))
    # A decode step of the engine pacer with k = 1 is the simulated engine's step at the same batch and KV
    one = EnginePacer(1.0, cost=emulation.engine_cost, k=1)
    assert one.step_s(0, 32, 20_000) == emulation.engine_cost.step_s(32, 20_000)
    assert one.step_s(100, 0, 0) == 100 * emulation.engine_cost.prefill_s_per_token


def test_k_tokens_per_token_are_k_decode_steps_of_the_emulated_model():
    cost = Emulation(H100_7B).engine_cost
    k, n, kv = 4, 8, 1000
    steps = sum(cost.step_s(n, k * kv + j * n) for j in range(k))  # its KV grows by n a step
    assert EnginePacer(1.0, cost=cost, k=k).step_s(0, n, kv) == pytest.approx(steps)


def test_a_prompt_stands_for_its_own_emulated_length_not_k_times_its_tokens():
    """emulate.prompt_tokens: long-CoT RL's prompts are a few hundred tokens whatever the response cap."""
    cost, k, P = Emulation(H100_7B).engine_cost, 4, 300
    scaled, own = EnginePacer(1.0, cost=cost, k=k), EnginePacer(1.0, cost=cost, k=k, prompt_tokens=P)
    # two prompts of 9 and 5 tokens prefilled with 3 resumed response tokens; then two sequences decoding over
    # those prompts and 10 response tokens
    assert own.step_s(17, 0, 0, prompts=2, prompt_prefill=14) == pytest.approx((2 * P + k * 3) * cost.prefill_s_per_token)
    assert scaled.step_s(17, 0, 0, prompts=2, prompt_prefill=14) == pytest.approx(k * 17 * cost.prefill_s_per_token)
    assert own.step_s(0, 2, 24, prompt_kv=14) == pytest.approx(k * cost.step_s(2, 2 * P + k * 10 + 2 * (k - 1) / 2))
    assert scaled.step_s(0, 2, 24, prompt_kv=14) == scaled.step_s(0, 2, 24)  # k a token, prompt or not
    emulation = Emulation(EmulateConfig(gpu="h100", model="qwen2.5-1.5b", tokens_per_token=k, prompt_tokens=P,
                                        trainer_gpus=1))
    trainer = emulation.trainer_pacer(1)
    assert emulation.engine_pacer().prompt_tokens == trainer.prompt_tokens == P
    assert trainer.micro_batch_s(40, 6, prompts=2, prompt_tokens=14) == pytest.approx(
        costs.train_gpu_seconds(emulation.model, emulation.gpu, 2 * P + k * 26, costs.TRAIN_MFU, 6))


def test_a_hold_never_ends_before_its_modelled_time_and_counts_overruns():
    pacer = Pacer(time_scale=3.0)
    for modelled in (0.001, 0.01, 0.02):
        started = time.perf_counter()
        pacer.hold(started, modelled)
        assert time.perf_counter() - started >= modelled * 3.0
    assert pacer.counts() == {"held": 3, "overruns": 0, "overrun_s": 0.0, "switch_s": 0.0}
    started = time.perf_counter() - 1.0  # the real work took a second, 0.7 s of wall time past its 0.3
    pacer.hold(started, 0.1)
    counts = pacer.counts()
    assert counts["held"] == 4 and counts["overruns"] == 1
    assert 0.7 / 3.0 <= counts["overrun_s"] < 0.8 / 3.0  # in the run's seconds: wall over the time scale


def test_overrun_share_per_step_and_over_the_run():
    tally = Overruns(limit=0.05)
    step = tally.step([{"held": 90, "overruns": 0, "overrun_s": 0.0}, {"held": 10, "overruns": 1, "overrun_s": 0.5}])
    assert step == {"emulate/overrun_share": 0.01, "emulate/held": 100, "emulate/overrun_s": 0.5}
    assert tally.summary() == {"emulate/overrun_share": 0.01, "emulate/emulating": True, "emulate/overrun_s": 0.5}
    step = tally.step([{"held": 100, "overruns": 10, "overrun_s": 2.0},  # cumulative counts
                       {"held": 100, "overruns": 1, "overrun_s": 0.5}])
    assert step == {"emulate/overrun_share": 0.1, "emulate/held": 100, "emulate/overrun_s": 2.0}
    assert tally.summary() == {"emulate/overrun_share": 11 / 200, "emulate/emulating": False, "emulate/overrun_s": 2.5}


def test_config_refuses_emulation_it_cannot_pace(tmp_path):
    with pytest.raises(ConfigError, match="emulate.gpu"):
        load_config(None, ["emulate.gpu=v100"])
    with pytest.raises(ConfigError, match="rollout.engine=cpu"):
        load_config(None, ["emulate.gpu=h100", "rollout.engine=vllm"])
    with pytest.raises(ConfigError, match="emulate.time_scale"):
        load_config(None, ["emulate.gpu=h100", "emulate.time_scale=0"])


@pytest.fixture(scope="module")
def engine_dir(tmp_path_factory):
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("engine") / "model"
    Qwen2ForCausalLM(Qwen2Config(vocab_size=64, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=2, intermediate_size=128, max_position_embeddings=256)
                     ).save_pretrained(path)
    return str(path)


def test_each_engine_step_lasts_its_modelled_time(engine_dir):
    pacer = Emulation(H100_7B).engine_pacer()
    engine = CPUEngine(engine_dir, slots=4, pacer=pacer)
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8], [9, 10]]
    for i, p in enumerate(prompts):
        engine.add(Request(f"r{i}", "p", p, SamplingParams(max_new_tokens=6, temperature=0.0)))
    cost, k, scale = pacer.cost, pacer.k, pacer.time_scale
    # Step 1 prefills every prompt: the token it samples stands for k emulated ones, the first from the prefill,
    # the other k - 1 decoded over the prompts' KV (k steps charged, one too many, as the simulator charges a
    # request of n tokens n decode steps); then each step decodes the three over a KV one longer. A request of
    # 6 tokens takes 6 paced steps, 6 k emulated decode steps.
    expected = [k * sum(map(len, prompts)) * cost.prefill_s_per_token
                + k * cost.step_s(3, k * sum(map(len, prompts)) + 3 * (k - 1) / 2)]
    expected += [k * cost.step_s(3, k * sum(len(p) + s for p in prompts) + 3 * (k - 1) / 2) for s in range(1, 6)]
    for modelled in expected:
        started = time.perf_counter()
        engine.step()
        assert time.perf_counter() - started >= modelled * scale
    assert engine.stats()["emulate"]["held"] == 6  # overruns depend on the machine: the run reports them
    assert engine.counters.active_slot_steps == 3 * 6  # the prefill's step keeps their slots busy too (bubble)
    assert not engine.step() and not engine.has_work()  # the sixth token ended every request last step


def test_requests_off_the_clock_are_not_held_and_cost_a_shared_step_nothing(engine_dir):
    """Eval runs while the run's clock is paused: its requests are not paced; a step they share with training's
    is held for the training request alone."""
    pacer = Emulation(H100_7B).engine_pacer()
    pacer.time_scale = 1.0  # modelled seconds far beyond this machine's step, so holding would show
    held = []
    real_step = pacer.step
    pacer.step = lambda *args, interrupt=None, **prompt: (held.append((*args[1:], prompt)),  # then the real hold
                                                          real_step(*args, interrupt=interrupt, **prompt))
    engine = CPUEngine(engine_dir, slots=4, pacer=pacer)
    greedy = SamplingParams(max_new_tokens=4, temperature=0.0)
    engine.add(Request("eval/a", "p", [1, 2, 3], greedy, on_clock=False))
    engine.add(Request("eval/b", "p", [4, 5], greedy, on_clock=False))
    started = time.perf_counter()
    while engine.has_work():
        engine.step()
    assert held == [] and engine.stats()["emulate"]["held"] == 0
    assert time.perf_counter() - started < 4 * pacer.step_s(5, 2, 5)  # four held steps at the least, had they been
    engine.add(Request("eval/c", "p", [1, 2, 3, 4], greedy, on_clock=False))
    engine.add(Request("train", "p", [4, 5], greedy))
    started = time.perf_counter()
    engine.step()
    engine.step()
    # The training prompt's 2 tokens prefilled and the rest of its prefill token decoded over them, then its one
    # sequence decoding over its own KV (read after the step's record: prompt + sampled - 1); the eval request's
    # 4 prompt tokens and its KV are in neither. Of each, the prompt's share: one prompt of 2 tokens prefilled, then
    # none, its 2 tokens in the KV read both times.
    assert held == [(2, 1, 2, {"prompts": 1, "prompt_prefill": 2, "prompt_kv": 2}),
                    (0, 1, 3, {"prompts": 0, "prompt_prefill": 0, "prompt_kv": 2})]
    assert engine.stats()["emulate"]["held"] == 2
    assert time.perf_counter() - started >= pacer.step_s(2, 1, 2) + pacer.step_s(0, 1, 3)


def test_work_cut_short_frees_its_gpus_but_not_a_place_reserved_after_it(tmp_path):
    timeline = GPUTimeline(str(tmp_path / "gpus.bin"))
    assert timeline.reserve((0, 1), 100.0, 10.0) == 100.0  # until 110 on both
    assert timeline.reserve((1,), 101.0, 5.0) == 110.0  # GPU 1 next: 110 to 115, timed from the first's end
    timeline.shorten((0, 1), until=110.0, to=104.0)
    assert timeline.reserve((0,), 100.0, 1.0) == 104.0  # GPU 0 free from the cut
    assert timeline.reserve((1,), 100.0, 1.0) == 115.0  # GPU 1's later work keeps its place


def test_an_abort_lands_one_emulated_decode_step_into_a_held_step_and_ends_it_if_nothing_is_left(engine_dir, tmp_path):
    """A paced step stands for k decode steps of the emulated model, and a real engine takes an abort between two
    of them: the aborted requests leave the step 1/k into its hold with none of its tokens. The others hold to its
    end; if none is left (a tail round's end) the step ends there and its GPU is free from then."""
    timeline = GPUTimeline(str(tmp_path / "gpus.bin"))
    pacer = Emulation(H100_7B).engine_pacer()
    pacer.k, pacer.timeline, pacer.on_gpus = 64, timeline, (0,)
    hold_s = 1.5
    pacer.time_scale = hold_s / pacer.step_s(0, 1, 10)  # every step holds 1.5 s or more
    worker = RolloutWorker(engine_dir, slots=2, torch_threads=1, engine_kwargs={"pacer": pacer})
    params = SamplingParams(max_new_tokens=50, temperature=0.0)

    def mid_hold_after(tokens):
        """Inside the hold of the step after the one that gave the running requests `tokens` tokens in all."""
        deadline = time.monotonic() + 60
        while sum(len(e.tokens) for e in list(worker.engine.running.values())) < tokens:
            assert time.monotonic() < deadline, "the engine made no tokens"
            time.sleep(0.01)
        time.sleep(hold_s / 3)  # past the step's compute, well inside its hold

    def abort(rid):
        """The abort's seconds; the GPU's reservation after it."""
        began = time.perf_counter()
        assert worker.abort([rid]) == [rid]
        return time.perf_counter() - began, timeline.reserve((0,), 0.0, 0.0)

    try:
        worker.submit([Request(rid, "p", [1, 2, 3], params) for rid in ("a", "b")])
        mid_hold_after(2)  # step 2's: a and b have a token each
        # the rest of the hold is at least hold_s / 3; one emulated decode step of it, hold_s / 64, plus the call
        seconds, taken_until = abort("a")
        assert seconds < hold_s / 6 and taken_until > time.perf_counter() + hold_s / 6  # b holds the GPU on
        [a] = worker.drain()
        assert a.request_id == "a" and a.finish_reason == "abort" and len(a.token_ids) == 1  # none of step 2's

        mid_hold_after(2)  # b alone, its 2 tokens, in step 3's hold
        seconds, taken_until = abort("b")
        assert seconds < hold_s / 6 and taken_until <= time.perf_counter()  # free from the cut, not the hold's end
        [b] = worker.drain()
        assert b.finish_reason == "abort" and len(b.token_ids) == 2

        worker.submit([Request("c", "p", [1, 2, 3], params)])
        mid_hold_after(1)  # c's step 2
        worker.submit([Request("d", "p", [1, 2, 3], params)])  # an op that must not land inside a step
        seconds, _ = abort("c")
        assert seconds > hold_s / 6  # queued behind the submit, the abort waits for the step's end with it
    finally:
        worker.stop()


def test_an_abort_lands_no_sooner_than_one_emulated_decode_step_and_the_gpu_stays_taken_until_then(tmp_path):
    """The bound the test above sets from above, set from below: woken inside a hold of k decode steps, the abort
    lands hold/k later (between two of them), not at once, and the GPU is reserved until it lands."""
    from rlsys.emulate import ENGINE, Interrupt

    timeline = GPUTimeline(str(tmp_path / "gpus.bin"))
    pacer = Pacer(time_scale=1.0, timeline=timeline, on_gpus=(0,), holder=ENGINE)
    hold_s, k = 2.0, 4
    landed = []
    interrupt = Interrupt(lambda: landed.append(time.perf_counter()) and False)  # nothing left: the step ends
    started = time.perf_counter()
    held = []
    thread = threading.Thread(target=lambda: held.append(pacer.hold(started, hold_s, interrupt, grain=k)))
    thread.start()
    time.sleep(0.1)
    woken = time.perf_counter()
    interrupt.wake()
    thread.join(timeout=30)
    [(_, ended)] = held
    assert landed[0] >= woken + hold_s / k  # one emulated decode step after the wake
    assert woken + hold_s / k <= ended < started + hold_s  # the step ended there, before its hold's end
    assert timeline.reserve((0,), woken, 0.0) == ended  # the GPU was taken until the abort landed, free from then


def test_each_trainer_micro_batch_lasts_its_modelled_time(model_dir):  # noqa: F811
    backend = TorchBackend(trainer_config(), model_dir, Scoring(1.0))
    emulated = EmulateConfig(gpu="h100", model="qwen2.5-1.5b", time_scale=1.0, tokens_per_token=40, trainer_gpus=1)
    backend.pacer = Emulation(emulated).trainer_pacer(world_size=1)
    samples = build_samples(make_groups(0), "grpo")
    _, totals = plan_step(samples, 1, 48)
    batches = pack_micro_batches(samples, 48)
    modelled = [backend.pacer.micro_batch_s(sum(s.num_tokens for s in b), costs.TRAIN_FLOPS) for b in batches]
    assert len(batches) > 1 and min(modelled) > 0.01
    started = time.perf_counter()
    metrics = backend.train_step(samples, totals)
    assert time.perf_counter() - started >= sum(modelled)
    assert metrics["emulate_held"] == len(batches) and 0 <= metrics["emulate_overruns"] <= len(batches)
    # An empty micro-batch (padding; the boundary DeepSpeed closes before each streamed update) is not held:
    # modelled at no time, it would count as an overrun every time.
    backend.accumulate_gradients([], StepTotals(1, 1, 1), closes_step=False)
    assert backend.pacer.counts() == {"held": metrics["emulate_held"], "overruns": metrics["emulate_overruns"],
                                      "overrun_s": metrics["emulate_overrun_s"], "lent_held": 0, "switch_s": 0.0}


@pytest.mark.slow
def test_an_emulated_run_reports_its_overrun_share_and_label(tmp_path, ray_cluster):
    from rlsys.cli import main
    from rlsys.config import DEFAULT_CONFIG

    out = tmp_path / "run"
    # A time scale far too small for this machine: real compute overruns nearly every modelled step.
    assert main(["train", str(DEFAULT_CONFIG), "trainer.total_steps=2", f"output_dir={out}",
                 "control.prompts_per_step=4", "control.group_size=4", "data.eval_size=8", "rollout.slots=16",
                 "rollout.max_new_tokens=32", "model.warm_start.steps=30", "logging.progress=false",
                 "emulate.gpu=h100", "emulate.time_scale=0.001", "control.eval_every=0"]) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "timing/train_s" in r]
    assert len(steps) == 2 and all(r["emulate/overrun_share"] > 0.5 and r["emulate/held"] > 0 for r in steps)
    final = rows[-1]
    assert final["final"] and final["emulate/emulating"] is False and final["emulate/overrun_share"] > 0.05
    assert final["emulate/label"] == rows[0]["emulate/label"] == "emulated h100/qwen2.5-7b"
    assert final["emulate/time_scale"] == 0.001 and final["emulate/tokens_per_token"] == 1
    # The run's clock is emulated: wall seconds over the time scale
    assert steps[-1]["time_s"] > 100


def test_the_simulator_replays_a_live_runs_lengths(tmp_path):
    from pathlib import Path

    from rlsys.config import save_config
    from rlsys.data.cursor import PromptCursor
    from rlsys.sim.replay import replay_config

    repo = Path(__file__).resolve().parent.parent
    save_config(load_config(repo / "configs" / "emulated_h100_7b.yaml", ["trainer.total_steps=2"]),
                tmp_path / "config.yaml")
    k, prompts, group = 64, 16, 8
    # Request ids count the run's requests: prompt p was drawn p-th. Rows come in finish order, the last drawn
    # prompts' first, each prompt's samples last-submitted first.
    timeline = [{"step": 1 + p // prompts, "request_id": f"train-{90 - p}#{p * group + i}",
                 "tokens": 1 + (p * 7 + i) % 40, "prompt_tokens": 9, "finish_reason": "stop"}
                for p in reversed(range(2 * prompts)) for i in reversed(range(group))]
    timeline.append({"step": 2, "request_id": "train-90#999", "tokens": 3, "prompt_tokens": 9,
                     "finish_reason": "abort"})
    (tmp_path / "timeline.jsonl").write_text("".join(json.dumps(r) + "\n" for r in timeline))
    cfg, workload = replay_config(tmp_path)
    assert cfg.steps == 2 and cfg.workload.max_tokens == k * 128 and cfg.workload.prompt_tokens == k * 9
    assert cfg.cluster.gpu == "h100" and cfg.engine.max_seqs == 32
    assert cfg.cluster.gpus == 2 and cfg.cluster.trainer_gpus is None  # the trainer on the two engines' GPUs
    # The simulator's cursor draws, j-th, the prompt the run drew j-th, whose samples come in submission order
    drawn = PromptCursor(workload.prompts(), seed=cfg.seed).take(2 * prompts)
    assert [[d.length for d in workload.samples(prompt, 0, group)] for prompt in drawn] == [
        [k * (1 + (p * 7 + i) % 40) for i in range(group)] for p in range(2 * prompts)]
    result = Simulation(cfg, cfg.runs()[0], workload).run()
    live = [r["tokens"] for r in timeline if r["finish_reason"] != "abort"]
    assert result["response_tokens"]["mean"] == pytest.approx(k * sum(live) / len(live))  # sync trains them all


def test_a_replay_gives_each_request_the_length_of_the_live_request_of_its_rank(tmp_path):
    """Tail: a prompt's short round of 10 (8 finished, 2 extras aborted) and its long round of 8 regenerated; a
    prompt whose every request was aborted was drawn all the same, so the prompts after it keep their places."""
    from pathlib import Path

    from rlsys.config import save_config
    from rlsys.data.cursor import PromptCursor
    from rlsys.sim.replay import replay_config

    repo = Path(__file__).resolve().parent.parent
    save_config(load_config(repo / "configs" / "emulated_h100_7b.yaml", ["control.scheduler=tail"]),
                tmp_path / "config.yaml")
    row = lambda rid, tokens, reason="stop": {"step": 1, "request_id": rid, "tokens": tokens,  # noqa: E731
                                               "prompt_tokens": 9, "finish_reason": reason}
    timeline = ([row(f"train-5#{i}", 10 + i) for i in range(8)] + [row("train-5#8", 7, "abort"),
                row("train-5#9", 30, "abort")] + [row(f"train-3#{10 + i}", 2, "abort") for i in range(10)]
                + [row("train-8#20", 4)] + [row(f"train-5#{30 + i}", 40 + i) for i in range(8)])
    (tmp_path / "timeline.jsonl").write_text("".join(json.dumps(r) + "\n" for r in timeline))
    cfg, workload = replay_config(tmp_path)
    first, aborted, last = PromptCursor(workload.prompts(), seed=cfg.seed).take(3)
    lengths = lambda prompt, start, n: [d.length for d in workload.samples(prompt, start, n)]  # noqa: E731
    k = 64
    assert lengths(first, 0, 8) == [k * (10 + i) for i in range(8)]
    assert lengths(first, 8, 2) == [k * 47, k * 47]  # as long as its longest finished, and past its partial output
    assert lengths(first, 10, 8) == [k * (40 + i) for i in range(8)]  # the long round's own
    assert lengths(aborted, 0, 1) == [k * 2 + 1] and lengths(last, 0, 1) == [k * 4]


def test_a_replay_of_async_gives_the_trainer_its_budgets_gpus_and_its_proximal_forwards(tmp_path):
    from pathlib import Path

    from rlsys.config import save_config
    from rlsys.sim.replay import replay_config

    repo = Path(__file__).resolve().parent.parent
    config = repo / "configs" / "emulated_h100_7b.yaml"
    (tmp_path / "timeline.jsonl").write_text(json.dumps(
        {"step": 1, "request_id": "p0#0", "tokens": 5, "prompt_tokens": 9, "finish_reason": "stop"}) + "\n")
    save_config(load_config(config, ["control.scheduler=async", "trainer.loss=decoupled_ppo", "emulate.layout=separate",
                                     "emulate.gpus=4"]), tmp_path / "config.yaml")
    cfg, _ = replay_config(tmp_path)
    assert cfg.cluster.gpus == 4 and cfg.cluster.trainer_gpus == 2  # the same budget: 2 engine GPUs, 2 trainer GPUs
    assert cfg.trainer.zero_stage == 2  # the live trainer's, by which its states shard
    # 4 mini-batches of stale samples: pi_prox recomputed for the last 3 (trainer.proximal=recompute)
    assert cfg.trainer.flops_per_param_token == costs.TRAIN_FLOPS + costs.FORWARD_FLOPS * 3 / 4
    # Colocated, async contends for its GPUs: the trainer on all, beside the engines (resident: they generate while
    # it trains, so they cannot sleep)
    save_config(load_config(config, ["control.scheduler=async", "trainer.loss=decoupled_ppo", "emulate.gpus=8",
                                     "rollout.num_workers=8"]), tmp_path / "config.yaml")
    cfg, _ = replay_config(tmp_path)
    assert cfg.cluster.gpus == 8 and cfg.cluster.trainer_gpus is None and cfg.cluster.colocation == "resident"


def gpu_run_folder(path):
    """A run folder of configs/gpu/bench_0.5b.yaml's (answers up to 512) with one step of 8 prompts x 8, answers of
    50 to 470 tokens; its config back."""
    from pathlib import Path

    from rlsys.config import save_config

    cfg = load_config(Path(__file__).resolve().parent.parent / "configs" / "gpu" / "bench_0.5b.yaml",
                      ["rollout.max_new_tokens=512"])
    save_config(cfg, path / "config.yaml")
    timeline = [{"step": 1, "request_id": f"train-{p}#{p * 8 + i}", "tokens": 50 + 60 * i, "prompt_tokens": 20,
                 "finish_reason": "stop"} for p in range(8) for i in range(8)]
    (path / "timeline.jsonl").write_text("".join(json.dumps(r) + "\n" for r in timeline))
    return cfg


def test_a_replay_of_a_run_on_a_real_gpu_models_its_built_in_engine_and_compares(tmp_path):
    from rlsys.sim.replay import live_vs_sim, replay_config

    gpu_run_folder(tmp_path)
    with pytest.raises(ValueError, match="not an emulated run"):
        replay_config(tmp_path)
    cfg, workload = replay_config(tmp_path, gpu="h100")
    assert cfg.cluster.gpu == "h100" and cfg.cluster.gpus == 1 and cfg.cluster.trainer_gpus is None  # colocated
    assert cfg.shape().params == pytest.approx(0.4725e9, rel=1e-3) and cfg.shape().head_dim == 64
    assert cfg.engine.step_overhead_ms == costs.BUILTIN_ENGINE["overhead_s"] * 1e3
    assert cfg.engine.decode_mfu == costs.BUILTIN_ENGINE["decode_mfu"] and cfg.workload.max_tokens == 512  # k = 1
    # its attention padded to the longest sequence, up to the run's prompt budget and response cap
    assert cfg.engine.padded_key_us == pytest.approx(costs.BUILTIN_ENGINE["key_s"] * 1e6)
    assert cfg.engine_cost(cfg.cluster).max_len == 128 + 512
    metrics = {"step": 1, "timing/step_s": 9.0, "timing/rollout_s": 6.0, "timing/reward_s": 0.1, "timing/train_s": 2.0,
               "timing/weight_sync_s": 0.03, "rollout/bubble_ratio": 0.5}
    (tmp_path / "metrics.jsonl").write_text(json.dumps(metrics) + "\n")
    out = live_vs_sim(tmp_path, gpu="h100")
    # the longest answer, 470 tokens, decodes one step at a time at the profile's fixed cost a step at least
    assert out["rollout_time_s"]["live"] == 6.0
    assert 470 * costs.BUILTIN_ENGINE["overhead_s"] < out["rollout_time_s"]["sim"] < 470 * 20e-3
    assert 0 < out["bubble_ratio"]["sim"] < 1


def test_a_replay_with_the_runs_own_step_cost_charges_its_measured_decode_step(tmp_path):
    """benchmarks/gpu/sim_vs_gpu.py --step-cost-from-run: the profile's fixed cost moved so that a full batch at the
    run's mean length (its longest halfway through the longest answer) costs the run's median
    rollout/decode_step_ms; the replay's rollout follows it."""
    import importlib.util
    from pathlib import Path

    from rlsys.sim.replay import built_model_shape, live_vs_sim

    script = Path(__file__).resolve().parent.parent / "benchmarks" / "gpu" / "sim_vs_gpu.py"
    spec = importlib.util.spec_from_file_location("sim_vs_gpu", script)
    sim_vs_gpu = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sim_vs_gpu)
    cfg = gpu_run_folder(tmp_path)
    metrics = [{"step": s, "timing/step_s": 9.0, "timing/rollout_s": 6.0, "timing/reward_s": 0.1,
                "timing/train_s": 2.0, "timing/weight_sync_s": 0.03, "rollout/bubble_ratio": 0.5,
                "rollout/decode_step_ms": ms, "response_length/mean": 260.0, "response_length/max": 470.0}
               for s, ms in ((1, 14.0), (2, 15.0), (3, 30.0))]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
    engine = sim_vs_gpu.run_step_cost(tmp_path, "h100")
    full = costs.EngineCost.build(built_model_shape(cfg), costs.GPUS["h100"], tp=1, **engine, max_len=128 + 512)
    assert full.step_s(64, 64 * (260 / 2 + 128 / 2), 470 / 2 + 128) == pytest.approx(15e-3)  # the median, not the mean
    builtin = live_vs_sim(tmp_path, gpu="h100")["rollout_time_s"]["sim"]
    measured = live_vs_sim(tmp_path, gpu="h100", engine=engine)["rollout_time_s"]["sim"]
    assert measured > 1.5 * builtin and 470 * 10e-3 < measured < 470 * 20e-3


# --- one GPU budget ------------------------------------------------------------------------------
def emulated(*overrides):
    return load_config(Path(__file__).resolve().parent.parent / "configs" / "emulated_h100_7b.yaml", list(overrides))


def test_the_budget_places_engines_and_trainer_on_the_modelled_gpus_and_refuses_more_than_it_has():
    assert Emulation.of(emulated()).budget == Budget(2, "colocated", ((0,), (1,)), (0, 1))
    split = Emulation.of(emulated("emulate.layout=separate", "rollout.num_workers=1", "emulate.model=qwen2.5-1.5b"))
    assert split.budget == Budget(2, "separate", ((0,),), (1,))
    assert split.trainer_pacer(1).gpus == 1 and split.describe()["emulate/gpus"] == 2
    assert Emulation.of(emulated("emulate.gpus=4", "trainer.world_size=2")).budget.trainer_rank(1, 2) == (2, 3)
    with pytest.raises(ConfigError, match=r"emulate.layout=separate: rollout.num_workers=2 x emulate.tp=1 = 2 GPUs "
                                          r"plus at least 1 for the trainer need more than emulate.gpus=2"):
        emulated("emulate.layout=separate")
    with pytest.raises(ConfigError, match="remove emulate.trainer_gpus"):
        emulated("emulate.trainer_gpus=1")
    # Without emulate.gpus every part has GPUs of its own, and the budget counts them all
    legacy = Emulation(EmulateConfig(gpu="h100", trainer_gpus=2), engines=2).budget
    assert legacy == Budget(4, "separate", ((0,), (1,)), (2, 3))


def contending_spans(tmp_path, *overrides) -> tuple[list, list]:
    """Engine 0's paced steps and trainer rank 0's paced micro-batches, run at once in two threads of a budget's
    layout: each one's modelled (begin, end) spans."""
    emulation = Emulation.of(emulated("emulate.time_scale=1.0", "emulate.tokens_per_token=1", f"output_dir={tmp_path}",
                                  *overrides))
    engine, trainer = emulation.engine_pacer(0), emulation.trainer_pacer(1)
    spans = {"engine": [], "trainer": []}

    def steps():
        for _ in range(30):
            spans["engine"].append(engine.step(time.perf_counter(), 0, 64, 64 * 40))  # ~8 ms modelled

    def micro_batches():
        for _ in range(6):
            spans["trainer"].append(trainer.micro_batch(time.perf_counter(), 600, costs.TRAIN_FLOPS))  # ~20 ms
            time.sleep(0.005)

    threads = [threading.Thread(target=f) for f in (steps, micro_batches)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return spans["engine"], spans["trainer"]


def overlap(a: list, b: list) -> float:
    return sum(max(0.0, min(e1, e2) - max(b1, b2)) for b1, e1 in a for b2, e2 in b)


def test_a_colocated_engine_never_steps_while_a_trainer_micro_batch_runs_on_its_gpu(tmp_path):
    # resident (no switch to wait for), on 8 GPUs, where the trainer's states leave the engines room
    engine, trainer = contending_spans(tmp_path / "colocated", "emulate.colocation=resident", "emulate.gpus=8",
                                       "rollout.num_workers=8")
    assert len(engine) == 30 and len(trainer) == 6
    assert overlap(engine, trainer) == 0.0  # one after the other on the shared GPU
    assert all(e - b >= 0.001 for b, e in engine + trainer)  # each still lasts its modelled time
    # Split (engines on GPUs 0-5, trainer on 6-7) they run at once: the check above sees overlap where there is some
    engine, trainer = contending_spans(tmp_path / "separate", "emulate.layout=separate", "emulate.gpus=8",
                                       "rollout.num_workers=6")
    assert overlap(engine, trainer) > 0.05


def test_an_engines_slots_are_what_its_modelled_kv_cache_holds_and_check_prints_the_layout():
    from rlsys.startup import check_report

    cfg = emulated("emulate.prompt_tokens=256")
    emulation = Emulation.of(cfg)
    free = costs.MEMORY_FRACTION * 80e9 - 7.61e9 * 2  # an H100's usable memory less Qwen2.5-7B's bf16 weights
    per_token = 2 * 28 * 4 * 128 * 2  # K and V, 28 layers, 4 KV heads of 128, bf16
    longest = 256 + 64 * cfg.rollout.max_new_tokens  # the prompt's own 256, the response k = 64 a token
    assert emulation.kv_slots(cfg.data.max_prompt_tokens, cfg.rollout.max_new_tokens) == int(free / per_token // longest)
    assert 100 < int(free / per_token // longest) < 130  # hundreds of 8k sequences at most, as vLLM on one H100
    report = check_report(cfg)
    assert "emulated: 2 modelled h100 GPUs, colocated: engine 0 on GPU 0; engine 1 on GPU 1; trainer on GPUs 0,1" \
        in report and f"KV holds {int(free / per_token // longest)} sequences" in report
    assert f"emulate.colocation=sleep: a switch between an engine and the trainer {emulation.switch_seconds():.2f} s" \
        in report


def test_the_long_cot_configs_engines_run_the_slots_their_modelled_kv_holds():
    """The long-CoT workload is the equal-budget headline: its engines hold as many sequences as vLLM would on the
    modelled GPU, not a fixed 32 that queues half a step's requests (issue 45)."""
    cfg = load_config(str(Path(__file__).resolve().parent.parent / "configs" / "emulated_h100_7b_cot.yaml"))
    kv = Emulation.of(cfg).kv_slots(cfg.data.max_prompt_tokens, cfg.rollout.max_new_tokens)
    assert cfg.rollout.slots == kv
    per_engine = cfg.control.prompts_per_step * cfg.control.group_size / cfg.rollout.num_workers
    assert kv >= per_engine  # a sync step's requests all decode at once


# --- a GPU the engines and the trainer share -----------------------------------------------------------------
WEIGHTS_7B = 7.61e9 * 2  # Qwen2.5-7B's bf16 weights
HOST_LINK = 0.8 * 64e9  # an H100's PCIe Gen5 x16, each way, at the share a large pinned copy reaches


def test_a_colocated_switch_between_inference_and_training_costs_its_modelled_time(tmp_path):
    """Asleep (the default), an engine step then a trainer micro-batch on the same GPU: the trainer waits for the
    engine's weights to leave and its own states to arrive, and the engine after it for the reverse; a second step
    of the same side pays nothing."""
    scale = 0.01
    emulation = Emulation.of(emulated(f"emulate.time_scale={scale}", "emulate.tokens_per_token=1",
                                      f"output_dir={tmp_path}"))
    engine, trainer = emulation.engine_pacer(0), emulation.trainer_pacer(1)
    states = 7.61e9 * (2 + (2 + 12) / 2)  # bf16 weights whole; gradients and Adam sharded over 2 GPUs (ZeRO-2)
    switch = (WEIGHTS_7B + states) / HOST_LINK
    assert emulation.switch_seconds() == pytest.approx(switch) and switch > 1.5
    _, step_end = engine.step(time.perf_counter(), 0, 8, 8 * 40)
    begin, end = trainer.micro_batch(time.perf_counter(), 100, costs.TRAIN_FLOPS)
    assert begin - step_end >= scale * switch * 0.999
    began = time.perf_counter()
    begin2, end2 = trainer.micro_batch(began, 100, costs.TRAIN_FLOPS)
    assert begin2 - max(began, end) < scale * switch / 4  # the trainer's still: no switch
    began = time.perf_counter()
    step_begin, _ = engine.step(began, 0, 8, 8 * 40)
    assert step_begin - max(began, end2) == pytest.approx(scale * switch, rel=0.01)
    assert engine.counts()["switch_s"] == pytest.approx(switch) == trainer.counts()["switch_s"]
    # resident, on 8 GPUs where the trainer's states leave room beside the engines: no switch
    resident = Emulation.of(emulated(f"emulate.time_scale={scale}", "emulate.tokens_per_token=1", "emulate.gpus=8",
                                     "rollout.num_workers=8", "emulate.colocation=resident",
                                     f"output_dir={tmp_path / 'resident'}"))
    engine, trainer = resident.engine_pacer(0), resident.trainer_pacer(1)
    engine.step(time.perf_counter(), 0, 8, 8 * 40)
    trainer.micro_batch(time.perf_counter(), 100, costs.TRAIN_FLOPS)
    engine.step(time.perf_counter(), 0, 8, 8 * 40)
    assert resident.switch_seconds() == engine.switch_s == trainer.switch_s == 0.0


def test_a_resident_trainer_leaves_an_engine_fewer_kv_slots_than_a_sleeping_one():
    cfg = emulated("emulate.gpus=8", "rollout.num_workers=8")
    asleep, resident = Emulation.of(cfg), Emulation.of(emulated("emulate.gpus=8", "rollout.num_workers=8",
                                                                 "emulate.colocation=resident"))
    per_token = 2 * 28 * 4 * 128 * 2
    trainer = 7.61e9 * (2 + 14 / 8) + 16384 * 28 * 3584 * 2  # ZeRO-2 over 8 GPUs; each layer's checkpointed input
    assert asleep.engine_cost.kv_capacity - resident.engine_cost.kv_capacity == pytest.approx(trainer / per_token)
    longest = (cfg.data.max_prompt_tokens, cfg.rollout.max_new_tokens)
    assert resident.kv_slots(*longest) < asleep.kv_slots(*longest) / 2
    # on the 2 GPUs of the configs, its states and the engine's weights leave no KV cache at all
    with pytest.raises(ConfigError, match=r"leave no KV cache \(emulate.colocation=resident, trainer.zero_stage=2"):
        emulated("emulate.colocation=resident")


@pytest.mark.parametrize("overrides, where", [
    (["emulate.layout=separate", "rollout.num_workers=1"],
     r"its 1 modelled GPUs \(emulate.gpus=2, emulate.layout=separate, rollout.num_workers=1, emulate.tp=1\)"),
    (["control.scheduler=tail", "trainer.streamed=true", "trainer.scale_down_at=0.4"],
     r"the 1 modelled GPUs of the engines trainer.scale_down_at scales down \(rollout.num_workers=2"),
    (["emulate.gpus=8", "rollout.num_workers=7", "emulate.layout=separate"], r"its 1 modelled GPUs"),
])
def test_a_trainer_whose_states_pass_its_gpus_memory_is_refused(overrides, where):
    """Qwen2.5-7B under Adam holds 16 bytes a parameter, ~122 GB, past one H100's 80: on one modelled GPU (the split
    budget of 2, or the GPU a 2-GPU scale-down lends) it cannot train."""
    with pytest.raises(ConfigError, match=r"emulate.model=qwen2.5-7b trained with Adam under trainer.zero_stage=2 "
                                          r"needs 125 GB on each of " + where):
        emulated(*overrides)
    # on two it fits: ZeRO-2 shards the gradients and Adam's states over them (71.8 GB of the 72 usable)
    split = Budget.of_run(emulated("emulate.layout=separate", "emulate.gpus=4"))
    scaled = Budget.of_run(emulated("control.scheduler=tail", "trainer.streamed=true", "trainer.scale_down_at=0.4",
                                    "emulate.gpus=4", "rollout.num_workers=4"))
    assert split.trainer == (2, 3) and len(scaled.gpus_of(lent_engines(4))) == 2


def test_colocated_engines_sleep_only_where_no_request_generates_while_the_trainer_trains():
    """An engine asleep cannot generate: a schedule that generates while it trains (async with staleness, the
    streamed trainer) shares the modelled GPUs resident, as rollout.enable_sleep_mode is refused for it on real
    ones; on the 2 modelled H100s of the configs a resident 7B trainer leaves no KV cache, so it is refused there."""
    assert emulated().emulate.colocation == "sleep"
    assert emulated("control.scheduler=async", "control.staleness.eta=0").emulate.colocation == "sleep"
    wide = ["emulate.gpus=8", "rollout.num_workers=8"]
    for schedule in (["control.scheduler=async"], ["control.scheduler=tail", "trainer.streamed=true"]):
        assert emulated(*schedule, *wide).emulate.colocation == "resident"
        with pytest.raises(ConfigError, match=r"emulate.colocation=sleep: .* an engine asleep cannot generate"):
            emulated(*schedule, *wide, "emulate.colocation=sleep")
        with pytest.raises(ConfigError, match=r"leave no KV cache \(emulate.colocation=resident"):
            emulated(*schedule)
    assert emulated("control.scheduler=async", "emulate.colocation=sleep", "emulate.layout=separate",
                    "emulate.gpus=4", "rollout.num_workers=2").emulate.colocation == "sleep"  # nothing shared
