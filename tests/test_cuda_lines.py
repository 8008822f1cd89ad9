"""Every line of rlsys that runs only on CUDA is listed in docs/design.md ("Lines that run only on CUDA") with
the test that executes it on the CPU, torch's C entry points replaced by the stand-in of cuda_standin.py.
A new CUDA line without a row there fails here; so does a row whose line or test is gone."""
import re
import socket
from pathlib import Path

import pytest
import torch

from cuda_standin import FakeDriver, cuda_driver  # noqa: F401 (a fixture)
from test_cpu_engine import build

# imported before a test installs the stand-in: torch imports some modules differently where CUDA is built
from rlsys.rollout.builtin_engine import CPUEngine
from rlsys.models.warm_start import release, training_device
from rlsys.rollout.profile import StepProfiler
from rlsys.rollout.vllm_extension import WeightUpdateExtension
from rlsys.trainer.backend import local_device, rng_state, set_rng_state
from rlsys.trainer.worker import TrainerWorker

ROOT = Path(__file__).resolve().parent.parent
PATTERN = re.compile(r'torch\.cuda\b|\.cuda\(|"cuda"|\'cuda\'|"nccl"|ProcessGroupNCCL')
SECTION = "### Lines that run only on CUDA"


def code(line: str) -> str:
    return line.split("  #")[0].strip()


def cuda_lines() -> set[tuple[str, str]]:
    """(file, code) of every line under rlsys/ that names CUDA or NCCL, comments and docstrings aside."""
    found = set()
    for path in sorted((ROOT / "rlsys").rglob("*.py")):
        for line in path.read_text().splitlines():
            text = code(line)
            if PATTERN.search(text) and not text.startswith(("#", '"""')):
                found.add((str(path.relative_to(ROOT)), text))
    return found


def listed() -> dict[tuple[str, str], str]:
    """The table's rows: (file, code) -> test."""
    text = (ROOT / "docs" / "design.md").read_text()
    assert SECTION in text, f"docs/design.md has no section {SECTION!r}"
    rows = {}
    for line in text.split(SECTION, 1)[1].split("\n#", 1)[0].splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[0].startswith("rlsys/"):
            rows[(cells[0], cells[1].strip("`"))] = cells[2]
    return rows


def test_every_cuda_only_line_is_listed_with_a_test_that_exists():
    rows, lines = listed(), cuda_lines()
    missing = sorted(lines - set(rows))
    assert not missing, f"CUDA-only lines without a row in docs/design.md ({SECTION}): {missing}"
    stale = sorted(set(rows) - lines)
    assert not stale, f"rows of docs/design.md ({SECTION}) whose line is gone: {stale}"
    for key, test in rows.items():
        file, _, name = test.partition("::")
        name = name.split("[")[0]
        assert (ROOT / file).is_file() and re.search(rf"^def {name}\(", (ROOT / file).read_text(), re.M), (
            f"{key}: its test {test} does not exist")


# --- the lines no other test reaches on the CPU ----------------------------------------------------------
def test_a_trainer_rank_hands_its_cached_blocks_back_on_a_gpu(cuda_driver):
    TrainerWorker.__ray_metadata__.modified_class.release_cached_memory(None)
    assert cuda_driver.calls == [("empty_cache", 0)]


@pytest.mark.parametrize("nvml_check", ["0", "1"])  # importing DeepSpeed sets 1: torch then counts once a process
def test_a_trainer_takes_the_gpu_ray_gave_it(cuda_driver, monkeypatch, nvml_check):
    monkeypatch.setenv("PYTORCH_NVML_BASED_CUDA_CHECK", nvml_check)
    assert local_device() == "cuda"
    monkeypatch.setattr(cuda_driver, "count", 0)  # cudaGetDeviceCount: none, in a process of its own
    monkeypatch.setattr(torch.cuda, "_cached_device_count", None)
    assert local_device() == "cpu"


def test_checkpoints_save_and_restore_every_gpus_generator(monkeypatch):
    """torch keeps one generator per GPU in torch.cuda.default_generators (filled by the driver's init);
    CPU generators of the same class stand in for them."""
    FakeDriver(count=2).install(monkeypatch)
    generators = (torch.Generator().manual_seed(1), torch.Generator().manual_seed(2))
    monkeypatch.setattr(torch.cuda, "default_generators", generators)
    state = rng_state()
    drawn = [torch.rand(3, generator=g) for g in generators]
    set_rng_state(state)
    assert all(torch.equal(torch.rand(3, generator=g), d) for g, d in zip(generators, drawn))


