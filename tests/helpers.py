"""What several test files do the way a driver does it."""


def next_step(sched, version, groups, now):
    """Cross a step boundary as the live controller and the simulator do: `on_trained`, then `start`."""
    sched.on_trained(version, groups)
    return sched.start(now)
