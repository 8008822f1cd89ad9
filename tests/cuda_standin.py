"""A stand-in for the CUDA driver, so that rlsys's CUDA-only lines run on a CPU build of torch.

Only the narrowest entry points into torch's C extension are replaced (`torch._C._cuda_*`, the CUDA
storage's `_new_shared_cuda`, the driver's lazy init); everything above them is torch's and rlsys's own code.
Each stand-in checks its arguments' types as the C function's parser does (an int device, bytes handles, a
bool flag), so a call the real driver would refuse is refused here too, with torch's own words.
"""
from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch


def _refuse(name: str, signature: str, args: tuple) -> None:
    raise TypeError(f"{name} received an invalid combination of arguments - got "
                    f"({', '.join(type(a).__name__ for a in args)}), but expected {signature}")


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)  # THPUtils_checkLong refuses None


@dataclass
class Properties:
    uuid: str
    name: str = "stand-in GPU"


class FakeDriver:
    """Installs the stand-ins for one test (`install`); records what was called in `calls`."""

    def __init__(self, count: int = 1):
        self.count, self.current = count, 0
        self.calls: list[tuple] = []
        self.shared: dict[bytes, torch.UntypedStorage] = {}  # IPC handle -> the storage it opens

    def _device(self, name: str, device) -> int:
        if not _is_int(device):
            _refuse(name, "(int device)", (device,))
        if not 0 <= device < self.count:
            raise RuntimeError(f"CUDA error: invalid device ordinal {device}")
        return device

    # --- torch._C entry points ---
    def get_device_count(self) -> int:
        return self.count

    def get_device(self) -> int:
        return self.current

    def set_device(self, device) -> None:
        self.current = self._device("_cuda_setDevice", device)
        self.calls.append(("set_device", device))

    def exchange_device(self, device) -> int:
        if not _is_int(device):
            _refuse("_cuda_exchangeDevice", "(int device)", (device,))
        if device < 0:
            return -1
        before, self.current = self.current, self._device("_cuda_exchangeDevice", device)
        return before

    def synchronize(self, *args) -> None:
        if args:
            _refuse("_cuda_synchronize", "()", args)
        self.calls.append(("synchronize", self.current))

    def empty_cache(self, *args) -> None:
        if args:
            _refuse("_cuda_emptyCache", "()", args)
        self.calls.append(("empty_cache", self.current))

    def properties(self, device) -> Properties:
        return Properties(f"GPU-{self._device('_get_device_properties', device)}")

    def new_shared_cuda(self, *args) -> torch.UntypedStorage:
        """torch/csrc/StorageSharing.cpp THPStorage_newSharedCuda: eight arguments, each of its type."""
        signature = ("(int device, bytes handle, int storage_size_bytes, int storage_offset_bytes, "
                     "bytes _ref_counter, int _ref_counter_offset, bytes event_handle, bool event_sync_required)")
        if len(args) != 8:
            raise RuntimeError("tuple of 8 items expected")
        device, handle, size, offset, counter, counter_offset, event, sync = args
        if not (_is_int(device) and isinstance(handle, bytes) and _is_int(size) and _is_int(offset)
                and isinstance(counter, bytes) and _is_int(counter_offset) and isinstance(event, bytes)
                and isinstance(sync, bool)):
            _refuse("_new_shared in CUDA mode", signature, args)
        self._device("_new_shared_cuda", device)
        self.calls.append(("open_shared", device, handle))
        return self.shared[handle]

    def install(self, monkeypatch: pytest.MonkeyPatch) -> "FakeDriver":
        c = torch._C
        for name, fn in [("_cuda_getDeviceCount", self.get_device_count), ("_cuda_getDevice", self.get_device),
                         ("_cuda_setDevice", self.set_device), ("_cuda_exchangeDevice", self.exchange_device),
                         ("_cuda_synchronize", self.synchronize), ("_cuda_emptyCache", self.empty_cache)]:
            monkeypatch.setattr(c, name, fn, raising=False)
        # the CPU build binds these to functions that refuse; a CUDA build binds them to the _C calls above
        monkeypatch.setattr(torch.cuda, "_exchange_device", self.exchange_device)
        monkeypatch.setattr(torch.cuda, "_maybe_exchange_device", self.exchange_device)
        monkeypatch.setattr(torch.cuda, "_get_device_properties", self.properties, raising=False)
        monkeypatch.setattr(torch.cuda, "_initialized", True)  # as after the driver's init: torch skips it
        monkeypatch.setattr(torch.cuda, "_cached_device_count", None, raising=False)  # counted afresh, here
        monkeypatch.setattr(torch.UntypedStorage, "_new_shared_cuda", self.new_shared_cuda)
        # one generator per GPU, which the driver's init creates (torch.manual_seed seeds them too)
        monkeypatch.setattr(torch.cuda, "default_generators", tuple(torch.Generator() for _ in range(self.count)))
        return self

    def ipc_handle(self, storage: torch.UntypedStorage, dtype: torch.dtype, shape: tuple, device: int = 0):
        """What torch's reduce_tensor makes of a CUDA tensor on `device` (the shape of its rebuild args), for a
        CPU storage this driver will open."""
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        handle = f"ipc-{len(self.shared)}".encode()
        self.shared[handle] = storage
        stride = torch.empty(shape).stride()
        return rebuild_cuda_tensor, (torch.Tensor, shape, stride, 0, torch.UntypedStorage, dtype, device, handle,
                                     storage.nbytes(), 0, False, b"counter", 0, b"event", True)


