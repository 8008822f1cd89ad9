"""Weight buckets and transports: exact round trips, the object store through a real Ray actor, the
broadcast path over gloo between two processes (the NCCL code with another backend), deadlines, and a
publishing trainer's memory: never more than two bucket buffers, never a copy of the whole model."""
import multiprocessing as mp
import socket
import threading
import time

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from rlsys.config import TrainerConfig
from rlsys.trainer.backend import TorchBackend
from rlsys.trainer.logprobs import Scoring
from rlsys.weights import (WeightGroup, WeightTransferTimeout, WeightUpdate, fill_buckets, iter_buckets, pack,
                           plan_buckets, unpack)
from rlsys.weights.buckets import ALIGN
from rlsys.weights.transfer import (BroadcastReceiver, BroadcastSender, BroadcastTransport, ObjectStoreReceiver,
                                    ObjectStoreSender, wait_for_engines)
from cuda_standin import FakeDriver
from test_cpu_engine import SIZES, build


def state_dict() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "model.embed_tokens.weight": torch.randn(33, 7, generator=g),  # odd sizes
        "model.layers.0.input_layernorm.weight": torch.randn(7, generator=g).to(torch.bfloat16),
        "model.layers.0.self_attn.q_proj.bias": torch.randn(5, generator=g).to(torch.float16),
        "model.layers.0.mlp.big.weight": torch.randn(64, 64, generator=g),  # 16 KiB: above the budget
        "model.rotary.inv_freq": torch.arange(3, dtype=torch.int64),
        "model.scale": torch.tensor(1.5),  # 0-dim
        "model.mask": torch.tensor([True, False, True]),
        "lm_head.weight": torch.randn(33, 7, generator=g),
    }


def fingerprint(name: str, t: torch.Tensor) -> tuple:
    return name, str(t.dtype), tuple(t.shape), t.reshape(-1).view(torch.uint8).numpy().tobytes()


def round_trip(weights, budget, dtype=None) -> list[tuple[str, torch.Tensor]]:
    return [pair for plan, flat in iter_buckets(weights, budget, dtype) for pair in unpack(plan, flat.clone())]


def test_buckets_round_trip_exactly_in_order():
    weights = state_dict()
    out = round_trip(weights, budget=2048)
    assert [n for n, _ in out] == list(weights)
    for name, t in out:
        assert fingerprint(name, t) == fingerprint(name, weights[name]), name


def test_bucket_budget_alignment_and_large_tensors():
    weights = state_dict()
    plans = plan_buckets(weights, budget_bytes=2048)
    big = [p for p in plans if any(m.name == "model.layers.0.mlp.big.weight" for m in p.tensors)]
    assert len(big) == 1 and len(big[0].tensors) == 1  # larger than the budget: a bucket of its own
    for p in plans:
        assert len(p.tensors) == 1 or p.nbytes <= 2048
        assert all(m.offset % ALIGN == 0 for m in p.tensors)
    assert len(plan_buckets(weights, budget_bytes=1 << 30)) == 1


def test_wire_dtype_casts_floating_tensors_only():
    weights = state_dict()
    out = dict(round_trip(weights, budget=4096, dtype=torch.bfloat16))
    assert out["model.embed_tokens.weight"].dtype == torch.bfloat16
    assert torch.equal(out["model.embed_tokens.weight"], weights["model.embed_tokens.weight"].bfloat16())
    assert out["model.rotary.inv_freq"].dtype == torch.int64 and out["model.mask"].dtype == torch.bool


def test_pack_refuses_a_tensor_that_does_not_match_the_plan():
    weights = state_dict()
    plan = plan_buckets(weights, 1 << 20)[0]
    weights["model.scale"] = torch.ones(2)
    with pytest.raises(ValueError, match="model.scale: shape"):
        pack(plan, weights)


def test_fill_buckets_streams_into_reused_buffers_in_plan_order():
    weights = state_dict()
    plans = plan_buckets(weights, 2048)
    buffers = [torch.empty(max(p.nbytes for p in plans), dtype=torch.uint8) for _ in range(2)]
    reused = []
    got = [(name, t.clone()) for i, plan, flat in fill_buckets(plans, weights.items(), buffers, reused.append)
           for name, t in unpack(plan, flat)]
    assert reused == list(range(len(plans)))  # asked before every bucket, so a transport can wait there
    assert [fingerprint(n, t) for n, t in got] == [fingerprint(n, t) for n, t in weights.items()]
    with pytest.raises(ValueError, match="expected model.embed_tokens.weight next, the weights gave lm_head"):
        next(fill_buckets(plans, reversed(list(weights.items())), buffers, lambda i: None))


