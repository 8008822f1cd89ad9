"""Streamed training: groups whose gradients accumulate as they complete, in any order and any chunks,
give the weights and statistics of the synchronous step on all of them (trainer/streamed.py)."""
import math
import os
import socket

import pytest
import ray
from test_trainer import SCORING, make_groups, max_diff, model_dir, trainer_config  # noqa: F401

from rlsys.config import Config, ConfigError
from rlsys.startup import load_config
from rlsys.trainer.backend import TorchBackend
from rlsys.trainer.batching import build_samples, mini_batch_ends, plan_step, sampled_by, split_mini_batches
from rlsys.trainer.streamed import StreamedGradients
from rlsys.trainer.worker import TrainerGroup

from helpers import float32_reorder_rel, stream_finish, trainer_weights

ARRIVALS = [[4, 1, 5], [0], [3, 2]]  # uneven chunks, in an order unlike the groups'
STATS = ("loss", "pg_loss", "entropy", "clip_fraction", "behaviour_logprob_diff", "grad_norm")


def step_groups(seeds):
    return [make_groups(seed, prompts=6) for seed in seeds]


def record_gradients(backend) -> list:
    """The gradients each optimizer step sees (after any division, before clipping), one dict per step."""
    seen, step = [], backend._optimizer_step

    def recorded():
        seen.append({n: p.grad.clone() for n, p in backend.model.named_parameters() if p.grad is not None})
        return step()
    backend._optimizer_step = recorded
    return seen


def arrival_order(groups):
    return [groups[i] for chunk in ARRIVALS for i in chunk]


def sync_steps(backend, steps, version=None):
    """The synchronous steps on the groups in the order they arrive in a stream (its mini-batches' order)."""
    metrics, weights = [], []
    for groups in steps:
        samples = build_samples(arrival_order(groups), backend.cfg.advantage)
        parts = [plan_step(part, 1, backend.cfg.micro_batch_tokens)
                 for part in split_mini_batches(samples, backend.cfg.mini_batches)]
        metrics.append(backend.train_mini_batches([(mine[0], totals) for mine, totals in parts],
                                                  sampled_by(samples, version), 0, version))
        weights.append(backend.state_dict_for_rollout())
    return metrics, weights


def streamed_steps(backend, steps, version=None):
    """Each step streamed in ARRIVALS' chunks; a mini-batch closed after the chunk that completes it, as
    TrainerGroup.stream_groups closes it."""
    metrics, weights = [], []
    for groups in steps:
        stream, tokens, sequences, arrived = StreamedGradients(backend, version), 0, 0, 0
        ends = mini_batch_ends(len(groups), backend.cfg.mini_batches)
        for chunk in ARRIVALS:
            samples = build_samples([groups[i] for i in chunk], backend.cfg.advantage)
            _, part = plan_step(samples, 1, backend.cfg.micro_batch_tokens)
            stream.accumulate(samples, part.micro_batches)
            tokens, sequences, arrived = tokens + part.tokens, sequences + part.sequences, arrived + len(chunk)
            if arrived in ends[:-1]:
                stream.close(tokens, sequences)
                tokens = sequences = 0
        metrics.append(stream.finish(tokens, sequences))
        weights.append(backend.state_dict_for_rollout())
    return metrics, weights


def steady_adam(*backends) -> None:
    """A step's second update runs on its first's weights: with AdamW's eps at 1e-8, the first update turns
    rounding in near-zero gradients into moves of a sizeable share of lr (assert_equivalent), and the second
    update's gradients differ by ~1e-4. With eps 1e-5 in both backends every update is held tight."""
    for backend in backends:
        for group in backend.optimizer.param_groups:
            group["eps"] = 1e-5


def relative_error(a: dict, b: dict) -> float:
    """|a - b| / |a| over every tensor together."""
    diff = sum(((a[k] - b[k]) ** 2).sum() for k in a)
    return float(diff.sqrt() / sum((a[k] ** 2).sum() for k in a).sqrt())


