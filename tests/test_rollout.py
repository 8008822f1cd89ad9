"""Rollout worker (its generation thread, in process) and rollout manager (workers as Ray actors)."""
import time

import pytest
import torch

from rlsys.rollout.builtin_engine import CPUEngine
from rlsys.rollout.worker import RolloutWorker
from rlsys.types import Request, SamplingParams
from test_cpu_engine import SIZES, build

LONG = dict(SIZES, max_position_embeddings=512)  # room for a 300-token response


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("rollout")
    _, path = build(root, seed=0, name="a", sizes=LONG)
    other, _ = build(root, seed=1, name="b", sizes=LONG)
    return path, {k: v.clone() for k, v in other.state_dict().items()}


def req(rid, n, prompt=(1, 2, 3)):
    return Request(rid, "p", list(prompt), SamplingParams(max_new_tokens=n, temperature=0.0))


def drain_until(worker, n, timeout_s=30):
    out, deadline = [], time.time() + timeout_s
    while len(out) < n and time.time() < deadline:
        out += worker.drain(0.5)
    return {c.request_id: c for c in out}


def wait_for_tokens(stats, at_least=1, timeout_s=30):
    deadline = time.time() + timeout_s
    while stats()["generated_tokens"] < at_least:
        assert time.time() < deadline, "no tokens generated"
        time.sleep(0.005)


# --- the worker, in this process ------------------------------------------------------------------
def test_worker_applies_new_weights_between_steps(models):
    path, other = models
    worker = RolloutWorker(path, slots=2, torch_threads=1)
    try:
        worker.submit([req("long", 300)])
        wait_for_tokens(worker.stats)
        worker.load_weights(other, version=1)  # lands between two decode steps
        done = drain_until(worker, 1)["long"]
        k = done.versions.index(1)
        assert 0 < k < 300 and done.versions == [0] * k + [1] * (300 - k)
        worker.submit([req("after", 5)])
        assert drain_until(worker, 1)["after"].versions == [1] * 5
    finally:
        worker.stop()


def test_worker_hands_completions_over_together_and_at_once_when_it_runs_out_of_work(models):
    """rollout.handoff_s: finished completions wait for the others finishing soon after, while the engine still
    runs something; once it runs nothing, the drain returns without waiting out the hand-off time."""
    path, _ = models
    worker = RolloutWorker(path, slots=8, torch_threads=1)
    step = worker.engine.step
    worker.engine.step = lambda: time.sleep(0.005) or step()  # steps of 5 ms at least: the shorts end 15 ms apart
    try:
        worker.submit([req(f"short{n}", n) for n in (1, 2, 3, 4)] + [req("long", 300)])
        first = worker.drain(10, handoff_s=0.3)
        assert sorted(c.request_id for c in first) == ["short1", "short2", "short3", "short4"]
        t = time.time()
        assert [c.request_id for c in worker.drain(10, handoff_s=30)] == ["long"]  # the last: nothing left to run
        assert time.time() - t < 15
    finally:
        worker.stop()


def test_worker_reports_bad_input_and_keeps_going(models):
    path, _ = models
    worker = RolloutWorker(path, slots=2, torch_threads=1)
    try:
        with pytest.raises(ValueError, match=r"request bad: prompt_ids\[1\]=99"):
            worker.submit([req("fine", 4), Request("bad", "p", [1, 99], SamplingParams())])
        worker.submit([req("twice", 200)])
        worker.submit([req("twice", 4)])  # only the engine knows the first is still running
        with pytest.raises(ValueError, match="request twice: request_id already in the engine"):
            worker.drain(5)
        with pytest.raises(ValueError, match=r"model.norm.weight has shape \(2,\)"):
            worker.load_weights({"model.norm.weight": torch.zeros(2)}, version=1)
        worker.submit([req("good", 4)])
        done = drain_until(worker, 2)
        assert set(done) == {"twice", "good"} and done["good"].num_tokens == 4
    finally:
        worker.stop()


def test_generation_thread_errors_are_raised_from_drain(models, monkeypatch):
    path, _ = models
    worker = RolloutWorker(path, slots=2, torch_threads=1)

    def broken_step():
        raise RuntimeError("kv cache exploded")
    monkeypatch.setattr(worker.engine, "step", broken_step)
    worker.submit([req("r", 4)])
    with pytest.raises(RuntimeError, match="generation thread failed: RuntimeError: kv cache exploded"):
        worker.drain(5)
    with pytest.raises(RuntimeError, match="kv cache exploded"):
        worker.submit([req("s", 4)])


# --- the manager, with workers as Ray actors -----------------------------------------------------
@pytest.fixture(scope="module")
def manager(ray_cluster, models):
    from rlsys.rollout.manager import RolloutManager

    path, _ = models
    m = RolloutManager(path, num_workers=2, slots=2, torch_threads=1, drain_timeout_s=0.5)
    yield m
    m.shutdown()


