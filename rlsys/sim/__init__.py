"""A discrete-event simulator of a GPU cluster that drives the same control/ schedulers as training.

`simulate(config)` runs every scheduler a workload config lists (configs/sim/*.yaml) and returns
step time, bubble ratio, straggler rate, throughput and speedup against `sync`.
"""
from rlsys.sim.run import simulate  # noqa: F401