def assert_equivalent(sync, streamed, initial, rel=None):
    """The same statistics and grad norm up to float32's reordering of the step's sums (`rel`, by default
    helpers.float32_reorder_rel of its tokens); the same weights up to what AdamW makes of float rounding.

    AdamW divides by sqrt(v) + 1e-8: on entries whose gradient is near 1e-8, a rounding difference of ~1e-7
    of the largest gradient moves the update by a sizeable share of lr (the synchronous step differs from
    itself that way under another micro-batch packing). So weights are held to 2% of the step's largest
    move, and the exact claim is checked on gradients and grad norms instead."""
    for (m_sync, w_sync), (m_streamed, w_streamed) in zip(zip(*sync), zip(*streamed)):
        assert m_streamed["tokens"] == m_sync["tokens"] and m_streamed["sequences"] == m_sync["sequences"]
        assert m_streamed["skipped_steps"] == m_sync["skipped_steps"] == 0
        bound = rel or float32_reorder_rel(m_sync["tokens"])
        assert m_streamed["grad_norm"] == pytest.approx(m_sync["grad_norm"], rel=bound)
        for key in STATS + tuple(k for k in ("kl",) if k in m_sync):  # token means of terms of order 1
            assert m_streamed[key] == pytest.approx(m_sync[key], rel=bound, abs=bound), key
    moved = max_diff(initial, sync[1][0])
    assert moved > 1e-3  # lr 1e-2: the steps moved the weights, so the check is not vacuous
    for w_sync, w_streamed in zip(sync[1], streamed[1]):
        assert max_diff(w_sync, w_streamed) <= 0.02 * moved


# --- plain torch, in process ------------------------------------------------------------------------
@pytest.mark.parametrize("overrides", [
    {"loss": "dapo"},  # token mean: the normaliser is the step's token count
    {"loss": "grpo", "kl": {"estimator": "k3", "coef": 0.1}},  # sequence mean, and a KL term
    {"loss": "dapo", "grad_clip": 0.05},  # clipping bites, so the division must come before it
    {"loss": "drgrpo", "loss_scale_tokens": 20},  # Dr.GRPO: a sequence mean of token sums / a constant
])
def test_two_streamed_steps_equal_two_synchronous_steps(model_dir, overrides):  # noqa: F811
    cfg = trainer_config(**overrides)
    steps = step_groups([0, 1])
    sync_backend, streamed_backend = TorchBackend(cfg, model_dir, SCORING), TorchBackend(cfg, model_dir, SCORING)
    initial = sync_backend.state_dict_for_rollout()
    sync_grads, streamed_grads = record_gradients(sync_backend), record_gradients(streamed_backend)
    sync = sync_steps(sync_backend, steps)
    streamed = streamed_steps(streamed_backend, steps)
    assert_equivalent(sync, streamed, initial)
    assert len(streamed_grads) == 2  # one optimizer update per step
    # The gradient each update was given: from the same weights in the first step; in the second, from
    # weights that the first step's AdamW rounding (above) already set slightly apart.
    assert relative_error(sync_grads[0], streamed_grads[0]) < float32_reorder_rel(sync[0][0]["tokens"])
    assert relative_error(sync_grads[1], streamed_grads[1]) < 1e-4
    if "grad_clip" in overrides:
        assert sync[0][0]["grad_norm"] > 4 * cfg.grad_clip


def test_an_empty_streamed_step_is_skipped_and_leaves_the_weights(model_dir):  # noqa: F811
    backend = TorchBackend(trainer_config(), model_dir, SCORING)
    before = backend.state_dict_for_rollout()
    stream = StreamedGradients(backend)
    stream.accumulate([], 0)
    assert stream.finish(0, 0)["skipped_steps"] == 1
    assert max_diff(before, backend.state_dict_for_rollout()) == 0.0


