"""Trainer: advantages and losses (registries), token-budget micro-batching, torch and DeepSpeed
backends, and the Ray actors that run them. Import the actors from rlsys.trainer.worker."""
from rlsys.trainer.advantages import ADVANTAGES, group_advantages
from rlsys.trainer.batching import StepTotals, TrainSample, build_samples, plan_step
from rlsys.trainer.losses import POLICY_LOSSES, LossInputs, compute_loss, register_policy_loss

__all__ = ["ADVANTAGES", "POLICY_LOSSES", "LossInputs", "StepTotals", "TrainSample", "build_samples",
           "compute_loss", "group_advantages", "plan_step", "register_policy_loss"]
