"""Which GPUs each rollout engine and trainer rank gets: a pure planner, its Ray placement groups, a printout.

Layouts:
  colocated  engines and trainer ranks share every GPU, taking turns (veRL's hybrid engine);
  separate   engines on their own GPUs, the trainer on the rest (needed by the async scheduler).
An engine's tensor-parallel GPUs always sit on one node (TP all-reduces run every layer, over NVLink).
Nodes are logical: Ray picks which machine becomes "node 0".
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from rlsys.errors import UserError

Layout = Literal["colocated", "separate"]
ROLLOUT, TRAINER = "rollout", "trainer"


class PlacementError(UserError, ValueError):
    """A plan the config's fields cannot give, or a cluster that cannot hold it: the user's to fix."""


@dataclass(frozen=True)
class Slot:
    role: str  # ROLLOUT (an engine) or TRAINER (a rank)
    index: int  # engine index or trainer rank
    node: int
    gpus: tuple[int, ...]  # GPU indices on that node


@dataclass(frozen=True)
class Plan:
    nodes: int
    gpus_per_node: int
    layout: str
    tp: int
    engines: tuple[Slot, ...]
    trainer: tuple[Slot, ...]

    @property
    def used_gpus(self) -> int:
        return len({(s.node, g) for s in self.engines + self.trainer for g in s.gpus})


def lent_engines(engines: int) -> list[int]:
    """The engines a scale-down frees (trainer.scale_down_at): the second half, which hand their requests to the
    first and lend their GPUs to the streamed trainer."""
    return list(range(max(1, engines // 2), engines))


def plan_placement(nodes: int, gpus_per_node: int, engines: int, tp: int, trainer_world: int,
                   layout: Layout = "colocated") -> Plan:
    """Engines first-fit node by node, then trainer ranks on GPUs in order: the free ones (separate)
    or all of them from the first (colocated). Errors use the config's field names."""
    for name, value in (("cluster.nodes", nodes), ("cluster.gpus_per_node", gpus_per_node),
                        ("rollout.num_workers", engines), ("rollout.tensor_parallel_size", tp),
                        ("trainer.world_size", trainer_world)):
        if value < 1:
            raise PlacementError(f"{name} must be at least 1 to plan GPU placement (got {value})")
    if layout not in ("colocated", "separate"):
        raise PlacementError(f"cluster.layout must be colocated or separate (got {layout!r})")
    if tp > gpus_per_node:
        raise PlacementError(f"rollout.tensor_parallel_size={tp} would span nodes of cluster.gpus_per_node="
                             f"{gpus_per_node} GPUs; tensor parallelism must stay within one node")
    total, rollout_gpus = nodes * gpus_per_node, engines * tp
    shape = f"cluster.nodes={nodes} x cluster.gpus_per_node={gpus_per_node} = {total} GPUs"
    need = rollout_gpus + trainer_world if layout == "separate" else max(rollout_gpus, trainer_world)
    if need > total:
        what = (f"rollout.num_workers={engines} x rollout.tensor_parallel_size={tp} = {rollout_gpus} GPUs"
                + (f" plus trainer.world_size={trainer_world}" if layout == "separate" else
                   f" and trainer.world_size={trainer_world}"))
        raise PlacementError(f"cluster.layout={layout}: {what} need {need} GPUs, more than {shape}")

    free = [list(range(gpus_per_node)) for _ in range(nodes)]
    engine_slots = []
    for i in range(engines):
        node = next((n for n in range(nodes) if len(free[n]) >= tp), None)
        if node is None:  # enough GPUs in total, but split into pieces smaller than one engine
            per_node = gpus_per_node // tp
            raise PlacementError(f"only {per_node} engines of rollout.tensor_parallel_size={tp} fit on a node of "
                                 f"cluster.gpus_per_node={gpus_per_node}, so {nodes} nodes hold {per_node * nodes}, "
                                 f"not rollout.num_workers={engines}")
        engine_slots.append(Slot(ROLLOUT, i, node, tuple(free[node][:tp])))
        del free[node][:tp]
    if layout == "colocated":
        free = [list(range(gpus_per_node)) for _ in range(nodes)]
    open_gpus = [(n, g) for n in range(nodes) for g in free[n]]
    trainer_slots = tuple(Slot(TRAINER, r, n, (g,)) for r, (n, g) in enumerate(open_gpus[:trainer_world]))
    return Plan(nodes, gpus_per_node, layout, tp, tuple(engine_slots), trainer_slots)


