"""What several test files do the way a driver does it."""
import math
import time

# A model small enough to build in seconds: ModelConfig's fields, and the same as key=value overrides.
SMALL_MODEL = dict(hidden_size=32, num_heads=2, num_kv_heads=1, intermediate_size=64, max_position_embeddings=128)
SMALL_MODEL_OVERRIDES = [f"model.{k}={v}" for k, v in SMALL_MODEL.items()]
# A run's overrides small enough to take seconds per step; the tiny model's cache entry is shared by the tests.
SMALL = ["control.prompts_per_step=4", "control.group_size=4", "data.eval_size=16", "rollout.slots=16",
         "rollout.max_new_tokens=48", "model.warm_start.steps=30", "logging.progress=false"]


# --- float32 sums in another order ------------------------------------------------------------------
FLOAT32_EPS = 2.0 ** -23  # float32's spacing at 1.0: one ulp of a value near 1
REORDER_ULPS = 4  # the margin over the typical error, ample for any x86 CPU's kernels


def float32_reorder_rel(terms: int) -> float:
    """How far apart, relatively, two float32 results may be that sum the same `terms` terms in other orders.

    Each CPU's kernels (their SIMD width, their BLAS blocking) choose their own order, so two summation
    orders that agree to 1e-7 on one CPU model differ by 1e-6 on another. Rounding errors add as a random
    walk, ~sqrt(terms) ulps (Higham, Accuracy and Stability of Numerical Algorithms, 2.8); REORDER_ULPS
    times that holds on any CPU. A real bug (a dropped micro-batch, a wrong normaliser) moves the result
    by a share of its terms, a thousand times more."""
    return REORDER_ULPS * math.sqrt(terms) * FLOAT32_EPS


def next_step(sched, version, groups, now):
    """Cross a step boundary as the live controller and the simulator do: `on_trained`, then `start`."""
    sched.on_trained(version, groups)
    return sched.start(now)


# --- the trainer group, as a test drives it ------------------------------------------------------
def train_step(trainer, groups, version=None) -> dict:
    """One train step on a TrainerGroup, waited for: its merged metrics."""
    return trainer.finish_train_step(trainer.start_train_step(groups, version))


def stream_finish(trainer) -> dict:
    """A streamed step's end, waited for: the merged metrics, as `train_step` returns them."""
    return trainer.finish_train_step(trainer.stream_end())


def trainer_weights(trainer) -> dict:
    """Rank 0's full weights (HF names, CPU float32); every rank takes part, as ZeRO-3's gather needs."""
    import ray

    def weights(worker):
        return worker.backend.state_dict_for_rollout(keep=worker.rank == 0)
    return ray.get([w.__ray_call__.remote(weights) for w in trainer.workers])[0]


def compute_logprobs(trainer, samples) -> list[list[float]]:
    """Current-policy log-probs of each sample's response tokens, computed across the ranks, in input order."""
    import ray

    from rlsys.trainer.batching import plan_step

    per_rank, totals = plan_step(samples, trainer.cfg.world_size, trainer.cfg.micro_batch_tokens)

    def score(worker, mine):
        return worker.backend.compute_logprobs(mine, totals.micro_batches)
    results = ray.get([w.__ray_call__.remote(score, mine) for w, mine in zip(trainer.workers, per_rank)])
    found = {id(s): lp for part, lps in zip(per_rank, results) for s, lp in zip(part, lps)}
    return [found[id(s)] for s in samples]


def kill_and_wait(actor, timeout_s: float = 60.0):
    """ray.kill, waited for until the actor is dead: the kill lands asynchronously, so a call made just after
    it may still be served. `actor` must have a `ready` method."""
    import ray

    ray.kill(actor)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            ray.get(actor.ready.remote(), timeout=timeout_s)
        except ray.exceptions.RayActorError:
            return
        assert time.monotonic() < deadline, f"{actor} still answers {timeout_s:.0f} s after ray.kill"
        time.sleep(0.01)
