"""Engines that share GPUs with the trainer: sleep and wake around each train step, the configs that cannot do
it, and the seeds rollout requests carry."""
import json
import sys
import time
from pathlib import Path

import pytest
import torch

from rlsys.config import DEFAULT_CONFIG, CONFIG_DIR, ConfigError
from rlsys.rollout.builtin_engine import CPUEngine
from rlsys.rollout.registry import register_engine
from rlsys.rollout.worker import RolloutWorker
from rlsys.startup import load_config
from rlsys.types import Request, SamplingParams
from test_cpu_engine import build

GPU_CONFIGS = sorted(CONFIG_DIR.glob("qwen2.5_*.yaml"))
ONE_NODE = str(CONFIG_DIR / "qwen2.5_math_1.5b_dapo_8gpu.yaml")


# --- config ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("path", GPU_CONFIGS, ids=lambda p: p.stem)
def test_the_gpu_configs_sleep_their_colocated_engines(path):
    cfg = load_config(path)
    assert cfg.cluster.layout == "colocated" and cfg.rollout.engine == "vllm" and cfg.rollout.enable_sleep_mode


def test_sleep_mode_defaults_on_only_where_engines_share_gpus():
    assert load_config(DEFAULT_CONFIG).rollout.enable_sleep_mode is False  # no GPUs: nothing to share
    colocated = load_config(DEFAULT_CONFIG, ["cluster.gpus_per_node=2", "rollout.num_workers=2"])
    separate = load_config(DEFAULT_CONFIG, ["cluster.gpus_per_node=2", "cluster.layout=separate"])
    assert colocated.rollout.enable_sleep_mode is True and separate.rollout.enable_sleep_mode is False


@pytest.mark.parametrize("overrides, fields", [
    (["rollout.enable_sleep_mode=false"], ["rollout.enable_sleep_mode=false", "cluster.layout=colocated"]),
    (["rollout.gpu_memory_utilization=0.95"], ["rollout.gpu_memory_utilization=0.95", "at most 0.9"]),
    (["control.scheduler=async"], ["rollout.enable_sleep_mode", "control.scheduler=async",
                                   "control.staleness.eta=1"]),
    (["control.scheduler=tail", "trainer.streamed=true"], ["rollout.enable_sleep_mode", "trainer.streamed"]),
], ids=["no sleep", "no room for the trainer", "async", "streamed"])
def test_what_colocated_engines_cannot_do_is_refused_naming_the_fields(overrides, fields):
    with pytest.raises(ConfigError) as err:
        load_config(ONE_NODE, overrides)
    assert all(f in str(err.value) for f in fields), str(err.value)


def test_the_refused_combinations_are_fine_where_engines_do_not_sleep():
    two_nodes = ["cluster.nodes=2", "cluster.layout=separate", "weights.transfer=object_store"]
    for extra in (["rollout.gpu_memory_utilization=0.95"], ["control.scheduler=async"], ["control.scheduler=tail",
                                                                                        "trainer.streamed=true"]):
        assert not load_config(ONE_NODE, two_nodes + extra).rollout.enable_sleep_mode
    assert load_config(ONE_NODE, ["control.scheduler=async", "control.staleness.eta=0"]).rollout.enable_sleep_mode


# --- the built-in engine and the worker --------------------------------------------------------------
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build(tmp_path_factory.mktemp("colocated"))[1]


def greedy(rid, n=6, prompt=(1, 2, 3)):
    return Request(rid, "p", list(prompt), SamplingParams(max_new_tokens=n, temperature=0.0))


def run(engine, requests):
    for r in requests:
        engine.add(r)
    out = {}
    while engine.has_work():
        out.update((c.request_id, c.token_ids) for c in engine.step())
    return out


def test_cpu_engine_sleep_frees_its_kv_cache_and_is_refused_while_it_holds_requests(model_dir):
    engine = CPUEngine(model_dir, slots=2)
    before = run(engine, [greedy("a")])["a"]
    engine.add(greedy("b"))
    with pytest.raises(RuntimeError, match="cpu engine: cannot sleep while it holds requests"):
        engine.sleep(2)
    run(engine, [])
    engine.sleep(2)
    assert engine.model.k_cache is None and engine.asleep == ("weights", "kv_cache")
    engine.wake_up(["weights"])
    assert engine.model.k_cache is None and engine.asleep == ("kv_cache",)
    engine.wake_up(["kv_cache"])
    assert not engine.asleep and run(engine, [greedy("c")])["c"] == before


def test_worker_holds_requests_and_weights_until_its_engine_wakes(model_dir):
    worker = RolloutWorker(model_dir, slots=2, torch_threads=1)
    try:
        worker.sleep(2)
        worker.submit([greedy("r")])
        assert worker.drain(0.5) == []  # queued, not stepped: the KV cache is gone
        weights = {k: v.clone() for k, v in worker.engine.model.params.items()}
        with pytest.raises(RuntimeError, match=r"weights sleep; wake_up\(\['weights'\]\) comes first"):
            worker.load_weights(weights, version=1)
        worker.wake_up(["weights"])
        worker.load_weights(weights, version=1)
        assert worker.drain(0.5) == []
        worker.wake_up(["kv_cache"])
        [done] = worker.drain(10)
        assert done.request_id == "r" and done.versions == [1] * 6
    finally:
        worker.stop()


