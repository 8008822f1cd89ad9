"""Starting or joining the Ray cluster. Everything rlsys starts listens on localhost unless configured."""
from __future__ import annotations

import os
import time

from rlsys.config import ClusterConfig
from rlsys.logger import waiting


def init_ray(cfg: ClusterConfig | None = None):
    import ray

    if ray.is_initialized():
        return
    cfg = cfg or ClusterConfig()
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    if cfg.address:
        with waiting(f"joining Ray at {cfg.address}"):
            ray.init(address=cfg.address, logging_level="WARNING")
        return
    # Logical CPUs: actors alternate between stages in sync mode, so oversubscribing is harmless.
    with waiting("starting Ray"):
        ray.init(num_cpus=cfg.num_cpus or max(8, os.cpu_count() or 1), include_dashboard=False,
                 dashboard_host=cfg.dashboard_host, logging_level="WARNING", configure_logging=True)


def death_reason(error) -> str:
    """The last line of Ray's report on a dead actor: what killed it."""
    return str(error).splitlines()[-1].rstrip(".")


def actor_id(handle) -> str:
    """An actor handle's id, as a RayActorError reports the actor that died (`error.actor_id`)."""
    return handle._actor_id.hex()


class NotDone(TimeoutError):
    """`get_each` ran out of time; `pending` holds the refs that had not finished."""

    def __init__(self, pending: list):
        super().__init__(f"{len(pending)} call(s) not finished")
        self.pending = pending


def get_each(refs: list, timeout_s: float | None = None) -> list:
    """ray.get of every ref, in order, except that a failure is raised as soon as it happens, not after the
    refs before it finish (they may be waiting for the failed party in a collective until their own
    deadlines). Past `timeout_s`, NotDone."""
    import ray

    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    pending = list(refs)
    while pending:
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        ready, pending = ray.wait(pending, num_returns=1, timeout=left)
        if not ready:
            raise NotDone(pending)
        ray.get(ready)
    return ray.get(list(refs))