def collect(manager, n, timeout_s=60):
    import ray

    out, deadline = [], time.time() + timeout_s
    while len(out) < n and time.time() < deadline:
        ready, _ = ray.wait(manager.refs(), num_returns=1, timeout=1.0)
        out += manager.collect(ready)
    return out


def test_completions_stream_before_all_are_finished(manager):
    manager.submit([req("s0", 1), req("s1", 1), req("l0", 400), req("l1", 400)])
    first = collect(manager, 1)
    received_at = time.time()
    assert first and {c.request_id for c in first} <= {"s0", "s1"}
    assert sum(manager.outstanding) >= 2  # the long ones are still generating
    rest = collect(manager, 4 - len(first))
    longs = [c for c in rest if c.request_id.startswith("l")]
    assert len(longs) == 2 and all(c.end_time > received_at for c in longs)
    assert all(c.num_tokens == 400 and c.finish_reason == "length" for c in longs)
    assert manager.outstanding == [0, 0]


def test_least_loaded_dispatch_spreads_requests(manager):
    manager.submit([req(f"d{i}", 8) for i in range(4)])
    assert sorted(manager.worker_of.values()) == [0, 0, 1, 1]
    done = collect(manager, 4)
    assert sorted(c.worker for c in done) == [0, 0, 1, 1]
    manager.submit([req("w0-busy", 300)])
    manager.submit([req("next", 3)])  # worker 0 has one outstanding, so this one goes to worker 1
    assert manager.worker_of == {"w0-busy": 0, "next": 1}
    manager.abort(["w0-busy"])
    collect(manager, 2)


def test_abort_through_the_manager(manager):
    def generated():
        return {"generated_tokens": sum(s["generated_tokens"] for s in manager.stats())}

    before = generated()["generated_tokens"]
    manager.submit([req("victim", 400), req("other", 400)])
    wait_for_tokens(generated, before + 10)
    assert manager.abort(["victim", "never-submitted"]) == ["victim"]
    assert all(s["running"] <= 1 for s in manager.stats())  # the victim's slot is already free
    done = {c.request_id: c for c in collect(manager, 2)}
    assert done["victim"].finish_reason == "abort" and 0 < done["victim"].num_tokens < 400
    assert done["other"].finish_reason == "length"
    assert manager.outstanding == [0, 0] and manager.worker_of == {}


def test_generate_matches_the_engine_and_refuses_while_other_requests_are_in_flight(manager, models):
    """generate would take the others' completions and drop them: it refuses; they come back through collect()."""
    path, _ = models
    manager.submit([req("background", 50)])
    with pytest.raises(RuntimeError, match="generate: 1 other requests are in flight"):
        manager.generate([req("g0", 12)])
    assert [c.request_id for c in collect(manager, 1)] == ["background"]
    prompts = [(1, 2, 3), (4, 5), (6, 7, 8, 9), (10,)]
    got = manager.generate([req(f"g{i}", 12, p) for i, p in enumerate(prompts)])
    assert [c.request_id for c in got] == [f"g{i}" for i in range(4)]
    engine = CPUEngine(path, slots=4)
    for i, p in enumerate(prompts):
        engine.add(req(f"g{i}", 12, p))
    expected = {}
    while engine.has_work():
        expected.update((c.request_id, c.token_ids) for c in engine.step())
    assert all(c.token_ids == expected[c.request_id] for c in got)


def test_load_weights_reaches_every_worker(manager, models):
    import ray

    _, other = models
    manager.load_weights(other, version=3)
    done = manager.generate([req("x", 4), req("y", 4)])
    assert {c.worker for c in done} == {0, 1} and all(c.versions == [3] * 4 for c in done)
    manager.load_weights(ray.put(other), version=4)
    assert all(s["version"] == 4 for s in manager.stats())


def test_a_refused_batch_is_raised_from_submit_and_forgotten(manager):
    with pytest.raises(ValueError, match=r"request bad: prompt_ids\[1\]=500"):
        manager.submit([req("ok", 3), Request("bad", "p", [1, 500], SamplingParams()), req("ok2", 3)])
    with pytest.raises(ValueError, match="request ok: request_id already in flight"):
        manager.submit([req("new", 3), req("ok", 3)])
    # Requests are checked per worker batch: worker 1's batch (with "bad") was refused and forgotten.
    assert manager.worker_of == {"ok": 0, "ok2": 0} and manager.outstanding == [2, 0]
    assert {c.request_id for c in collect(manager, 2)} == {"ok", "ok2"}
    assert manager.generate([req("fine", 3)])[0].num_tokens == 3