def plan_from_config(cfg) -> Plan | None:
    """The plan for a run's Config; None on a machine without GPUs (cluster.gpus_per_node=0)."""
    c = cfg.cluster
    if not c.gpus_per_node and cfg.rollout.device == "cuda":
        # unplanned, the engines would take the GPUs Ray sees and the trainer would wait for one forever
        raise PlacementError("rollout.device=cuda needs cluster.gpus_per_node >= 1 (the GPUs of each node), so "
                             "that the engines and the trainer ranks are each given theirs; got "
                             "cluster.gpus_per_node=0")
    if not c.gpus_per_node:
        return None
    return plan_placement(c.nodes, c.gpus_per_node, cfg.rollout.num_workers, cfg.rollout.tensor_parallel_size,
                          cfg.trainer.world_size, c.layout)


# --- Ray placement groups ----------------------------------------------------------------------
@dataclass(frozen=True)
class GroupSpec:
    name: str
    bundles: tuple[dict, ...]
    strategy: str


def group_specs(plan: Plan, cpus_per_gpu: float = 1.0) -> tuple[list[GroupSpec], dict]:
    """The placement groups a plan needs, and where each slot lives: (role, index) -> (group, bundles).

    colocated: one STRICT_PACK group per node, one bundle per GPU, shared by that node's engines and ranks;
    separate:  one group per engine holding one bundle of its TP GPUs (a Ray actor lives in one bundle, and
               the engine's TP workers are its child processes), one PACK group for the trainer.
    """
    bundle = {"GPU": 1, "CPU": cpus_per_gpu}
    where = {}
    if plan.layout == "colocated":
        used: dict[int, int] = {}  # node -> GPUs in use there (always the first ones)
        for s in plan.engines + plan.trainer:
            used[s.node] = max(used.get(s.node, 0), max(s.gpus) + 1)
        specs = [GroupSpec(f"rlsys-node{n}", (bundle,) * k, "STRICT_PACK") for n, k in sorted(used.items())]
        for s in plan.engines + plan.trainer:
            where[s.role, s.index] = (f"rlsys-node{s.node}", s.gpus)
        return specs, where
    specs = [GroupSpec(f"rlsys-rollout{s.index}", ({"GPU": len(s.gpus), "CPU": cpus_per_gpu * len(s.gpus)},),
                       "STRICT_PACK") for s in plan.engines]
    specs.append(GroupSpec("rlsys-trainer", (bundle,) * len(plan.trainer), "PACK"))
    for s in plan.engines:
        where[s.role, s.index] = (f"rlsys-rollout{s.index}", (0,))
    for s in plan.trainer:
        where[s.role, s.index] = ("rlsys-trainer", (s.index,))
    return specs, where


COLOCATED_SHARE = 0.5  # of a GPU, for the engine and for the trainer rank that take turns on it


class Placement:
    """Live placement groups for a plan; `actor_options(role, index)` puts an actor in its bundle.

    colocated: an engine and a trainer rank each take half of their shared GPU's bundle, so Ray gives both
    the same device; separate: an engine takes its whole TP bundle, a trainer rank one GPU."""

    def __init__(self, plan: Plan, cpus_per_gpu: float = 1.0, timeout_s: float = 120.0, may_grow: bool = True):
        """`may_grow`: GPUs may still join the Ray cluster (one rlsys joined, perhaps autoscaled), so wait up to
        `timeout_s` for them; a Ray rlsys started on this machine has all it will have."""
        import ray
        from ray.util.placement_group import placement_group

        if plan.layout == "colocated" and plan.tp > 1:
            raise PlacementError(f"cluster.layout=colocated with rollout.tensor_parallel_size={plan.tp}: an engine's "
                                 "TP workers cannot share GPUs with trainer ranks yet; use cluster.layout=separate")
        have = ray.cluster_resources().get("GPU", 0)
        if not may_grow and have < plan.used_gpus:
            raise PlacementError(f"the plan uses {plan.used_gpus} GPUs (cluster.nodes={plan.nodes} x "
                                 f"cluster.gpus_per_node={plan.gpus_per_node}) and the Ray started on this machine has "
                                 f"{have:g}: run it where the GPUs are, or on the CPU with cluster.gpus_per_node=0; "
                                 "`rlsys check CONFIG` prints the plan without starting Ray")
        self.plan = plan
        specs, self.where = group_specs(plan, cpus_per_gpu)
        self.groups = {s.name: placement_group(list(s.bundles), strategy=s.strategy, name=s.name) for s in specs}
        for spec in specs:
            ready, _ = ray.wait([self.groups[spec.name].ready()], timeout=timeout_s)
            if not ready:
                have = ray.cluster_resources().get("GPU", 0)
                raise PlacementError(f"placement group {spec.name} ({len(spec.bundles)} GPUs, {spec.strategy}) not "
                                     f"ready after {timeout_s:.0f} s; the Ray cluster has {have:g} GPUs: check "
                                     "cluster.nodes and cluster.gpus_per_node against `ray status`")

    def actor_options(self, role: str, index: int) -> dict:
        """Ray `.options()` for the engine or trainer rank `index`: its bundle and its share of the GPUs."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        name, bundles = self.where[role, index]  # one bundle: colocated TP engines are refused above
        where = PlacementGroupSchedulingStrategy(self.groups[name], placement_group_bundle_index=bundles[0],
                                                 placement_group_capture_child_tasks=True)
        whole = self.plan.tp if role == ROLLOUT else 1
        gpus = COLOCATED_SHARE if self.plan.layout == "colocated" else whole
        return {"scheduling_strategy": where, "num_gpus": gpus, "num_cpus": 0}

    def node_addresses(self) -> dict[int, str]:
        """Logical node -> the address of the Ray node that holds its slots' bundles, as Ray reports them."""
        import ray
        from ray.util.placement_group import placement_group_table

        addresses = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}
        hosts = {name: placement_group_table(g)["bundles_to_node_id"] for name, g in self.groups.items()}
        found: dict[int, set[str]] = {}
        for s in self.plan.engines + self.plan.trainer:
            name, bundles = self.where[s.role, s.index]
            found.setdefault(s.node, set()).add(addresses.get(hosts[name][bundles[0]], "?"))
        return {node: ",".join(sorted(a)) for node, a in found.items()}

    def remove(self) -> None:
        from ray.util.placement_group import remove_placement_group

        for group in self.groups.values():
            remove_placement_group(group)


