"""Starting or joining the Ray cluster. Everything rlsys starts listens on localhost unless configured."""
from __future__ import annotations

import os

from rlsys.config import ClusterConfig


def init_ray(cfg: ClusterConfig | None = None):
    import ray

    if ray.is_initialized():
        return
    cfg = cfg or ClusterConfig()
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    if cfg.address:
        ray.init(address=cfg.address, logging_level="WARNING")
        return
    # Logical CPUs: actors alternate between stages in sync mode, so oversubscribing is harmless.
    ray.init(num_cpus=cfg.num_cpus or max(8, os.cpu_count() or 1), include_dashboard=False,
             dashboard_host=cfg.dashboard_host, logging_level="WARNING", configure_logging=True)


def death_reason(error) -> str:
    """The last line of Ray's report on a dead actor: what killed it."""
    return str(error).splitlines()[-1].rstrip(".")
