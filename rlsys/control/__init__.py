"""Pure control policies: schedulers, group sizers, the prompt ledger and the rollout metrics."""
from rlsys.control import sync  # noqa: F401  (registers the built-in schedulers)
from rlsys.control import sagc, tail  # noqa: F401  (register the `sagc` sizer and `tail` scheduler)
from rlsys.control import sorted as _sorted  # noqa: F401  (registers the `sorted` scheduler)
from rlsys.control import staleness  # noqa: F401  (registers the `async` scheduler)
from rlsys.control.scheduler import SCHEDULERS
from rlsys.control.sizing import GROUP_SIZERS


def build_scheduler(cfg, cursor):
    """The scheduler and group sizer named in `cfg.control`."""
    sizer = GROUP_SIZERS.get(cfg.control.group_sizer)(cfg.control)
    return SCHEDULERS.get(cfg.control.scheduler)(cfg.control, cursor, sizer)
