"""Trainer actors: one `TrainerWorker` per data-parallel rank, driven by a `TrainerGroup` in the driver.

The group turns scored groups into samples with advantages, plans the step (each rank's samples,
the step totals, the micro-batch count every rank runs) and merges the ranks' statistics. Files
(checkpoints, exports) are written by the workers, so on several nodes the run folder must be on a
shared filesystem. A rank that dies cannot be replaced mid-run (its optimizer state and its place in
the collectives are gone): the group raises `TrainerDied`, naming it, and the run resumes from its
last checkpoint.
"""
from __future__ import annotations

import json
import logging
import os
import random
import shutil
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import ray
import torch
from ray.exceptions import RayActorError, RayError

from rlsys.cluster import NotDone, actor_id, death_reason, get_each
from rlsys.config import Config, TrainerConfig
from rlsys.emulate import Emulation, TrainerPacer
from rlsys.errors import UserError
from rlsys.logger import waiting
from rlsys.placement import TRAINER
from rlsys.registry import Registry
from rlsys.trainer.advantages import KLController
from rlsys.trainer.backend import TorchBackend, TrainerBackend
from rlsys.trainer.critic import CRITIC_DIR, TorchCritic, critic_config, train_ppo_step
from rlsys.trainer.batching import (TOKEN_KL_ADVANTAGES, StepTotals, TrainSample, build_samples, later_passes,
                                   mini_batch_ends, pack_micro_batches, place_token_kl, plan_step, sampled_by,
                                   split_mini_batches)
from rlsys.trainer.logprobs import Scoring
from rlsys.trainer.losses import mismatch_warning
from rlsys.trainer.streamed import StreamedGradients
from rlsys.types import Group
from rlsys.weights import BucketPlan, Receiver, Sender, Transport, WeightGroup, plan_buckets

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.json", "merges.txt", "vocab.txt", "tokenizer.model", "chat_template.jinja")
# everything else a rank reports is its share of a sum
SAME_ON_ALL_RANKS = ("grad_norm", "skipped_steps", "critic_grad_norm", "critic_skipped_steps", "lr", "critic_lr")
KL_COEF_FILE = "kl_in_reward.json"  # trainer.kl.in_reward's coefficient, beside the weights in a checkpoint
DEATH_GRACE_S = 5.0  # a dead rank's peers may report the broken connection before Ray reports the death
log = logging.getLogger(__name__)

BACKENDS: Registry[Callable[..., TrainerBackend]] = Registry("trainer backend")  # `trainer.backend`
Updates = list[tuple[list[int], StepTotals]]  # a rank's updates over its samples, by index (batching.later_passes)


def taken_from(samples: list[TrainSample], updates: Updates) -> list[tuple[list[TrainSample], StepTotals]]:
    return [([samples[i] for i in indices], totals) for indices, totals in updates]


@BACKENDS.register("torch")
def _torch_backend(*args, critic: bool = False) -> TrainerBackend:
    return (TorchCritic if critic else TorchBackend)(*args)


@BACKENDS.register("deepspeed")
def _deepspeed_backend(*args, critic: bool = False) -> TrainerBackend:
    from rlsys.trainer.deepspeed_backend import DeepSpeedBackend, DeepSpeedCritic  # imports deepspeed: if chosen
    return (DeepSpeedCritic if critic else DeepSpeedBackend)(*args)


class TrainerDied(RuntimeError):
    """A trainer rank's actor died (killed, out of memory, node lost)."""

    def __init__(self, rank: int, why: str):
        super().__init__(f"trainer rank {rank} died ({why})")
        self.rank, self.why = rank, why