def test_a_nan_in_a_streamed_step_skips_it_and_the_next_one_trains(model_dir):  # noqa: F811
    backend = TorchBackend(trainer_config(), model_dir, SCORING)
    before = backend.state_dict_for_rollout()
    poisoned = step_groups([2])
    poisoned[0][3].samples[0].reward = math.nan  # a reward function gone wrong: NaN advantages, NaN loss
    metrics, weights = streamed_steps(backend, poisoned)
    assert metrics[0]["skipped_steps"] == 1 and math.isnan(metrics[0]["loss"])
    assert max_diff(before, weights[0]) == 0.0 and all(p.grad is None for p in backend.model.parameters())
    metrics, weights = streamed_steps(backend, step_groups([3]))
    assert metrics[0]["skipped_steps"] == 1 and math.isfinite(metrics[0]["loss"])
    assert max_diff(before, weights[0]) > 0.0


@pytest.mark.parametrize("overrides,version", [
    ({"loss": "dapo"}, 0),  # fresh: pi_prox is the behaviour log-probs in both
    ({"loss": "grpo", "kl": {"estimator": "k3", "coef": 0.1}}, 0),
    ({"loss": "decoupled_ppo", "proximal": "loglinear"}, 1),  # a version behind: the later one interpolated
])
def test_streamed_mini_batches_equal_the_synchronous_mini_batches(model_dir, overrides, version):  # noqa: F811
    """trainer.mini_batches=2 over 6 groups: the first 3 to arrive are the first mini-batch, updated on its own
    totals before the rest arrive, exactly as the synchronous step splits the same batch."""
    cfg = trainer_config(mini_batches=2, **overrides)
    steps = step_groups([0, 1])
    sync_backend, streamed_backend = TorchBackend(cfg, model_dir, SCORING), TorchBackend(cfg, model_dir, SCORING)
    initial = sync_backend.state_dict_for_rollout()
    steady_adam(sync_backend, streamed_backend)
    sync_grads, streamed_grads = record_gradients(sync_backend), record_gradients(streamed_backend)
    sync = sync_steps(sync_backend, steps, version)
    streamed = streamed_steps(streamed_backend, steps, version)
    assert_equivalent(sync, streamed, initial)
    assert len(streamed_grads) == len(sync_grads) == 4  # two updates a step
    # The first update's gradient from the same weights; the later ones' from weights AdamW's rounding set apart.
    assert relative_error(sync_grads[0], streamed_grads[0]) < float32_reorder_rel(sync[0][0]["tokens"])
    assert all(relative_error(s, g) < 1e-4 for s, g in zip(sync_grads[1:], streamed_grads[1:]))
    moved = max_diff(initial, sync[1][0])
    assert all(max_diff(s, w) < 1e-3 * moved for s, w in zip(sync[1], streamed[1]))
    bound = float32_reorder_rel(sync[0][0]["tokens"])
    assert "mismatch_kl" in sync[0][0]
    assert streamed[0][0]["mismatch_kl"] == pytest.approx(sync[0][0]["mismatch_kl"], rel=bound, abs=bound)


def test_a_stale_later_streamed_mini_batch_needs_loglinear(model_dir):  # noqa: F811
    backend = TorchBackend(trainer_config(mini_batches=2), model_dir, SCORING)
    with pytest.raises(ValueError, match="mini-batch 2 has tokens not sampled by version 1.*proximal=loglinear"):
        streamed_steps(backend, step_groups([0]), version=1)  # sampled by version 0, recompute configured


def test_a_later_streamed_mini_batch_under_a_mismatch_correction_is_refused_though_fresh(model_dir):  # noqa: F811
    """As the synchronous step, a correction takes no behaviour log-probs as pi_old (it needs the trainer's own):
    the step's second mini-batch would need a recomputing forward. The config refuses the combination with
    trainer.streamed; the trainer still never takes the engine's log-probs for pi_old under it."""
    backend = TorchBackend(trainer_config(mini_batches=2, mismatch={"mode": "tis"}), model_dir, SCORING)
    with pytest.raises(ValueError, match=r"mini-batch 2 is corrected by trainer.mismatch.mode=tis .*mini_batches=1"):
        streamed_steps(backend, step_groups([0]), version=0)  # every token sampled by version 0