def test_stats_count_the_decode_steps_of_a_window(manager):
    """The window's decode steps (rollout/decode_steps, decode_step_ms) are the steps each engine took in it: every
    one of a request's tokens but the first (its prefill's) costs one."""
    before, t0 = manager.stats(), time.time()
    manager.submit([req("w0", 30), req("w1", 30)])
    got = collect(manager, 2)
    assert len(got) == 2 and all(c.num_tokens == 30 for c in got)
    window = manager.stats((t0, time.time()))
    assert [w["decode_steps_in_window"] for w in window] == [a["decode_steps"] - b["decode_steps"]
                                                            for a, b in zip(window, before)] == [29, 29]
    later = time.time()
    assert [w["decode_steps_in_window"] for w in manager.stats((later, later + 1))] == [0, 0]


def test_training_dropped_at_the_runs_end_comes_back_cut_and_nothing_waits_to_resume(manager):
    """The final eval drops training's requests (their steps will not come) instead of suspending them: each
    comes back as an abort, eval's are untouched, and nothing is held for a resume that will not come."""
    before = sum(s["generated_tokens"] for s in manager.stats())
    manager.submit([req("d0", 120), req("d1", 120, (4, 5))])
    wait_for_tokens(lambda: {"generated_tokens": sum(s["generated_tokens"] for s in manager.stats())}, before + 10)
    manager.drop_training()
    manager.submit([Request("e", "p", [6, 7], SamplingParams(max_new_tokens=8, temperature=0.0), on_clock=False)])
    got = {c.request_id: c for c in collect(manager, 3)}
    assert sorted(got) == ["d0", "d1", "e"] and got["e"].finish_reason == "length"
    assert all(got[rid].finish_reason == "abort" and got[rid].num_tokens < 120 for rid in ("d0", "d1"))
    assert manager.suspended == [] and manager.suspending == {} and manager.outstanding == [0, 0]


def test_suspended_requests_make_no_progress_and_resume_where_they_stopped(manager):
    """Eval runs with the run's clock paused: training's requests are suspended meanwhile (no token of theirs is
    generated), then go on from their tokens to the same greedy answer as an uninterrupted run."""
    generated = lambda: sum(s["generated_tokens"] for s in manager.stats())  # noqa: E731
    before = generated()
    manager.submit([req("t0", 120), req("t1", 120, (4, 5))])
    wait_for_tokens(lambda: {"generated_tokens": generated()}, before + 10)
    manager.suspend()
    at_suspend = generated()
    evals = [Request(f"e{i}", "p", [6, 7], SamplingParams(max_new_tokens=8, temperature=0.0), on_clock=False)
             for i in range(3)]
    manager.submit(evals)
    got = collect(manager, 3)
    assert sorted(c.request_id for c in got) == ["e0", "e1", "e2"]  # the training partials are not delivered
    assert generated() - at_suspend == sum(c.num_tokens for c in got)  # every token since was eval's
    assert sorted(r.request_id for r in manager.suspended) == ["t0", "t1"]
    assert all(0 < len(r.resume_ids) < 120 for r in manager.suspended)
    manager.resume()
    assert manager.suspended == []
    done = {c.request_id: c for c in collect(manager, 2)}
    # The same greedy requests uninterrupted, on the same workers (whatever weights earlier tests gave them)
    manager.submit([req("u0", 120), req("u1", 120, (4, 5))])
    unmoved = {"t" + c.request_id[1:]: c for c in collect(manager, 2)}
    assert {rid: c.token_ids for rid, c in done.items()} == {rid: c.token_ids for rid, c in unmoved.items()}
    for rid, c in done.items():  # the log-probs of the tokens before the suspend came back with them
        assert c.logprobs == pytest.approx(unmoved[rid].logprobs, abs=1e-4), rid
    assert all(c.finish_reason == "length" for c in done.values()) and manager.outstanding == [0, 0]