@ray.remote
class TrainerWorker:
    def __init__(self, cfg: TrainerConfig, model_dir: str, scoring: Scoring, rank: int, world_size: int):
        self.cfg, self.model_dir, self.scoring, self.rank, self.world_size = cfg, model_dir, scoring, rank, world_size
        self.backend = None
        self.critic = None  # trainer.advantage=gae: PPO's value model, a second backend on this rank (critic.py)
        self.stream: StreamedGradients | None = None
        self.weight_group: WeightGroup | None = None  # a transport's own group (broadcast), on rank 0
        self.sender: Sender | None = None  # on the ranks that send the weights to the engines

    def gpu_ids(self) -> list:
        """The GPUs Ray gave this actor (its placement bundle's)."""
        return ray.get_gpu_ids()

    def node_ip(self) -> str:
        return ray.util.get_node_ip_address()

    def gpus(self) -> tuple[str, list]:
        """This actor's node and Ray GPU ids, as a rollout worker's `gpus` gives them."""
        return self.node_ip(), self.gpu_ids()

    def free_port(self) -> int:
        with socket.socket() as s:
            s.bind(("", 0))
            return s.getsockname()[1]

    def setup(self, master_addr: str, master_port: int, torch_threads: int, pacer: TrainerPacer | None = None) -> None:
        # Each actor owns one device (Ray narrows CUDA_VISIBLE_DEVICES), hence LOCAL_RANK 0.
        os.environ.update(MASTER_ADDR=master_addr, MASTER_PORT=str(master_port), RANK=str(self.rank),
                          WORLD_SIZE=str(self.world_size), LOCAL_RANK="0")
        import torch
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # one bar per load per rank would flood the driver's log
        torch.set_num_threads(torch_threads)
        self.backend = BACKENDS.get(self.cfg.backend)(self.cfg, self.model_dir, self.scoring, self.rank,
                                                      self.world_size)
        self.backend.pacer = pacer
        if self.cfg.advantage == "gae":
            self.critic = BACKENDS.get(self.cfg.backend)(critic_config(self.cfg), self.model_dir, self.scoring,
                                                         self.rank, self.world_size, critic=True)

    def lend(self, gpus: tuple[int, ...] | None) -> None:
        """emulate: pace the next micro-batches on these modelled GPUs (None: the rank's own); see TrainerPacer."""
        if self.backend.pacer:
            self.backend.pacer.lend(gpus)

    def stream_begin(self, version: int | None = None) -> None:
        if self.stream is not None:
            raise RuntimeError("stream_begin: the previous streamed step was never finished")
        self.stream = StreamedGradients(self.backend, version)

    def stream_accumulate(self, samples: list[TrainSample], micro_batches: int) -> None:
        if self.stream is None:
            raise RuntimeError("stream_accumulate: no streamed step is open (stream_begin first)")
        self.stream.accumulate(samples, micro_batches)

    def stream_close(self, tokens: int, sequences: int, *parts) -> None:
        # `parts`: this rank's calls so far, resolved by Ray first, so a failed part fails the update.
        if self.stream is None:
            raise RuntimeError("stream_close: no streamed step is open (stream_begin first)")
        self.stream.close(tokens, sequences)

    def stream_finish(self, tokens: int, sequences: int, *parts) -> dict:
        if self.stream is None:
            raise RuntimeError("stream_finish: no streamed step is open (stream_begin first)")
        stream, self.stream = self.stream, None
        return stream.finish(tokens, sequences)

    def token_kl(self, samples: list[TrainSample], micro_batches: int) -> list[list[float]]:
        return self.backend.token_kl(samples, micro_batches)

    def train_mini_batches(self, parts: list[tuple[list[TrainSample], StepTotals]], fresh: bool,
                           proximal_micro_batches: int, version: int | None = None, value_micro_batches: int = 0,
                           later: Updates = (), critic_updates: Updates | None = None) -> dict:
        """`parts`: this rank's samples in the first pass's mini-batches; `later`: the further passes
        (trainer.ppo_epochs) over them, as indices; `critic_updates`: the critic's own passes, where its mini-batches
        or epochs differ (None: the policy's)."""
        samples = [s for part, _ in parts for s in part]
        every_pass = parts + taken_from(samples, later)
        if self.critic is not None:
            critic_parts = every_pass if critic_updates is None else taken_from(samples, critic_updates)
            return train_ppo_step(self.backend, self.critic, samples, every_pass, critic_parts, fresh,
                                  proximal_micro_batches, version, value_micro_batches)
        return self.backend.train_mini_batches(every_pass, fresh, proximal_micro_batches, version)

    def join_weight_group(self, host: str, port: int, world_size: int, backend: str, timeout_s: float,
                          names: list[str]) -> None:
        self.weight_group = WeightGroup(host, port, 0, world_size, backend, timeout_s, names)

    def open_sender(self, transport: Transport):
        """This rank sends every version from now on; returns what its receivers need to find it."""
        self.sender = transport.sender(f"trainer rank {self.rank}", self.weight_group, self.node_ip())
        return self.sender.address()

    def weight_plans(self, budget_bytes: int, dtype) -> list[BucketPlan]:
        """The rollout weights' bucket plans, from their shapes alone."""
        return plan_buckets(self.backend.published_shapes(), budget_bytes, dtype)

    def send_weights(self, plans: list[BucketPlan], version: int) -> Receiver | None:
        """Read the weights one parameter at a time (under ZeRO-3 every rank must, to gather them); a
        sending rank packs and ships them as they come. Returns the sender's receiver description, if any."""
        weights = self.backend.published_weights()
        if self.sender is None:
            for _ in weights:
                pass
            return None
        return self.sender.send(plans, weights, version)

    def release_cached_memory(self) -> None:
        """Hand the blocks torch's allocator keeps cached back to the GPU, for an engine waking its KV cache there."""
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def save(self, folder: str) -> None:
        self.backend.save(folder)
        if self.critic is not None:
            self.critic.save(str(Path(folder) / CRITIC_DIR))

    def load(self, folder: str) -> None:
        self.backend.load(folder)
        if self.critic is not None:
            self.critic.load(str(Path(folder) / CRITIC_DIR))

    def export_hf(self, folder: str) -> None:
        self.backend.export_hf(folder)


