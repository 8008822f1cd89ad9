"""What the controller's event pump hands back. Schedulers see `Scored` and `Aborted` (`Scheduler.handle`);
`Generated` goes to the reward pool first and comes back as `Scored`."""
from __future__ import annotations

from dataclasses import dataclass

from rlsys.types import Completion, ScoredSample


@dataclass
class Generated:
    """A request finished generating; its reward is still to come."""
    completion: Completion


@dataclass
class Aborted:
    """A request was cut (asked for, or by the engine): its partial output."""
    completion: Completion


@dataclass
class Scored:
    sample: ScoredSample


Event = Generated | Aborted | Scored
