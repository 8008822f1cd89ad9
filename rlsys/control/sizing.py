"""Group sizers choose the shape of the next step (prompts x samples per prompt) at step boundaries."""
from __future__ import annotations

from dataclasses import dataclass

from rlsys.config import ControlConfig
from rlsys.registry import Registry
from rlsys.types import Group


@dataclass(frozen=True)
class StepShape:
    prompts: int
    group_size: int


class GroupSizer:
    def __init__(self, cfg: ControlConfig):
        self.cfg = cfg

    def next_shape(self) -> StepShape:
        raise NotImplementedError

    def observe(self, groups: list[Group]) -> None:
        """Called once per trained step with the realised groups."""

    def workload_changed(self) -> None:
        """The run changed what it asks for from the next step on (a new cap on answers)."""

    def metrics(self) -> dict[str, float]:
        return {}

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


GROUP_SIZERS: Registry[type[GroupSizer]] = Registry("group sizer")


@GROUP_SIZERS.register("fixed")
class FixedGroupSizer(GroupSizer):
    def next_shape(self) -> StepShape:
        return StepShape(self.cfg.prompts_per_step, self.cfg.group_size)