START_TIMEOUT_S = 300.0  # for Ray to find every rank the resources it asks for


class NotScheduled(UserError, RuntimeError):
    """Ray could not give a trainer rank what it asks for."""


def started(refs: list[ray.ObjectRef], options: dict) -> list:
    """The ranks' first calls' results; a clear error where Ray cannot schedule a rank, never a wait forever."""
    timeout_s = START_TIMEOUT_S
    try:
        return get_each(refs, timeout_s)
    except NotDone as e:
        asks = {k: v for k, v in options.items() if k in ("num_cpus", "num_gpus")} or "a placement bundle"
        raise NotScheduled(f"{len(e.pending)} of {len(refs)} trainer rank(s) did not start within {timeout_s:g} s: "
                           f"each asks Ray for {asks} and the cluster has {ray.available_resources()} free "
                           "(a rollout worker may hold the GPU: set cluster.gpus_per_node)") from None


def done_or_failed(refs: list[ray.ObjectRef]) -> bool:
    """Every rank is done, or one failed: the others may wait for it in a collective until they time out."""
    ready, pending = ray.wait(refs, num_returns=len(refs), timeout=0)
    try:
        ray.get(ready)
    except RayError:
        return True
    return not pending


@dataclass
class RunningStream:
    """A streamed step between `stream_begin` and `stream_end`, as the driver tracks it."""
    calls: list[list[ray.ObjectRef]]  # each rank's calls, handed to its updates: an error in any fails the step
    ends: list[int]  # groups streamed when each mini-batch is complete
    groups: int = 0  # groups streamed so far
    tokens: int = 0  # response tokens of the open mini-batch so far, over every rank
    sequences: int = 0
    waiting: list = field(default_factory=list)  # completed groups held while the ranks are busy


