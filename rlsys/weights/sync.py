"""A run's weight publishing: after each train step the trainer's weights reach every rollout engine, in
buckets of `weights.bucket_mb`, by the transport `weights.transfer` names (rlsys/weights/transfer.py).

At start the transport is chosen and set up once: its weight group built (broadcast: trainer rank 0, which
hosts its store, and every engine process, ranks 1..), and its senders opened (trainer rank 0, or with
cuda_ipc every trainer rank on an engine's GPU). Each version then streams from the trainer's parameters
into at most two bucket buffers per sender; the engines receive as it is sent (broadcast, cuda_ipc) or
once it is in the object store (object_store, whose buckets a replaced rollout worker loads too).

A new rollout worker could not get the weights by broadcast (it is not in the group) or CUDA IPC (its GPU's
trainer rank shares with the old one), so with those a rollout worker's death stops the run (RunStopped)
and --resume goes on from the last checkpoint; rebuilding the group around a replacement is not done yet.
Every wait has a deadline: a party that does not join or finish fails with WeightTransferTimeout naming
it, and a party's failure is raised as soon as it happens.
"""
from __future__ import annotations

import ray
import torch
from ray.exceptions import RayActorError

from rlsys.weights.transfer import WeightUpdate, make_transport, wait_for_engines

GRACE_S = 5.0  # past weights.timeout_s: the parties' own deadlines, whose errors say what they waited for, come first


class WeightSync:
    def __init__(self, cfg, trainer, rollout):
        """`trainer`: the run's TrainerGroup, `rollout`: its RolloutManager. Sets the transport up."""
        self.trainer, self.rollout, self.timeout_s = trainer, rollout, cfg.weights.timeout_s
        vllm = cfg.rollout.engine == "vllm"
        self.transport = make_transport(cfg.weights, cfg.rollout.on_gpu)
        what = f"weights.transfer={self.transport.name}"
        if self.transport.on_gpus and not ray.cluster_resources().get("GPU"):
            raise ValueError(f"{what} needs GPUs and this Ray cluster has none; "
                             "weights.transfer=object_store or broadcast run without them")
        if not self.transport.restartable:
            rollout.restarts_refused = what
        if self.transport.group_backend:
            self._join(cfg.rollout.tensor_parallel_size if vllm else 1, self.transport.group_backend)
        wire = getattr(torch, cfg.rollout.engine_dtype) if vllm else None  # None: as the trainer has them
        self.plans = trainer.weight_plans(int(cfg.weights.bucket_mb * 2**20), wire)
        self.senders = self._sending_ranks() if self.transport.from_every_gpu else [0]
        self.receiver = self.transport.receiver(trainer.open_senders(self.transport, self.senders))

    def publish(self, version: int) -> None:
        """Blocking: every engine's next decode step uses the trainer's current weights, tagged `version`."""
        sending = self.trainer.send_weights(self.plans, version, self.senders)
        if self.transport.streams:  # the engines receive while the trainer sends
            update = WeightUpdate(version, self.plans, self.receiver)
            self._wait({**sending, **self.rollout.receive_weights(update)})
            return
        receiver = self._wait(sending)[0]  # rank 0's: this version's own
        self.rollout.update_weights(WeightUpdate(version, self.plans, receiver))

    def _sending_ranks(self) -> list[int]:
        """The trainer ranks whose GPU an engine uses: each shares its buffers with that engine."""
        engine_gpus = {(node, g) for node, ids in self.rollout.gpus() for g in ids}
        ranks = [r for r, (node, ids) in enumerate(self.trainer.gpus()) if any((node, g) in engine_gpus for g in ids)]
        if not ranks:
            raise ValueError(f"weights.transfer={self.transport.name}: no trainer rank shares a GPU with an engine "
                             "(cluster.layout=colocated places them together)")
        return ranks

    def _join(self, ranks_per_engine: int, backend: str) -> None:
        host, port = self.trainer.weight_group_address()
        engines = len(self.rollout.workers)
        world = 1 + engines * ranks_per_engine
        tp = [f" (TP rank {t})" if ranks_per_engine > 1 else "" for t in range(ranks_per_engine)]
        names = ["trainer rank 0"] + [f"rollout worker {i}{t}" for i in range(engines) for t in tp]
        hosting = self.trainer.join_weight_group(host, port, world, backend, self.timeout_s, names)
        joining = self.rollout.join_weight_group(host, port, world, ranks_per_engine, backend, self.timeout_s)
        self._wait(hosting)  # first: rank 0 names the ranks that did not join
        self._wait(joining)

    def _wait(self, calls: dict) -> list:
        try:
            return wait_for_engines(calls, self.timeout_s + GRACE_S)
        except RayActorError as e:  # a trainer rank's death and a rollout worker's each have their own handling
            self.trainer.raise_if_rank_died(e)
            self.rollout.worker_died(e)
            raise