def test_unseeded_requests_on_the_builtin_engine_draw_from_the_run_seed_and_their_id(model_dir):
    def sample(engine_seed, rid, companions=()):
        engine = CPUEngine(model_dir, slots=4, seed=engine_seed)
        reqs = [Request(r, "p", [1, 2, 3], SamplingParams(max_new_tokens=20, temperature=1.0))
                for r in (*companions, rid)]
        return run(engine, reqs)[rid]

    first = sample(0, "x")
    assert sample(0, "x", companions=("y", "z")) == first  # whatever engine, order or batch it lands in
    assert sample(1, "x") != first and sample(0, "y") != first


# --- the loop: a recording engine inside a real run -----------------------------------------------------
@register_engine("recording")
class RecordingEngine(CPUEngine):
    """The built-in engine, writing each call the loop makes to it (with the time) to log_dir/<name>.jsonl."""
    log_dir = None  # set by the test; the class travels to the Ray workers by value

    def _log(self, *event):
        with open(Path(self.log_dir) / f"{self.name}.jsonl", "a") as f:
            f.write(json.dumps([time.time(), *event]) + "\n")

    def sleep(self, level=1):
        super().sleep(level)
        self._log("sleep", level)

    def wake_up(self, tags=None):
        super().wake_up(tags)
        self._log("wake", *tags)

    def load_weights(self, state_dict, version):
        super().load_weights(state_dict, version)
        self._log("weights", version)

    def receive_weights(self, update):
        super().receive_weights(update)
        self._log("weights", update.version)

    def add(self, request):
        super().add(request)
        self._log("add", request.request_id, request.params.seed)

    def step(self):
        if self.asleep:
            self._log("stepped asleep")
        return super().step()


def test_engines_sleep_before_each_train_step_and_wake_in_vllms_order(tmp_path, ray_cluster, monkeypatch):
    import ray.cloudpickle

    from rlsys import train as loop

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    RecordingEngine.log_dir = str(tmp_path)
    trained = []  # driver side: when each train step was launched
    launch = loop.TrainerGroup.start_train_step
    monkeypatch.setattr(loop.TrainerGroup, "start_train_step",
                        lambda self, *a, **k: trained.append(time.time()) or launch(self, *a, **k))
    steps = 3
    cfg = load_config(DEFAULT_CONFIG, [
        "rollout.engine=recording", "rollout.enable_sleep_mode=true", "rollout.num_workers=2", "rollout.slots=8",
        "rollout.max_new_tokens=16", "control.prompts_per_step=4", "control.group_size=4", "data.eval_size=8",
        f"control.eval_every={steps}", "control.save_every=0", f"trainer.total_steps={steps}", "trainer.backend=torch",
        "model.warm_start.steps=30", "logging.progress=false", f"output_dir={tmp_path / 'run'}"])
    loop.train(cfg)

    expected = ["sleep 2", "wake weights", "weights 0", "wake kv_cache", "add"]
    for version in range(1, steps + 1):
        expected += ["sleep 2", "train", "wake weights", f"weights {version}", "wake kv_cache", "add"]
    for log in sorted(tmp_path.glob("rollout worker *.jsonl")):
        events = [json.loads(line) for line in log.read_text().splitlines()]
        adds = [e for e in events if e[1] == "add"]
        assert all((seed is not None) == rid.startswith("eval/") for _, _, rid, seed in adds), log.name
        named = [(e[0], "add" if e[1] == "add" else " ".join(map(str, e[1:]))) for e in events]
        timeline = sorted(named + [(t, "train") for t in trained])
        calls = [name for i, (_, name) in enumerate(timeline) if name != "add" or timeline[i - 1][1] != "add"]
        assert calls == expected, log.name
    assert len(list(tmp_path.glob("rollout worker *.jsonl"))) == 2


def test_async_beside_a_colocated_built_in_engine_is_told_to_keep_it_awake_and_then_runs():
    """The built-in engine can stay on its GPU beside the trainer (vLLM awake would hold the GPU): the refusal says
    so, and that config is valid (one GPU, CUDA IPC: configs/gpu/bench_0.5b.yaml)."""
    bench = str(CONFIG_DIR / "gpu" / "bench_0.5b.yaml")
    with pytest.raises(ConfigError) as err:
        load_config(bench, ["control.scheduler=async", "trainer.loss=decoupled_ppo"])
    assert "use rollout.enable_sleep_mode=false (the built-in engine then stays on the GPU" in str(err.value)
    awake = load_config(bench, ["control.scheduler=async", "trainer.loss=decoupled_ppo",
                               "rollout.enable_sleep_mode=false"])
    assert awake.cluster.layout == "colocated" and not awake.rollout.enable_sleep_mode
    with pytest.raises(ConfigError, match="use cluster.layout=separate$|use cluster.layout=separate "):
        load_config(ONE_NODE, ["control.scheduler=async"])  # vLLM: a separate layout only