def merge_metrics(per_rank: list[dict]) -> dict:
    keys = {k for m in per_rank for k in m}
    merged = {k: sum(m.get(k, 0.0) for m in per_rank) for k in keys if k not in SAME_ON_ALL_RANKS}
    merged.update({k: per_rank[0][k] for k in SAME_ON_ALL_RANKS if k in per_rank[0]})
    return merged


class TrainerGroup:
    """The run's trainer ranks; they score tokens by `scoring`, the run's (Scoring.of its rollout config)."""

    def __init__(self, cfg: Config, model_dir: str, scoring: Scoring, placement=None):
        self.cfg = cfg.trainer
        world = self.cfg.world_size
        if self.cfg.backend == "torch" and world > 1:  # refused before any actor starts
            raise ValueError(f"trainer.backend=torch runs on one rank, got trainer.world_size={world}; "
                             "use trainer.backend=deepspeed for data parallelism")
        gpus = 1 if ray.cluster_resources().get("GPU", 0) > 0 else 0
        options = ((lambda rank: placement.actor_options(TRAINER, rank)) if placement
                   else (lambda rank: {"num_cpus": 1, "num_gpus": gpus}))
        with waiting(f"starting the trainer ({world} rank(s), {self.cfg.backend})"):
            self.workers = [TrainerWorker.options(**options(rank)).remote(self.cfg, model_dir, scoring, rank, world)
                            for rank in range(world)]
            ips = started([w.node_ip.remote() for w in self.workers], options(0))
            port = ray.get(self.workers[0].free_port.remote())
            emulation = Emulation.of(cfg) if cfg.emulate.on else None
            self._get_all([w.setup.remote(ips[0], port, cfg.cluster.torch_threads,
                                          emulation and emulation.trainer_pacer(world, rank))
                           for rank, w in enumerate(self.workers)])
        self.stream: RunningStream | None = None
        kl = self.cfg.kl
        self.kl_in_reward = KLController(kl.coef, kl.target, kl.horizon) if kl.in_reward else None
        self.reward_kl_metrics: dict = {}  # of the last step started, merged into its metrics

    # --- training -----------------------------------------------------------------------------
    def start_train_step(self, groups: list[Group], version: int | None = None) -> list[ray.ObjectRef]:
        """Launch the step and return at once; pass the refs to `finish_train_step` (or ray.wait on them).
        `version` is the trainer's current policy version: samples wholly generated by it need no
        recomputed proximal log-probs (None: recompute whenever there is more than one mini-batch)."""
        samples = self._build_samples(groups)
        if self.kl_in_reward is not None:
            samples = self._with_kl_in_reward(groups, samples)
        world, budget = self.cfg.world_size, self.cfg.micro_batch_tokens
        plans = [plan_step(part, world, budget) for part in split_mini_batches(samples, self.cfg.mini_batches)]
        fresh = sampled_by(samples, version)  # over the whole step: every rank takes pi_prox alike
        parts = [[(per_rank[rank], totals) for per_rank, totals in plans] for rank in range(world)]
        # Every rank runs as many proximal forwards as the busiest one (ZeRO-3 gathers on each forward).
        proximal_micro_batches = max(len(pack_micro_batches([s for part, _ in mine[1:] for s in part], budget))
                                     for mine in parts)  # the first part needs none (backend.train_mini_batches)
        value_micro_batches = 0 if self.cfg.advantage != "gae" else max(  # the critic values every sample
            len(pack_micro_batches([s for part, _ in mine for s in part], budget)) for mine in parts)
        later, critic_updates = self._later_passes([[s for part, _ in mine for s in part] for mine in parts], version)
        return [w.train_mini_batches.remote(mine, fresh, proximal_micro_batches, version, value_micro_batches,
                                            later[rank], None if critic_updates is None else critic_updates[rank])
                for rank, (w, mine) in enumerate(zip(self.workers, parts))]

    def _later_passes(self, per_rank: list[list[TrainSample]], version: int | None) -> tuple[list, list | None]:
        """Each rank's updates of the passes after the first (trainer.ppo_epochs), each pass in a fresh order
        seeded by trainer.seed and the step's version; and the critic's own passes where trainer.critic sets
        other mini-batches or epochs (its first pass in order), else None."""
        rng = random.Random(f"ppo_epochs/{self.cfg.seed}/{version}")
        budget, critic = self.cfg.micro_batch_tokens, self.cfg.critic

        def shuffled(passes: int) -> list[list[list[int]]]:
            return [[rng.sample(range(len(mine)), len(mine)) for mine in per_rank] for _ in range(passes)]

        later = later_passes(per_rank, shuffled(self.cfg.ppo_epochs - 1), self.cfg.mini_batches, budget)
        own = (critic.mini_batches or self.cfg.mini_batches, critic.ppo_epochs or self.cfg.ppo_epochs)
        if self.cfg.advantage != "gae" or own == (self.cfg.mini_batches, self.cfg.ppo_epochs):
            return later, None
        in_order = [[list(range(len(mine))) for mine in per_rank]]
        return later, later_passes(per_rank, in_order + shuffled(own[1] - 1), own[0], budget)

    def _build_samples(self, groups: list[Group], penalties: list[float] | None = None) -> list[TrainSample]:
        return build_samples(groups, self.cfg.advantage, penalties, self.cfg.mask_truncated_completions)

    def _with_kl_in_reward(self, groups: list[Group], samples: list[TrainSample]) -> list[TrainSample]:
        """The samples again, their rewards less coef x their KL to the reference (one reference forward on
        every rank), or with trainer.kl.reward_level=token under gae and reinforce_pp each token's off its own;
        then the coefficient moves towards its target."""
        per_rank, totals = plan_step(samples, self.cfg.world_size, self.cfg.micro_batch_tokens)
        found = self._get_all([w.token_kl.remote(mine, totals.micro_batches)
                               for w, mine in zip(self.workers, per_rank)])
        kl_of = {id(s): kl for mine, kls in zip(per_rank, found) for s, kl in zip(mine, kls)}
        token_kls = [kl_of[id(s)] for s in samples]
        kls = [sum(kl) for kl in token_kls]
        controller = self.kl_in_reward
        if self.cfg.kl.reward_level == "token" and self.cfg.advantage in TOKEN_KL_ADVANTAGES:
            penalised = self._build_samples(groups)  # the same samples, in order, their own rewards
            place_token_kl(penalised, [[controller.coef * k for k in kl] for kl in token_kls], self.cfg.advantage)
        else:
            penalised = self._build_samples(groups, [controller.coef * kl for kl in kls])
        mean_kl = sum(kl / max(s.trained_tokens, 1) for kl, s in zip(kls, samples)) / max(len(samples), 1)
        self.reward_kl_metrics = {"reward_kl": mean_kl, "reward_kl_coef": controller.coef}
        controller.update(mean_kl, len(samples))
        return penalised

    def finish_train_step(self, refs: list[ray.ObjectRef]) -> dict:
        """Merged metrics: sums of the ranks' shares, and grad_norm / skipped_steps from rank 0. The mismatch
        warning is raised here, where the step's KL is first whole (each rank holds a share)."""
        metrics = merge_metrics(self._get_all(refs)) | self.reward_kl_metrics
        warning = mismatch_warning(metrics, self.cfg)
        if warning:
            log.warning(warning)
        return metrics

    # --- streamed step (trainer.streamed, streamed.py): groups train as they complete ------------------
    def stream_begin(self, step_groups: int, version: int | None = None) -> None:
        """Open a streamed step of `step_groups` groups, started by the weights of `version`. Its groups are cut
        into trainer.mini_batches contiguous mini-batches in the order they come, at `mini_batch_ends` over
        groups (the synchronous step cuts its samples there: the same mini-batches when the groups' sample
        counts are equal and the mini-batch count divides the group count)."""
        self.stream = RunningStream([[w.stream_begin.remote(version)] for w in self.workers],
                                    mini_batch_ends(step_groups, self.cfg.mini_batches))

    def stream_groups(self, groups: list[Group]) -> list[ray.ObjectRef]:
        """Accumulate the gradients of these completed groups, and run the update of each mini-batch they
        complete (but the step's last: `stream_end`); returns at once the calls made, one per rank each. A
        part waits while the ranks are busy with the last call. A group's advantages need only its own rewards."""
        stream = self.stream
        if stream is None:
            raise RuntimeError("stream_groups: call stream_begin first")
        refs = []
        for group in groups:
            stream.waiting.append(group)
            stream.groups += 1
            if stream.groups in stream.ends[:-1]:
                refs += self._send_waiting() + self._update("stream_close")
        calls = stream.calls  # each rank's stream_begin, then its parts and updates
        if len(calls[0]) > 1 and not done_or_failed([mine[-1] for mine in calls]):
            return refs  # sent with the next part: one part of many groups costs less than many parts of one
        return refs + self._send_waiting()

    def lend(self, per_rank: list[tuple[int, ...]] | None) -> None:
        """Each rank's micro-batches from its next call on are paced on these modelled GPUs (None: their own); calls
        to an actor run in order, so work sent before still runs where it was sent. In the open stream's calls, so a
        failure fails the step."""
        refs = [w.lend.remote(gpus) for w, gpus in zip(self.workers, per_rank or [None] * len(self.workers))]
        for calls, ref in zip(self.stream.calls if self.stream else [], refs):
            calls.append(ref)

    def _send_waiting(self) -> list[ray.ObjectRef]:
        groups, self.stream.waiting = self.stream.waiting, []
        if not groups:
            return []
        samples = self._build_samples(groups)
        per_rank, part = plan_step(samples, self.cfg.world_size, self.cfg.micro_batch_tokens)
        self.stream.tokens += part.tokens
        self.stream.sequences += part.sequences
        refs = [w.stream_accumulate.remote(mine, part.micro_batches) for w, mine in zip(self.workers, per_rank)]
        for calls, ref in zip(self.stream.calls, refs):
            calls.append(ref)
        return refs

    def _update(self, method: str) -> list[ray.ObjectRef]:
        """Each rank's update of the open mini-batch (`stream_close`, or `stream_finish` for the last)."""
        stream = self.stream
        refs = [getattr(w, method).remote(stream.tokens, stream.sequences, *calls)
                for w, calls in zip(self.workers, stream.calls)]
        for calls, ref in zip(stream.calls, refs):
            calls.append(ref)
        stream.tokens = stream.sequences = 0
        return refs

    def stream_end(self) -> list[ray.ObjectRef]:
        """Launch the step's last optimizer update; pass the refs to `finish_train_step` (or ray.wait on them)."""
        if self.stream is None:
            raise RuntimeError("stream_end: call stream_begin first")
        self._send_waiting()
        refs, self.stream = self._update("stream_finish"), None
        return refs

    # --- weights and files ------------------------------------------------------------------------
    def open_senders(self, transport: Transport, ranks: list[int]) -> list:
        """These ranks send every version from now on; their addresses, for the receivers."""
        return self._get_all([self.workers[r].open_sender.remote(transport) for r in ranks])

    def weight_plans(self, budget_bytes: int, dtype) -> list[BucketPlan]:
        return self._get_all([self.workers[0].weight_plans.remote(budget_bytes, dtype)])[0]

    def send_weights(self, plans: list[BucketPlan], version: int, senders: list[int]) -> dict[str, ray.ObjectRef]:
        """Start sending: the senders' calls by name (rank 0's first; each returns its receiver description
        or None), with those of the ranks that only take part in ZeRO-3's gathers."""
        ranks = range(len(self.workers)) if self._gathers_on_all() else senders
        return {f"trainer rank {rank}": self.workers[rank].send_weights.remote(plans, version) for rank in ranks}

    def gpus(self) -> list[tuple[str, list]]:
        """Each rank's node and Ray GPU ids."""
        return self._get_all([w.gpus.remote() for w in self.workers])

    def join_weight_group(self, host: str, port: int, world_size: int, backend: str, timeout_s: float,
                          names: list[str]) -> dict[str, ray.ObjectRef]:
        """Start rank 0's join of the weight group it hosts at host:port (rank 0 of it); its call by name."""
        return {"trainer rank 0": self.workers[0].join_weight_group.remote(host, port, world_size, backend,
                                                                           timeout_s, names)}

    def weight_group_address(self) -> tuple[str, int]:
        """Where rank 0 can host the weight group: its node's address and a free port there."""
        rank0 = self.workers[0]
        return tuple(self._get_all([rank0.node_ip.remote(), rank0.free_port.remote()]))

    def raise_if_rank_died(self, error: RayActorError) -> None:
        """TrainerDied if `error` is a rank's death (seen on a call the caller waited on itself)."""
        self._raise_if_a_rank_died(error, [])

    def release_cached_memory(self) -> None:
        self._get_all([w.release_cached_memory.remote() for w in self.workers])

    def save(self, folder: str) -> None:
        self._get_all([w.save.remote(folder) for w in self.workers])
        if self.kl_in_reward is not None:  # the adapted coefficient goes on where it was
            (Path(folder) / KL_COEF_FILE).write_text(json.dumps({"coef": self.kl_in_reward.coef}))

    def load(self, folder: str) -> None:
        self._get_all([w.load.remote(folder) for w in self.workers])
        saved = Path(folder) / KL_COEF_FILE
        if self.kl_in_reward is not None and saved.exists():
            self.kl_in_reward.coef = json.loads(saved.read_text())["coef"]

    def export_hf(self, folder: str, tokenizer_dir: str) -> None:
        """A standard HF folder (config, safetensors weights, tokenizer files) loadable by from_pretrained."""
        self._get_all([w.export_hf.remote(folder) for w in self.workers])
        for name in TOKENIZER_FILES:
            if (Path(tokenizer_dir) / name).exists():
                shutil.copy2(Path(tokenizer_dir) / name, Path(folder) / name)

    def shutdown(self) -> None:
        for w in self.workers:
            ray.kill(w)
        self.workers = []

    def _gathers_on_all(self) -> bool:
        """Reading the weights is a collective (ZeRO-3): every rank takes part, whichever sends."""
        return self.cfg.backend == "deepspeed" and self.cfg.zero_stage == 3

    def _get_all(self, refs: list[ray.ObjectRef]) -> list:
        """Like ray.get, but a rank's error is raised as soon as it happens, not after the ranks still
        blocked in a collective with it time out; a dead rank as TrainerDied."""
        try:
            return get_each(refs)
        except RayError as e:
            self._raise_if_a_rank_died(e, refs)
            raise

    def _raise_if_a_rank_died(self, error: RayError, others: list[ray.ObjectRef]) -> None:
        """TrainerDied if `error`, or one of `others` failing soon after it, is a rank's death."""
        if not isinstance(error, RayActorError):  # e.g. a peer's broken connection: look for the cause
            ready, _ = ray.wait(others, num_returns=len(others), timeout=DEATH_GRACE_S)
            for ref in ready:
                try:
                    ray.get(ref)
                except RayActorError as e:
                    error = e
                    break
                except RayError:
                    pass
        ranks = {actor_id(w): rank for rank, w in enumerate(self.workers)}
        if isinstance(error, RayActorError) and error.actor_id in ranks:
            raise TrainerDied(ranks[error.actor_id], death_reason(error)) from None