@pytest.fixture
def cuda_driver(monkeypatch) -> FakeDriver:
    return FakeDriver().install(monkeypatch)


# --- CUDA graphs -----------------------------------------------------------------------------------------
# Ops that read a device value back to the host: a capture refuses them ("operation not permitted when stream
# is capturing"), as no kernel runs while a graph is recorded.
SYNCING = {"aten._local_scalar_dense.default", "aten.nonzero.default", "aten.equal.default",
           "aten.is_nonzero.default", "aten.masked_select.default"}


class _Recording(torch.utils._python_dispatch.TorchDispatchMode):
    """Every op of a capture with the tensors it read and made, as a CUDA graph keeps its kernels with their
    arguments: fixed memory and any Python number baked in."""

    def __init__(self):
        super().__init__()
        self.ops: list[tuple] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if str(func) in SYNCING:
            raise RuntimeError(f"CUDA error: operation not permitted when stream is capturing ({func})")
        out = func(*args, **(kwargs or {}))
        self.ops.append((func, args, kwargs or {}, out))
        return out


class StandInGraph:
    """torch.cuda.CUDAGraph: `replay` runs the captured ops again on the very tensors of the capture (the
    inputs it read, its intermediates, its outputs), Python arguments as they were then. A graph replayed
    after the memory it read was reallocated reads the old memory, as a real one would (a real one's is freed)."""

    def __init__(self, *args, **kwargs):
        if args or kwargs:
            _refuse("CUDAGraph", "(bool keep_graph=False)", args)
        self.recording: _Recording | None = None
        self.replays = 0

    def replay(self, *args) -> None:
        if args:
            _refuse("replay", "()", args)
        assert self.recording is not None, "replay of a graph never captured"
        from torch.utils._pytree import tree_leaves

        for func, op_args, op_kwargs, out in self.recording.ops:
            again = func(*op_args, **op_kwargs)
            for kept, new in zip(tree_leaves(out), tree_leaves(again)):
                if isinstance(kept, torch.Tensor) and kept.data_ptr() != new.data_ptr():
                    kept.copy_(new)  # the kernel writes where it wrote at capture
        self.replays += 1


class FakeGraphs:
    """Installs torch.cuda.CUDAGraph, torch.cuda.graph and torch.cuda.graph_pool_handle stand-ins; records
    the captures (`captured`: the pool each used) for a test to read."""

    def __init__(self):
        self.captured: list[tuple] = []
        self.pools = 0

    def graph_pool_handle(self, *args) -> tuple[int, int]:
        if args:
            _refuse("graph_pool_handle", "()", args)
        self.pools += 1
        return (0, self.pools)  # a MempoolId_t, as torch's _graph_pool_handle returns

    def graph(self, cuda_graph, pool=None, stream=None, capture_error_mode: str = "global"):
        """torch.cuda.graph's context manager: the body runs once, recorded (a real capture only records)."""
        import contextlib

        if not isinstance(cuda_graph, StandInGraph):
            _refuse("graph", "(CUDAGraph cuda_graph, tuple pool, Stream stream, str capture_error_mode)",
                    (cuda_graph,))
        if pool is not None and not (isinstance(pool, tuple) and len(pool) == 2 and all(map(_is_int, pool))):
            _refuse("capture_begin", "(tuple[int, int] pool)", (pool,))
        if capture_error_mode not in ("global", "thread_local", "relaxed"):
            raise RuntimeError(f"Unknown capture error mode. Expected `global`, `thread_local`, or `relaxed`, "
                               f"but got {capture_error_mode}")

        @contextlib.contextmanager
        def capture():
            recording = _Recording()
            with recording:
                yield
            cuda_graph.recording = recording
            self.captured.append(pool)
        return capture()

    def install(self, monkeypatch: pytest.MonkeyPatch) -> "FakeGraphs":
        monkeypatch.setattr(torch.cuda, "CUDAGraph", StandInGraph)
        monkeypatch.setattr(torch.cuda, "graph", self.graph)
        monkeypatch.setattr(torch.cuda, "graph_pool_handle", self.graph_pool_handle)
        return self


@pytest.fixture
def cuda_graphs(monkeypatch) -> FakeGraphs:
    """The CUDA graph stand-ins on a CPU build, with a driver that reports one GPU (decode=graph asks for it)."""
    FakeDriver().install(monkeypatch)
    return FakeGraphs().install(monkeypatch)