def test_a_sleeping_engine_on_cuda_gives_its_blocks_back(tmp_path, cuda_driver):
    """The engine is built on the CPU (no CUDA tensors here) and then names the GPU, as one built there does."""
    _, path = build(tmp_path)
    engine = CPUEngine(path, slots=2)
    engine.device = torch.device("cuda")
    engine.sleep(2)
    assert engine.model.k_cache is None and cuda_driver.calls == [("empty_cache", 0)]
    engine.wake_up()
    assert engine.model.k_cache is not None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_vllm_worker_selects_its_gpu_and_synchronises_after_loading(cuda_driver):
    """vLLM mixes the extension into its GPU workers, which have `rank` and `device`; here a plain object."""
    class Worker(WeightUpdateExtension):
        rank, device = 0, torch.device("cuda", 0)

    worker = Worker()
    assert worker.rlsys_init_weight_group("127.0.0.1", free_port(), 1, 0, backend="gloo", timeout_s=30) == 0
    assert worker._rlsys_load_all([]) == 0
    assert cuda_driver.calls == [("set_device", 0), ("synchronize", 0)]


def test_a_vllm_engine_joins_the_weight_group_over_nccl_by_default():
    import inspect

    from rlsys.rollout.vllm_engine import VLLMEngine
    from rlsys.weights.group import WeightGroup

    for fn in (VLLMEngine.init_weight_group, WeightGroup.__init__):
        assert inspect.signature(fn).parameters["backend"].default == "nccl"
    with pytest.raises(ValueError, match="weight group backend must be nccl or gloo"):
        WeightGroup("127.0.0.1", free_port(), 0, 1, backend="mpi")


def test_a_weight_group_over_nccl_passes_its_deadline_to_nccls_watchdog(monkeypatch):
    """torch's CPU build has no ProcessGroupNCCL: a stand-in with its constructor's signature (store, rank,
    size, options) and its Options (a _timeout) checks what the group is built with."""
    import datetime

    import torch.distributed as dist

    from rlsys.weights.group import WeightGroup

    built = []

    class ProcessGroupNCCL:
        class Options:
            _timeout = datetime.timedelta(minutes=10)

        def __init__(self, store, rank, size, options):
            if not (isinstance(store, dist.Store) and isinstance(rank, int) and isinstance(size, int)
                    and isinstance(options, self.Options) and isinstance(options._timeout, datetime.timedelta)):
                raise TypeError("__init__(): incompatible constructor arguments")
            built.append((rank, size, options._timeout))
    monkeypatch.setattr(dist, "ProcessGroupNCCL", ProcessGroupNCCL, raising=False)
    group = WeightGroup("127.0.0.1", free_port(), 0, 1, timeout_s=42)
    assert isinstance(group.pg, ProcessGroupNCCL) and built == [(0, 1, datetime.timedelta(seconds=42))]


def test_broadcast_between_gpus_runs_over_nccl_from_a_gpu_buffer():
    from rlsys.weights.transfer import BroadcastTransport

    on_gpus, on_cpus = BroadcastTransport(60, on_gpus=True), BroadcastTransport(60)
    assert (on_gpus.group_backend, on_cpus.group_backend) == ("nccl", "gloo")
    assert on_gpus.sender("trainer rank 0", group=object()).device == "cuda"
    assert on_cpus.sender("trainer rank 0", group=object()).device == "cpu"


def test_a_profiled_engine_on_cuda_profiles_its_kernels_and_waits_for_them(tmp_path, cuda_driver):
    """RLSYS_PROFILE_ENGINE beside an engine on the GPU: each window ends by waiting for the GPU's queue."""
    profiler = StepProfiler(tmp_path, 0, torch.device("cuda"), skip=1, steps=2, windows=1)
    assert profiler.on_gpu
    x = torch.ones(64, 64)
    for _ in range(4):
        with profiler.step():
            x = x @ x / 64
    assert cuda_driver.calls and set(cuda_driver.calls) == {("synchronize", 0)}  # torch's profiler waits too
    report = (tmp_path / "engine-0-1.txt").read_text()
    assert report.startswith("steps 2 after 1: wall ") and "aten::mm" in report


def test_a_warm_start_on_the_gpu_takes_it_and_gives_its_blocks_back(cuda_driver):
    """model.warm_start.device=cuda where a GPU is seen: the device is the GPU, and its cached blocks go back."""
    assert training_device("cuda") == torch.device("cuda")
    release(torch.device("cuda"))
    release(torch.device("cpu"))
    assert cuda_driver.calls == [("empty_cache", 0)]