def test_a_scale_down_moves_half_the_workers_requests_with_their_tokens_to_the_same_samples(manager):
    """trainer.scale_down_at: worker 1's requests are cut with their tokens and resumed on worker 0, where each
    ends as the same sample it gives unmoved (temperature 1: a request draws token i from uniform i of the run seed
    and its id, on any worker). Worker 1 generates nothing more and takes no new request until scale_up."""
    prompts = {"m0": (1, 2, 3), "m1": (4, 5), "m2": (6, 7, 8), "m3": (9, 10)}

    def sampled():
        return [Request(rid, "p", list(p), SamplingParams(max_new_tokens=150, temperature=1.0))
                for rid, p in prompts.items()]

    def tokens(worker):
        return manager.stats()[worker]["generated_tokens"]

    before = tokens(1)
    manager.submit(sampled())
    on_1 = sorted(rid for rid, i in manager.worker_of.items() if i == 1)
    assert len(on_1) == 2
    wait_for_tokens(lambda: {"generated_tokens": tokens(1)}, before + 20)
    moved_before = manager.moved
    assert manager.scale_down() == [1]
    at_scale_down = tokens(1)
    manager.submit([req("late0", 5), req("late1", 5)])  # least-loaded would give worker 1 one of them
    assert manager.worker_of["late0"] == manager.worker_of["late1"] == 0  # worker 1 is lent: they go to the others
    done = {c.request_id: c for c in collect(manager, 6)}
    assert tokens(1) == at_scale_down  # not a token more on the freed worker
    assert manager.moved - moved_before == 2 and manager.suspending == {} and manager.outstanding == [0, 0]
    assert all(done[rid].worker == 0 and done[rid].finish_reason == "length" for rid in on_1)
    manager.scale_up()
    manager.submit(sampled())  # the same ids, unmoved, on both workers again
    assert sorted(manager.worker_of.values()) == [0, 0, 1, 1]
    unmoved = {c.request_id: c for c in collect(manager, 4)}
    assert {rid: done[rid].token_ids for rid in prompts} == {rid: c.token_ids for rid, c in unmoved.items()}
    assert all(done[rid].versions == unmoved[rid].versions for rid in prompts)
    # The moved ones' log-probs too: the tokens before the move came with the request, not recomputed (the
    # trainer's importance ratios read them); float tolerance, as the batches the steps ran in differ.
    for rid in prompts:
        assert done[rid].logprobs == pytest.approx(unmoved[rid].logprobs, abs=1e-4), rid


def test_the_callers_abort_of_a_request_being_moved_comes_back_as_its_abort(manager):
    """A request the scale-down cut, aborted by the scheduler before its partial came back: it is not resumed."""
    manager.submit([req("a0", 300), req("a1", 300)])
    assert manager.worker_of == {"a0": 0, "a1": 1}
    wait_for_tokens(lambda: {"generated_tokens": manager.stats()[1]["generated_tokens"]}, 1)
    manager.scale_down()
    manager.abort(["a1"])
    done = {c.request_id: c for c in collect(manager, 2)}
    manager.scale_up()
    assert done["a1"].finish_reason == "abort" and 0 < done["a1"].num_tokens < 300 and done["a1"].worker == 1
    assert done["a0"].finish_reason == "length" and manager.worker_of == {} and manager.suspending == {}


def test_profiling_a_workers_steps_writes_its_report_and_changes_no_completion(models, tmp_path, monkeypatch):
    """RLSYS_PROFILE_ENGINE: steps 50 to 70 profiled, every thread's frames sampled, one report."""
    path, _ = models
    plain = RolloutWorker(path, slots=2)
    plain.submit([req("a", 90), req("b", 75, prompt=(4, 5))])
    expected = drain_until(plain, 2)
    plain.stop()
    monkeypatch.setenv("RLSYS_PROFILE_ENGINE", str(tmp_path))
    worker = RolloutWorker(path, slots=2, index=3)
    worker.submit([req("a", 90), req("b", 75, prompt=(4, 5))])
    got = drain_until(worker, 2)
    worker.stop()
    assert {k: c.token_ids for k, c in got.items()} == {k: c.token_ids for k, c in expected.items()}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["engine-3-50.txt"]  # the next window: at step 300
    report = (tmp_path / "engine-3-50.txt").read_text()
    assert report.startswith("steps 20 after 50: wall ")
    assert "generation thread: " in report and "aten::" in report


def test_a_worker_stopped_inside_a_profiled_window_reports_its_steps_and_stops_profiling(models, tmp_path,
                                                                                         monkeypatch):
    """A run that ends inside a window (steps 50 to 70 here, of about 60): the worker's stop ends it, so neither
    torch's profiler nor the sampler thread outlives the worker (another profiler of the process would clash)."""
    import threading

    path, _ = models
    monkeypatch.setenv("RLSYS_PROFILE_ENGINE", str(tmp_path))
    worker = RolloutWorker(path, slots=1, index=2)
    worker.submit([req("a", 60)])
    assert drain_until(worker, 1)["a"].num_tokens == 60
    worker.stop()
    report = (tmp_path / "engine-2-50.txt").read_text()
    steps = int(report.split()[1])
    assert report.startswith(f"steps {steps} after 50: wall ") and 0 < steps < 20
    assert f"the worker stopped inside this window, after {steps} of its steps" in report
    assert "engine-step-profiler" not in [t.name for t in threading.enumerate()]
    assert not torch.autograd.profiler._is_profiler_enabled


def test_profile_windows_that_would_overlap_are_refused():
    from rlsys.rollout.profile import StepProfiler

    with pytest.raises(ValueError, match="RLSYS_PROFILE_ENGINE: a window of steps=30 must fit between two starts"):
        StepProfiler("unused", 0, torch.device("cpu"), steps=30, every=20)
