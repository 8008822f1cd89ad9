"""A run's weight publishing: after each train step the trainer's weights reach every rollout engine, in
buckets of `weights.bucket_mb`, by the transport `weights.transfer` names (rlsys/weights/transfer.py):

  object_store  trainer rank 0 puts one object per bucket; each engine loads them one at a time. A replaced
                rollout worker loads the same objects (the manager keeps them until the next version).
  broadcast     a weight group of trainer rank 0 (which hosts its store) and every engine process, ranks 1..,
                built here at start; rank 0 broadcasts each bucket while the engines receive it. NCCL for
                vLLM engines, gloo for the CPU engine.
  cuda_ipc      colocated on GPUs: every trainer rank shares its buckets with the engine on its GPU by CUDA
                IPC handle, and frees them once every engine has copied them.

A new rollout worker could not get the weights by broadcast (it is not in the group) or CUDA IPC (the
buffers are freed), so with those a rollout worker's death stops the run (RunStopped) and --resume
goes on from the last checkpoint; rebuilding the group around a replacement is not done yet.
Every wait has a deadline: a party that does not join or finish fails with WeightTransferTimeout naming
it, and a party's failure is raised as soon as it happens.
"""
from __future__ import annotations

import ray
import torch
from ray.exceptions import RayActorError

from rlsys.weights.transfer import WeightUpdate, wait_for_engines

GRACE_S = 5.0  # past weights.timeout_s: the parties' own deadlines, whose errors say what they waited for, come first


class WeightSync:
    def __init__(self, cfg, trainer, rollout):
        """`trainer`: the run's TrainerGroup, `rollout`: its RolloutManager. With broadcast, builds the group."""
        self.trainer, self.rollout = trainer, rollout
        self.transfer, self.timeout_s = cfg.weights.transfer, cfg.weights.timeout_s
        self.bucket_bytes = int(cfg.weights.bucket_mb * 2**20)
        vllm = cfg.rollout.engine == "vllm"
        self.wire_dtype = getattr(torch, cfg.rollout.engine_dtype) if vllm else None  # None: as the trainer has them
        on_gpus = self.transfer == "cuda_ipc" or (self.transfer == "broadcast" and vllm)
        self.device = "cuda" if on_gpus else "cpu"  # where the trainer packs each bucket
        if self.transfer == "cuda_ipc" and not ray.cluster_resources().get("GPU"):
            raise ValueError("weights.transfer=cuda_ipc needs GPUs and this Ray cluster has none; "
                             "weights.transfer=object_store or broadcast run without them")
        if self.transfer != "object_store":
            rollout.restarts_refused = f"weights.transfer={self.transfer}"
        if self.transfer == "broadcast":
            self._join(cfg.rollout.tensor_parallel_size if vllm else 1, "nccl" if vllm else "gloo")

    def publish(self, version: int) -> None:
        """Blocking: every engine's next decode step uses the trainer's current weights, tagged `version`."""
        plans = self.trainer.stage_weights(self.transfer, self.bucket_bytes, self.wire_dtype)
        sending = self.trainer.send_weights(self.transfer, self.device, self.timeout_s)
        if self.transfer == "broadcast":  # the engines receive while trainer rank 0 sends
            update = WeightUpdate(self.transfer, plans, None, self.timeout_s)
            self._wait({**sending, **self.rollout.receive_broadcast(update, version)})
            return
        tickets = self._wait(sending)  # rank 0's object refs, or every rank's CUDA IPC handles by GPU
        ticket = tickets[0] if self.transfer == "object_store" else {gpu: h for t in tickets for gpu, h in t.items()}
        try:
            self.rollout.update_weights(WeightUpdate(self.transfer, plans, ticket, self.timeout_s), version)
        finally:
            if self.transfer == "cuda_ipc":
                self.trainer.release_weights()

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
