"""What a scheduler asks the controller to do. Schedulers return lists of these and never act."""
from __future__ import annotations

from dataclasses import dataclass, field

from rlsys.types import Group, Prompt, Request


@dataclass
class Submit:
    """Generate one sample per request id for this prompt (resume fields for partial rollouts)."""
    prompt: Prompt
    request_ids: list[str]
    resume: dict[str, Request] = field(default_factory=dict)


@dataclass
class Abort:
    request_ids: list[str]


@dataclass
class Train:
    groups: list[Group]


@dataclass
class Accumulate:
    """These complete groups will be in the next Train, unchanged and in this order: a trainer may compute
    their gradients now, while the round still generates (trainer.streamed). A driver is free to ignore it."""
    groups: list[Group]
    train_groups: int  # how many the next Train holds: where a streamed trainer cuts its mini-batches
    # tail's long round, whose slow prompts leave engines idle: trainer.scale_down_at lends GPUs in these only
    long_round: bool = False
