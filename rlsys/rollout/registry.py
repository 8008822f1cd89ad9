"""The engine registry: `rollout.engine` names an entry here, built-in (cpu, vllm) or added with
`register_engine`. Apart from the engine interface (engine.py), so that the engines import that interface and
this module imports them, with no circle.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from rlsys.registry import Registry, UnknownName
from rlsys.rollout.engine import RolloutEngine


def device_options(rollout) -> dict:
    """An engine on `rollout.device` (the built-in one, and by default one a user registers) takes that device."""
    return {"device": rollout.device}


def device_gpus(options: dict) -> int:
    return 1 if options.get("device") == "cuda" else 0


@dataclass(frozen=True)
class EngineEntry:
    """A registered engine: its factory, the options it takes from `cfg.rollout` beside the common ones
    (rlsys/rollout/manager.py engine_options), and the GPUs a worker of it asks Ray for, given those options,
    where no placement plan gives it a bundle. `seeded_eval`: eval requests carry per-sample seeds (reproducible
    eval); off where a seeded request costs the engine a slower sampler (vLLM: a generator per row per step)."""
    build: Callable[..., RolloutEngine]
    options: Callable[[Any], dict] = device_options
    gpus: Callable[[dict], int] = device_gpus
    seeded_eval: bool = True


ENGINES: Registry[EngineEntry] = Registry("rollout engine")


def register_engine(name: str, options: Callable[[Any], dict] = device_options,
                    gpus: Callable[[dict], int] = device_gpus, seeded_eval: bool = True):
    """`@register_engine("mine")` on an engine class (or factory) makes `rollout.engine=mine` build it."""
    def add(build):
        ENGINES.register(name)(EngineEntry(build, options, gpus, seeded_eval))
        return build
    return add


@register_engine("cpu")
def _cpu_engine(model_dir: str, slots: int, **kwargs) -> RolloutEngine:
    from rlsys.rollout.builtin_engine import CPUEngine
    return CPUEngine(model_dir, slots, **kwargs)


def _vllm_options(rollout) -> dict:
    return {"tensor_parallel_size": rollout.tensor_parallel_size,
            "gpu_memory_utilization": rollout.gpu_memory_utilization, "enable_sleep_mode": rollout.enable_sleep_mode}


def _vllm_gpus(options: dict) -> int:
    return options.get("tensor_parallel_size", 1)


@register_engine("vllm", options=_vllm_options, gpus=_vllm_gpus, seeded_eval=False)
def _vllm_engine(model_dir: str, slots: int, **kwargs) -> RolloutEngine:
    from rlsys.rollout.vllm_engine import VLLMEngine  # imported only when chosen: vLLM needs a GPU
    return VLLMEngine(model_dir, slots, **kwargs)


def engine_entry(kind: str) -> EngineEntry:
    try:
        return ENGINES.get(kind)
    except UnknownName as e:  # also raised where no config is at hand (make_engine): name the field
        raise UnknownName(f"rollout.engine: {e}") from None


def make_engine(kind: str | Callable[..., RolloutEngine], model_dir: str, slots: int, **kwargs) -> RolloutEngine:
    """The engine named by `rollout.engine`, or built by `kind` itself: the rollout manager resolves the name on the
    driver and sends the factory, so an engine registered there (by a plugin or a test) reaches Ray workers."""
    factory = engine_entry(kind).build if isinstance(kind, str) else kind
    return factory(model_dir, slots, **kwargs)
