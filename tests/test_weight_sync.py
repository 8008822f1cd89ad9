"""Weight publishing in live runs (rlsys/weights/sync.py): after every step each engine holds exactly the
trainer's weights, by gloo broadcast or by object-store buckets; a stuck engine fails within the deadline;
a dead rollout worker stops a broadcast run; transports that cannot work where the config puts the engines
are refused."""
import time

import pytest
import ray
import torch
from safetensors.torch import load_file

from rlsys.config import DEFAULT_CONFIG, ConfigError
from rlsys.rollout.builtin_engine import CPUEngine
from rlsys.startup import load_config
from rlsys.train import Controller
from rlsys.weights import WeightTransferTimeout, WeightUpdate, plan_buckets
from rlsys.weights.transfer import ObjectStoreReceiver, ObjectStoreSender
from rlsys.weights.sync import GRACE_S, WeightSync

from helpers import kill_and_wait, trainer_weights
from test_cpu_engine import build
from test_end_to_end import SMALL, rows
from test_faults import QUICK_EVAL

# Overlong shaping makes rewards differ within groups (by length), so the trainer's weights move every step.
RUN = [str(DEFAULT_CONFIG), "trainer.total_steps=2", "control.eval_every=0", "rollout.num_workers=2", *SMALL,
       *QUICK_EVAL, "reward.overlong.enabled=true", "reward.overlong.max_len=48", "reward.overlong.cache_len=40"]


def max_diff(a: dict, b: dict) -> float:
    """Over the names both hold (a model file keeps one of two tied tensors)."""
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a.keys() & b.keys())


def engine_weights(worker) -> dict:
    """A rollout worker's engine weights, read inside its actor (Hugging Face names)."""
    return ray.get(worker.__ray_call__.remote(lambda w: {k: v.clone() for k, v in w.engine.model.params.items()}))


def block(worker, seconds: float) -> None:
    """Keep a worker's generation thread busy: an engine stuck in a long step. Returns once the thread is in
    it: the actor's calls run on several threads, so a call made next could otherwise queue ahead of it."""
    def stall(w):
        w.test_stalled = True
        time.sleep(seconds)
        w.test_stalled = False

    worker.__ray_call__.remote(lambda w: w._enqueue(lambda: stall(w), None))
    deadline = time.monotonic() + 30
    while not ray.get(worker.__ray_call__.remote(lambda w: getattr(w, "test_stalled", False))):
        assert time.monotonic() < deadline, "the worker's generation thread never took the stall"
        time.sleep(0.01)


def checked_run(out, *overrides):
    """A live run in which every publish is followed by a look at each engine: (controller, checks, metrics).
    A check is (version, how far the trainer moved from the initial weights, each engine's distance from
    the trainer, each engine's reported version)."""
    controller = Controller(load_config(RUN[0], RUN[1:] + [f"output_dir={out}", *overrides]))
    initial = load_file(str(controller.model_dir / "model.safetensors"))
    publish, checks = controller.weights.publish, []

    def publish_and_check(version):
        publish(version)
        trainer = trainer_weights(controller.trainer)
        gaps = [max_diff(trainer, engine_weights(w)) for w in controller.rollout.workers]
        checks.append((version, max_diff(trainer, initial), gaps, [s["version"] for s in controller.rollout.stats()]))
    controller.weights.publish = publish_and_check
    try:
        controller.run()
    except BaseException:
        controller.shutdown()
        raise
    return controller, checks, [r for r in rows(out) if "timing/train_s" in r]


def assert_engines_followed_the_trainer(checks, steps):
    assert [c[0] for c in checks] == [1, 2]
    for version, moved, gaps, versions in checks:
        assert moved > 0  # the trainer's weights changed, so an engine left behind would show
        assert gaps == [0.0, 0.0] and versions == [version, version]
    assert [r["policy_version"] for r in steps] == [1, 2] and all(r["samples"] == 16 for r in steps)
    assert all(-1.0 <= r["reward/mean"] <= 1.0 and r["timing/weight_sync_s"] > 0 for r in steps)


@pytest.fixture(scope="module")
def broadcast_run(tmp_path_factory, ray_cluster):
    controller, checks, steps = checked_run(tmp_path_factory.mktemp("broadcast") / "run", "weights.transfer=broadcast")
    yield controller, checks, steps
    controller.shutdown()


def test_a_broadcast_run_gives_every_engine_the_trainers_weights(broadcast_run):
    controller, checks, steps = broadcast_run
    assert_engines_followed_the_trainer(checks, steps)
    in_group = [ray.get(w.__ray_call__.remote(lambda w: w.engine.weight_group is not None))
                for w in controller.rollout.workers]
    assert in_group == [True, True]  # the bytes came over the gloo group, not by another path


def test_an_engine_that_never_joins_or_receives_fails_within_the_deadline(broadcast_run):
    controller = broadcast_run[0]
    cfg = controller.cfg.model_copy(deep=True)
    cfg.weights.timeout_s = 2
    stuck = controller.rollout.workers[1]
    block(stuck, 4)
    t0 = time.monotonic()
    with pytest.raises(WeightTransferTimeout, match="not every rank joined within 2 s: rollout worker 1 did not"):
        WeightSync(cfg, controller.trainer, controller.rollout)
    assert time.monotonic() - t0 < 2 + GRACE_S
    ray.get(stuck.stats.remote())  # free again (its own join has failed too)

    sync = WeightSync(cfg, controller.trainer, controller.rollout)  # a new group, every engine in it
    block(stuck, 2 + GRACE_S + 3)  # past every deadline: the sends may fit in the sockets' buffers
    t0 = time.monotonic()
    with pytest.raises(WeightTransferTimeout):  # the trainer's own broadcast deadline, or the wait's
        sync.publish(controller.version + 1)
    assert time.monotonic() - t0 < 2 + GRACE_S + 1