# --- printout ------------------------------------------------------------------------------------
def _runs(items: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2,5'."""
    out, start = [], None
    for i, x in enumerate(items):
        if start is None:
            start = x
        if i + 1 == len(items) or items[i + 1] != x + 1:
            out.append(f"{start}" if start == x else f"{start}-{x}")
            start = None
    return ",".join(out)


def format_plan(plan: Plan, addresses: dict[int, str] | None = None) -> str:
    """The plan, a line per node; `addresses` (Placement.node_addresses) names the machine each one landed on."""
    total = plan.nodes * plan.gpus_per_node
    lines = [f"placement: {plan.nodes} node(s) x {plan.gpus_per_node} GPUs = {total}, {plan.layout}; "
             f"rollout {len(plan.engines)} engine(s) x TP {plan.tp}, trainer {len(plan.trainer)} rank(s); "
             f"{plan.used_gpus} GPUs used"]
    width = len(str(plan.nodes - 1))
    for node in range(plan.nodes):
        parts = []
        for label, slots in (("engines", plan.engines), ("trainer ranks", plan.trainer)):
            mine = [s for s in slots if s.node == node]
            if mine:
                gpus = sorted(g for s in mine for g in s.gpus)
                parts.append(f"{label} {_runs([s.index for s in mine])} on GPUs {_runs(gpus)}")
        where = f" ({addresses[node]})" if addresses and node in addresses else ""
        lines.append(f"  node {node:>{width}}{where}: " + ("; ".join(parts) or "idle"))
    return "\n".join(lines)


def idle_warning(plan: Plan) -> str:
    """What the plan leaves without an engine or a trainer rank, and the fields that would use it; "" when every
    GPU has work. A config written for one node and run with more (cluster.nodes=2) plans the new nodes idle."""
    used = {(s.node, g) for s in plan.engines + plan.trainer for g in s.gpus}
    idle = {n: [g for g in range(plan.gpus_per_node) if (n, g) not in used] for n in range(plan.nodes)}
    idle = {n: gpus for n, gpus in idle.items() if gpus}
    if not idle:
        return ""
    total, engines, ranks = plan.nodes * plan.gpus_per_node, len(plan.engines), len(plan.trainer)
    where = "; ".join(f"node {n}: " + (f"all {len(gpus)}" if len(gpus) == plan.gpus_per_node else f"GPUs {_runs(gpus)}")
                      for n, gpus in idle.items())
    if plan.layout == "colocated":  # every GPU holds an engine and a rank
        wanted = [f"rollout.num_workers={total // plan.tp}" if engines * plan.tp < total else "",
                  f"trainer.world_size={total}" if ranks < total else ""]
        advice = f"to use all {total}, set " + " and ".join(w for w in wanted if w)
    else:
        advice = (f"to use them, raise rollout.num_workers (now {engines}, {plan.tp} GPU(s) each) or trainer.world_size "
                  f"(now {ranks}) by {total - plan.used_gpus} GPUs in all")
    return (f"warning: {total - plan.used_gpus} of {total} GPUs would sit idle ({where}): trainer.world_size and "
            f"rollout.num_workers must grow with cluster.nodes and cluster.gpus_per_node; {advice}")