def test_streamed_mini_batches_refuse_a_mismatch_correction():
    streamed = ["control.scheduler=tail", "trainer.streamed=true"]
    load_config(None, [*streamed, "trainer.mini_batches=4"])  # the emulated preset's: accepted
    with pytest.raises(ConfigError, match=r"trainer.streamed with trainer.mini_batches=2.*trainer.mismatch.mode=tis"):
        load_config(None, [*streamed, "trainer.mini_batches=2", "trainer.mismatch.mode=tis"])


# --- DeepSpeed on one rank, in process (gloo) ---------------------------------------------------------
@pytest.fixture(scope="module")
def one_rank_process_group():
    """The variables the trainer worker sets for rank 0 of 1; DeepSpeed starts gloo on the first engine."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    yield
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k)
        else:
            os.environ[k] = v


@pytest.mark.slow
@pytest.mark.parametrize("stage,mini_batches", [(0, 1), (1, 2), (2, 1), (3, 2)])
def test_deepspeed_streamed_steps_equal_synchronous_steps(model_dir, one_rank_process_group, stage,  # noqa: F811
                                                          mini_batches):
    from deepspeed import comm

    from rlsys.trainer.deepspeed_backend import DeepSpeedBackend

    cfg = trainer_config(backend="deepspeed", zero_stage=stage, grad_clip=0.05, mini_batches=mini_batches)
    steps = step_groups([0, 1])
    sync_backend, streamed_backend = (DeepSpeedBackend(cfg, model_dir, SCORING) for _ in range(2))
    assert comm.comm.cdb.shm_comm_op is None  # DeepSpeed's inference all-reduce op, neither compiled nor loaded on a CPU
    steady_adam(sync_backend, streamed_backend)
    initial = sync_backend.state_dict_for_rollout()
    sync = sync_steps(sync_backend, steps, version=0)
    streamed = streamed_steps(streamed_backend, steps, version=0)
    assert_equivalent(sync, streamed, initial)


# --- the Ray actors: two DeepSpeed ranks against the in-process synchronous step -----------------------
@pytest.mark.slow
def test_trainer_group_streams_mini_batches_across_two_ranks(ray_cluster, model_dir):  # noqa: F811
    """trainer.mini_batches=2: the first mini-batch's update is done while the stream still waits for the
    step's last groups; each step equals the synchronous one on the same mini-batches."""
    cfg = trainer_config(backend="deepspeed", zero_stage=2, world_size=2, streamed=True, grad_clip=0.05,
                         mini_batches=2)
    steps = step_groups([0, 1])
    local = TorchBackend(trainer_config(grad_clip=0.05, mini_batches=2), model_dir, SCORING)
    steady_adam(local)
    initial = local.state_dict_for_rollout()
    sync = sync_steps(local, steps, version=0)
    trainer = TrainerGroup(Config(trainer=cfg, control={"scheduler": "tail"}), model_dir, SCORING)
    try:
        # steady_adam on each rank (a nested function: Ray's workers cannot import this module)
        ray.get([w.__ray_call__.remote(lambda worker: worker.backend.optimizer.param_groups[0].update(eps=1e-5))
                 for w in trainer.workers])
        metrics, weights = [], []
        for groups in steps:
            before = trainer_weights(trainer)
            trainer.stream_begin(len(groups), version=0)
            first = trainer.stream_groups([groups[i] for i in ARRIVALS[0]])  # the first half: its update
            ray.get(first)
            assert max_diff(before, trainer_weights(trainer)) > 1e-3  # moved before the rest arrived
            refs = [trainer.stream_groups([groups[i] for i in chunk]) for chunk in ARRIVALS[1:]]
            # Nothing is waited for; groups arriving while the ranks are busy go with the next part.
            assert all(isinstance(r, ray.ObjectRef) for part in refs for r in part) and refs[0]
            metrics.append(stream_finish(trainer))
            weights.append(trainer_weights(trainer))
        with pytest.raises(RuntimeError, match="stream_begin first"):
            trainer.stream_groups(steps[0])
    finally:
        trainer.shutdown()
    # Another backend on two ranks: float reassociation, as in test_trainer's cross-backend checks.
    assert_equivalent(sync, (metrics, weights), initial, rel=1e-4)