def test_a_dead_rollout_worker_stops_a_broadcast_run(broadcast_run):
    controller = broadcast_run[0]
    kill_and_wait(controller.rollout.workers[0])
    with pytest.raises(RuntimeError, match=r"rollout worker 0 died \(.*\); weights.transfer=broadcast cannot replace "
                                           r"a rollout worker yet .*--resume continues from the last checkpoint"):
        controller.rollout.stats()


def test_an_object_store_run_sends_buckets_and_engines_match_the_trainer(tmp_path, ray_cluster, monkeypatch):
    from rlsys.rollout.manager import RolloutManager

    sent, update_weights = [], RolloutManager.update_weights

    def record(self, update):
        sent.append(update)
        update_weights(self, update)
    monkeypatch.setattr(RolloutManager, "update_weights", record)
    controller, checks, steps = checked_run(tmp_path / "run", "weights.bucket_mb=0.1")  # 1.6 MB of weights
    controller.shutdown()
    assert_engines_followed_the_trainer(checks, steps)
    assert len(sent) == 2 and all(isinstance(u.receiver, ObjectStoreReceiver) for u in sent)
    assert [u.version for u in sent] == [1, 2]
    assert all(len(u.plans) > 10 and len(u.receiver.refs) == len(u.plans) for u in sent)  # one object per bucket


def test_the_cpu_engine_switches_version_only_after_the_last_bucket(tmp_path, ray_cluster):
    other, path = build(tmp_path, seed=1)
    engine = CPUEngine(path, slots=1)
    weights = {k: v.clone() for k, v in other.state_dict().items()}
    weights["model.unknown.weight"] = torch.zeros(1)  # the last bucket's: refused after the others are loaded
    update = published(weights, version=1)
    with pytest.raises(KeyError, match="model.unknown.weight"):
        engine.receive_weights(update)
    assert engine.version == 0
    del weights["model.unknown.weight"]
    engine.receive_weights(published(weights, version=1))
    assert engine.version == 1 and max_diff(weights, engine.model.params) == 0.0


def test_the_cpu_engine_refuses_an_older_weight_version_before_it_loads(tmp_path, ray_cluster):
    model, path = build(tmp_path, seed=0)
    other, _ = build(tmp_path, seed=1, name="other")
    engine = CPUEngine(path, slots=1)
    held = {k: v.clone() for k, v in model.state_dict().items()}
    engine.receive_weights(published(held, version=2))
    older = {k: v.clone() for k, v in other.state_dict().items()}
    message = "refused weights version 1, older than the version 2 it holds"
    with pytest.raises(RuntimeError, match=message):
        engine.receive_weights(published(older, version=1))
    with pytest.raises(RuntimeError, match=message):
        engine.load_weights(older, version=1)
    assert engine.version == 2 and max_diff(held, engine.model.params) == 0.0  # not a byte of them loaded
    engine.load_weights(held, version=2)  # the same version again is fine


def published(weights: dict, version: int) -> WeightUpdate:
    plans = plan_buckets(weights, 4096)
    return WeightUpdate(version, plans, ObjectStoreSender("trainer", 60).send(plans, weights.items(), version))


GPU_CONFIG = ["weights.transfer=cuda_ipc", "rollout.engine=vllm", "cluster.gpus_per_node=4", "rollout.num_workers=2",
              "trainer.world_size=2"]


@pytest.mark.parametrize("overrides, message", [
    (["weights.transfer=cuda_ipc"], r"weights.transfer=cuda_ipc .* needs cluster.gpus_per_node >= 1, cluster.layout="
                                    r"colocated and the engine on the GPU .*\(got cluster.gpus_per_node=0"),
    (GPU_CONFIG + ["cluster.layout=separate"], "weights.transfer=cuda_ipc .* cluster.layout=separate"),
    (GPU_CONFIG + ["rollout.engine=cpu"], r"weights.transfer=cuda_ipc .* rollout.engine=cpu, rollout.device=cpu\)"),
    (GPU_CONFIG + ["trainer.world_size=1"], "weights.transfer=cuda_ipc needs a trainer rank on every engine GPU"),
    (GPU_CONFIG + ["weights.transfer=broadcast"], "weights.transfer=broadcast with cluster.layout=colocated puts a "
                                                  "trainer rank and an engine on one GPU"),
    (["weights.transfer=nccl"], "weights.transfer: Input should be 'object_store', 'broadcast' or 'cuda_ipc'"),
    (["weights.bucket_mb=0"], "weights.bucket_mb: Input should be greater than 0"),
    (["weights.timeout_s=0"], "weights.timeout_s: Input should be greater than 0"),
])
def test_weights_config_is_checked(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(DEFAULT_CONFIG, overrides)


def test_cuda_ipc_is_refused_on_a_cluster_without_gpus(ray_cluster):
    if ray.cluster_resources().get("GPU"):
        pytest.skip("this Ray cluster has GPUs")
    cfg = load_config(DEFAULT_CONFIG, GPU_CONFIG)  # a valid GPU config, on a machine without GPUs
    with pytest.raises(ValueError, match="weights.transfer=cuda_ipc needs GPUs and this Ray cluster has none"):
        WeightSync(cfg, trainer=None, rollout=None)


def test_broadcast_to_engines_on_their_own_gpus_and_cuda_ipc_colocated_are_accepted():
    load_config(DEFAULT_CONFIG, GPU_CONFIG + ["weights.transfer=broadcast", "cluster.layout=separate"])
    load_config(DEFAULT_CONFIG, GPU_CONFIG)