def test_object_store_round_trip_through_a_ray_actor(ray_cluster):
    ray = ray_cluster

    @ray.remote(num_cpus=0)
    class Engine:
        def checksums(self, update):
            got = [pair for pairs in update.buckets("engine 0") for pair in pairs]
            return [(name, t.dtype, tuple(t.shape), t.reshape(-1).view(torch.uint8).long().sum().item())
                    for name, t in got]

    weights = state_dict()
    plans = plan_buckets(weights, 2048)
    receiver = ObjectStoreSender("trainer", 60).send(plans, weights.items(), version=3)
    assert isinstance(receiver, ObjectStoreReceiver) and len(receiver.refs) == len(plans)
    engine = Engine.remote()
    try:
        got = ray.get(engine.checksums.remote(WeightUpdate(3, plans, receiver)), timeout=60)
    finally:
        ray.kill(engine)
    expected = [(n, t.dtype, tuple(t.shape), t.reshape(-1).view(torch.uint8).long().sum().item())
                for n, t in weights.items()]
    assert got == expected


def test_an_engine_that_does_not_finish_is_named(ray_cluster):
    ray = ray_cluster
    nap = ray.remote(num_cpus=0)(lambda s: time.sleep(s))
    quick, stuck = nap.remote(0), nap.remote(30)
    with pytest.raises(WeightTransferTimeout, match="engine 1 did not finish within 0.5 s"):
        wait_for_engines({"engine 0": quick, "engine 1": stuck}, timeout_s=0.5)
    ray.cancel(stuck, force=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def receive_in_child(port: int, plans, out: mp.Queue) -> None:
    """Rank 1 of a gloo weight group: receives every bucket and sends back what it got."""
    torch.set_num_threads(1)
    group = WeightGroup("127.0.0.1", port, rank=1, world_size=2, backend="gloo", timeout_s=60)
    update = WeightUpdate(1, plans, BroadcastReceiver(60))
    pairs = [p for ws in update.buckets("engine 0", "cpu", group) for p in ws]
    # Plain bytes back: tensors would be shared through this process's memory, and it exits right away.
    out.put([fingerprint(name, t) for name, t in pairs])


def broadcast_to_a_child(plans, send) -> list:
    """`send(group)` as trainer rank 0 of a gloo group whose rank 1, another process, receives `plans`."""
    port = free_port()
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    child = ctx.Process(target=receive_in_child, args=(port, plans, out), daemon=True)
    child.start()
    try:
        group = WeightGroup("127.0.0.1", port, rank=0, world_size=2, backend="gloo", timeout_s=60)
        send(group)
        return out.get(timeout=60)
    finally:
        child.join(timeout=30)
        if child.is_alive():
            child.kill()


def test_broadcast_over_gloo_between_two_processes():
    weights = state_dict()
    plans = plan_buckets(weights, 2048)
    got = broadcast_to_a_child(plans, lambda group: BroadcastSender("trainer", 60, group, "cpu").send(
        plans, weights.items(), version=1))
    assert got == [fingerprint(name, t) for name, t in weights.items()]


def test_a_bucket_that_never_comes_raises_naming_engine_and_bucket():
    port = free_port()
    trainer: dict = {}
    joined = threading.Thread(target=lambda: trainer.update(
        group=WeightGroup("127.0.0.1", port, rank=0, world_size=2, backend="gloo", timeout_s=2)))
    joined.start()  # the trainer joins the group, then never sends
    group = WeightGroup("127.0.0.1", port, rank=1, world_size=2, backend="gloo", timeout_s=1)
    joined.join(timeout=30)
    plans = plan_buckets(state_dict(), 2048)
    t0 = time.monotonic()
    with pytest.raises(WeightTransferTimeout, match=r"engine 3: bucket 0 \(model.embed_tokens.weight"):
        next(WeightUpdate(1, plans, BroadcastReceiver(1)).buckets("engine 3", "cpu", group))
    assert time.monotonic() - t0 < 10


def test_a_peer_that_never_joins_raises_instead_of_hanging():
    t0 = time.monotonic()
    with pytest.raises(WeightTransferTimeout, match="not every rank joined"):
        WeightGroup("127.0.0.1", free_port(), rank=0, world_size=2, backend="gloo", timeout_s=1)
    assert time.monotonic() - t0 < 10


# --- a publishing trainer's memory ------------------------------------------------------------------
BUDGET = 32 << 10  # the model below is about 1.2 MB: some 40 buckets


@pytest.fixture(scope="module")
def trainer(tmp_path_factory):
    """A real trainer backend over an 8-layer model, in this process (where the profiler sees it)."""
    _, path = build(tmp_path_factory.mktemp("publish"), sizes=dict(SIZES, num_hidden_layers=8))
    return TorchBackend(TrainerConfig(), path, Scoring())


def peak_new_bytes(fn) -> int:
    """The most CPU tensor memory that `fn` held at once beyond what was there before (torch's profiler
    records every allocation and free)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]")
    live = peak = 0
    for _, nbytes in events:
        live += nbytes
        peak = max(peak, live)
    return peak


def two_buckets_and_a_tensor(plans) -> int:
    return 2 * max(p.nbytes for p in plans) + max(m.nbytes for p in plans for m in p.tensors)


def test_publishing_by_object_store_never_holds_more_than_two_buckets_or_a_full_copy(trainer, ray_cluster):
    plans = plan_buckets(trainer.published_shapes(), BUDGET)
    model_bytes = sum(p.nbytes for p in plans)
    assert len(plans) > 20 and model_bytes > 8 * two_buckets_and_a_tensor(plans)  # a full copy would show
    sender, sent = ObjectStoreSender("trainer rank 0", 60), []
    for version in (1, 2):  # the second version reuses the first one's buffer
        peak = peak_new_bytes(lambda: sent.append(sender.send(plans, trainer.published_weights(), version)))
        assert peak <= two_buckets_and_a_tensor(plans), (version, peak, model_bytes)
    got = dict(pair for pairs in WeightUpdate(2, plans, sent[-1]).buckets("engine 0") for pair in pairs)
    assert all(torch.equal(got[name], t) for name, t in trainer.published_weights())


def test_publishing_by_broadcast_never_holds_more_than_two_buckets_or_a_full_copy(trainer):
    plans = plan_buckets(trainer.published_shapes(), BUDGET, torch.bfloat16)  # cast on the way, as for vLLM
    peaks = []

    def send(group):
        sender = BroadcastTransport(60).sender("trainer rank 0", group)
        peaks.append(peak_new_bytes(lambda: sender.send(plans, trainer.published_weights(), version=1)))
    got = broadcast_to_a_child(plans, send)
    assert peaks[0] <= two_buckets_and_a_tensor(plans), (peaks, sum(p.nbytes for p in plans))
    assert got == [fingerprint(name, t.bfloat16()) for name, t in trainer.published_weights()]


# --- cuda_ipc's double buffering, on the CPU -----------------------------------------------------------
# No GPU here: the two buffers are shared as files mapped by both processes instead of CUDA IPC handles, and
# the driver's calls (device, name, synchronisation) go to the stand-in of tests/cuda_standin.py. Everything
# else is cuda_ipc's own code: the TCP store the trainer hosts, the "ready"/"done" handshake per bucket, and
# the reuse of two buffers for every bucket.
def share_by_file(monkeypatch, folder) -> None:
    from rlsys.weights import transfer

    paths: dict[int, tuple[str, int]] = {}

    def file_buffers(plans, count, device, have):
        if have:
            return have
        size = max(p.nbytes for p in plans)
        out = [torch.from_file(f"{folder}/buffer{i}", shared=True, size=size, dtype=torch.uint8) for i in range(count)]
        paths.update({id(b): (f"{folder}/buffer{i}", size) for i, b in enumerate(out)})
        return out
    monkeypatch.setattr(transfer, "_buffers", file_buffers)
    monkeypatch.setattr("torch.multiprocessing.reductions.reduce_tensor", lambda b: paths[id(b)])
    monkeypatch.setattr(transfer, "open_shared", lambda handle, device: torch.from_file(
        handle[0], shared=True, size=handle[1], dtype=torch.uint8))
    monkeypatch.setattr(transfer.CudaIpcSender, "device", "cpu")  # the buffers: CPU tensors, as files
    FakeDriver().install(monkeypatch)


def receive_by_ipc_in_child(folder, update, out: mp.Queue) -> None:
    """The engine on the trainer's GPU: loads each bucket slowly, so a trainer that overwrote a buffer
    before "done" would be caught with the wrong bytes."""
    torch.set_num_threads(1)
    with pytest.MonkeyPatch.context() as monkeypatch:
        share_by_file(monkeypatch, folder)
        got = []
        for pairs in update.buckets("engine 0", torch.device("cuda", 0)):  # files opened on the CPU
            time.sleep(0.05)
            got += [fingerprint(name, t) for name, t in pairs]
    out.put(got)


def test_cuda_ipc_reuses_two_buffers_and_waits_for_the_engine_before_overwriting_one(tmp_path, monkeypatch):
    from rlsys.weights.transfer import CudaIpcTransport

    share_by_file(monkeypatch, tmp_path)
    weights = state_dict()
    plans = plan_buckets(weights, 512)
    assert len(plans) >= 4  # each buffer is reused
    # the sender waits for a child that first imports torch afresh: 30 s ran out on a loaded 2-core machine
    transport = CudaIpcTransport(120)
    sender = transport.sender("trainer rank 0", host="127.0.0.1")
    receiver = transport.receiver([sender.address()])
    ctx = mp.get_context("spawn")
    for version in (1, 2):  # the buffers and the store serve every version
        out = ctx.Queue()
        update = WeightUpdate(version, plans, receiver)
        child = ctx.Process(target=receive_by_ipc_in_child, args=(tmp_path, update, out))
        child.start()
        try:
            sender.send(plans, weights.items(), version)
            got = out.get(timeout=150)
        finally:
            child.join(timeout=30)
            if child.is_alive():
                child.kill()
        assert got == [fingerprint(name, t) for name, t in weights.items()]
        assert sorted(p.name for p in tmp_path.iterdir()) == ["buffer0", "buffer1"]


# --- cuda_ipc's receiving side on "cuda", the device the built-in engine names ----------------------------
@pytest.mark.parametrize("device,current", [("cuda", 1), ("cuda:1", 0)])
def test_cuda_ipc_receiver_opens_handles_on_its_own_numbering_of_the_gpu(monkeypatch, device, current):
    """The trainer's handles carry its numbering of the GPU (0 here); the engine sees the same GPU as its
    device 1, named "cuda" (no index: the current device) or "cuda:1". torch's _new_shared_cuda takes an
    int device (the stand-in checks its arguments as torch's C parser does), and it must be the engine's."""
    import pickle

    from rlsys.weights.transfer import CudaIpcReceiver, open_store

    cuda_driver = FakeDriver(count=2).install(monkeypatch)
    cuda_driver.current = current
    weights = state_dict()
    plans = plan_buckets(weights, 512)
    size = max(p.nbytes for p in plans)
    storages = [torch.UntypedStorage(size) for _ in range(2)]
    store = open_store("127.0.0.1", 0, True, 30)
    handles = [cuda_driver.ipc_handle(s, torch.uint8, (size,), device=0) for s in storages]  # the trainer's
    store.set("handles", pickle.dumps(handles))
    store.set("1/ready/0", "1")
    receiver = CudaIpcReceiver({"GPU-1": ("127.0.0.1", store.port)}, timeout_s=30)
    got = []
    for i, (plan, flat) in enumerate(receiver.packed(plans, 1, "engine 0", torch.device(device))):
        got += [fingerprint(name, t) for name, t in unpack(plan, flat)]  # zeros: no trainer wrote them
        assert flat.untyped_storage().data_ptr() == storages[i % 2].data_ptr()
        if i + 1 < len(plans):
            store.set(f"1/ready/{i + 1}", "1")
        if i == 0:
            assert not store.check(["1/done/0"])  # "done" only once the bucket is loaded and synchronised
    opened = [c for c in cuda_driver.calls if c[0] == "open_shared"]
    assert opened == [("open_shared", 1, h[1][7]) for h in handles]  # each handle once, on device 1
    assert ("synchronize", 1) in cuda_driver.calls and store.check([f"1/done/{len(plans) - 1}"])
    assert len(got) == len(weights)
