"""The controller: one loop that turns scheduler actions into work on the Ray actors and events back
into the scheduler (docs/design.md "Shape"). Everything it calls has one job; the policy lives in control/.

With `rollout.enable_sleep_mode` (on by default where engines share GPUs with the trainer) the engines
sleep as soon as they are built, so the trainer starts on free GPUs, and again before every train step;
after it they wake in vLLM's order: "weights", the new weights, "kv_cache", then the next requests.
The config refuses schedules that keep requests generating while the trainer trains.
"""
from __future__ import annotations

import signal
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from itertools import groupby
from pathlib import Path

import ray

from rlsys.checkpoint import (STATE_FILE, CheckpointManager, claim_run_dir, finished_step, open_to_umask,
                              write_json_atomic)
from rlsys.cluster import init_ray
from rlsys.config import Config, save_config
from rlsys.control import build_scheduler
from rlsys.control.actions import Abort, Accumulate, Submit, Train
from rlsys.control.events import Aborted, Event, Generated, Scored
from rlsys.data import load_prompts
from rlsys.tools.schemas import tool_schemas
from rlsys.data.cursor import PromptCursor
from rlsys.emulate import Emulation, Overruns, clock_label
from rlsys.errors import UserError
from rlsys.evaluate import RUN_CONFIG, Evaluation
from rlsys.friction import Friction
from rlsys.logger import RunLogger, waiting
from rlsys.placement import Placement, format_plan, idle_warning, plan_from_config
from rlsys.models import load_tokenizer, prepare_model, weights_fingerprint
from rlsys.reward.pool import RewardPool
from rlsys.rollout.manager import RolloutManager
from rlsys.startup import start_problems, stale_loss_warning
from rlsys.step_stats import StepStats, engine_pace
from rlsys.trainer.logprobs import Scoring
from rlsys.trainer.worker import TrainerDied, TrainerGroup, done_or_failed
from rlsys.types import (Completion, Prompt, Request, RunStopped, SamplingParams, ScoredSample, env_sample, reward_item,
                         trajectory_return)
from rlsys.weights.sync import WeightSync

# Level 2 drops the engines' weights instead of copying them to host memory (a pinned copy per engine, 15 GB
# for a 7B model): every wake loads the trainer's weights anyway (`publish`).
SLEEP_LEVEL = 2


@dataclass
class RunningStep:
    """A train step the trainer is running: its groups, the rollout figures taken at hand-over, its refs."""
    groups: list
    rollout_metrics: dict
    refs: list
    started: float = field(default_factory=time.time)

    def done(self) -> bool:
        return done_or_failed(self.refs)


class Controller:
    def __init__(self, cfg: Config, resume: bool = False):
        self.cfg = cfg
        self.run_dir = Path(cfg.output_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        save_config(cfg, self.run_dir / "config.yaml")
        # emulate: every part paced to the cost model, and the run's clock in emulated seconds
        self.emulation = Emulation.of(cfg) if cfg.emulate.on else None
        self.clock_scale = cfg.emulate.time_scale if self.emulation else 1.0
        self.sync_pacer = self.emulation.sync_pacer() if self.emulation else None
        self.overruns = Overruns(cfg.emulate.overrun_limit)
        plan = plan_from_config(cfg)
        for warning in (plan and idle_warning(plan), stale_loss_warning(cfg)):  # not fatal: the run still runs
            if warning:
                print(warning, file=sys.stderr, flush=True)
        init_ray(cfg.cluster)
        self.placement = None
        if plan:  # where each engine and trainer rank goes (GPU clusters only), reserved before any actor starts
            self.placement = Placement(plan, may_grow=bool(cfg.cluster.address))  # a Ray we started: fixed
            print(format_plan(plan, self.placement.node_addresses()), flush=True)
        self.model_dir = prepare_model(cfg)
        self.fingerprint = weights_fingerprint(self.model_dir)  # what the run starts from, where rlsys built it
        self.tokenizer = load_tokenizer(self.model_dir)
        train, self.eval_prompts, _ = load_prompts(cfg.data, self.tokenizer, tool_schemas(cfg.tools))  # logs drops
        self.scheduler = build_scheduler(cfg, PromptCursor(train, seed=cfg.data.seed))
        self.rollout = RolloutManager.from_config(cfg, self.model_dir, self.placement)
        self.sleeps = cfg.rollout.enable_sleep_mode
        if self.sleeps:  # before the trainer is built: it starts on the memory the engines give back
            self.rollout.sleep(SLEEP_LEVEL)
        self.rewards = RewardPool(cfg.reward)
        self.friction = Friction(cfg.friction, cfg.seed)
        self.trainer = TrainerGroup(cfg, str(self.model_dir), Scoring.of(cfg.rollout), self.placement)
        self.weights = WeightSync(cfg, self.trainer, self.rollout)
        self.checkpoints = CheckpointManager(self.run_dir / "checkpoints")
        self.log = RunLogger(self.run_dir, cfg.logging, cfg.trainer.total_steps, clock_label(cfg.emulate))
        self.step, self.version, self.elapsed_before = 0, 0, 0.0
        self.in_flight: dict[str, Completion] = {}  # completions waiting for their reward
        self.prompts: dict[str, Prompt] = {}  # request id -> prompt, until the sample is scored
        self.training: RunningStep | None = None
        self.evaluation: Evaluation | None = None  # running: the pump routes its completions and rewards to it
        self.streamed_groups = 0  # groups whose gradients the trainer is accumulating (trainer.streamed)
        self.unstreamed: list = []  # trainer.scale_down_at: announced groups waiting for the scale-down's GPUs
        self.lent: list[int] = []  # the engines scaled down, until the step's Train
        self.scaled_down_at: float | None = None  # when (wall time)
        self.lent_before = 0 if cfg.trainer.scale_down_at is not None else None  # micro-batches on lent GPUs so far
        self.stop_requested, self.done = False, False
        self.paused_s = 0.0  # time spent in eval and checkpoints, kept out of the training clock
        self.paused_at: float | None = None  # when the running eval or checkpoint began
        if resume:
            self._restore()
        self.t0 = time.time() - self.elapsed_before
        self.stats = StepStats(cfg.control.straggler_kappa, self.rollout.capacity, self.rollout.stats, self.wall_now)

    # --- the loop -------------------------------------------------------------------------
    def run(self) -> dict:
        # Ctrl-C stops as a pre-emption notice does, while this run runs; a driver's own handlers (a bench's
        # next run, its report) are back once it has returned
        before = {signum: signal.signal(signum, self._on_stop_signal) for signum in (signal.SIGTERM, signal.SIGINT)}
        try:
            return self._run()
        finally:
            for signum, handler in before.items():
                signal.signal(signum, handler)

    def _run(self) -> dict:
        if self.rollout.asleep:  # slept at start: the first wake brings the trainer's weights
            self.publish()
        if self.step == 0:
            self.log.write(0, self.now(), {**self.emulated(self.evaluate()), "policy_version": 0, **self.describe()})
        # resumed at its last step (stopped there before its final eval and export): only those are left
        self.done = self.step >= self.cfg.trainer.total_steps
        if not self.done:
            self.stats.start_step()
            self.apply(self.scheduler.start(self.now()))
        while not self.done:
            self.handle(self.next_events())
            if self.training and self.training.done():
                self.apply(self.finish_training())
        return self.finish()

    def handle(self, events: list[Event]) -> None:
        self.score([e.completion for e in events if isinstance(e, Generated)])
        for event in events:
            if not isinstance(event, Generated):
                self.apply(self.scheduler.handle(event, self.now()))

    def apply(self, actions) -> None:
        """In order; a run of consecutive Submits goes to the engines as one batch of requests (one call per
        engine, not one per prompt)."""
        for submits, run in groupby(actions, key=lambda a: isinstance(a, Submit)):
            if submits:
                self.submit([r for action in run for r in self.requests_for(action)])
                continue
            for action in run:
                if isinstance(action, Abort):
                    self.rollout.abort(action.request_ids)
                elif isinstance(action, Accumulate):
                    self.accumulate(action)
                elif isinstance(action, Train):
                    self.start_training(action.groups)
                else:
                    raise TypeError(f"scheduler {self.cfg.control.scheduler!r} asked for an unknown action "
                                    f"{action!r}")

    def next_events(self) -> list[Event]:
        """Wait for the engines, the reward pool or the train step; what they gave back for training, as events.
        What comes back for the running evaluation goes to it (its rewards are its own: no friction, no stats)."""
        rollout_refs, reward_refs = self.rollout.refs(), self.rewards.refs()
        training = self.training.refs if self.training else []
        undelivered = self.rollout.undelivered  # completions cut by a worker's death outside collect()
        ready, _ = ray.wait(rollout_refs + reward_refs + training, num_returns=1, timeout=0 if undelivered else 1.0)
        if ready:
            ready, _ = ray.wait(rollout_refs + reward_refs, num_returns=len(rollout_refs + reward_refs), timeout=0)
        ready = set(ready)
        events: list[Event] = []
        evaluated = []
        for completion in self.rollout.collect([r for r in rollout_refs if r in ready]):
            if self.evaluation and self.evaluation.owns(completion.request_id):
                evaluated.append(self.evaluation.to_score(completion))
                continue
            self.stats.add_completion(completion)
            if completion.finish_reason == "abort":
                self.prompts.pop(completion.request_id, None)
                events.append(Aborted(completion))
            else:
                if self.cfg.tools.on_failure == "drop" and not all(t.ok for t in completion.turns):
                    completion.drop_from_training()
                events.append(Generated(completion))
        self.rewards.submit(evaluated)
        for result in self.rewards.collect([r for r in reward_refs if r in ready]) + self.rewards.reap():
            if self.evaluation and self.evaluation.owns(result.key):
                self.evaluation.add(result.key, result.reward)
                continue
            self.stats.add_reward(result.error)
            self.prompts.pop(result.key, None)
            reward = self.friction.reward(result.key, result.reward)  # the testbed's flips (off by default)
            completion = self.in_flight.pop(result.key)
            tools = self.cfg.tools
            returned = trajectory_return(reward, completion.turns, tools.return_rule, tools.gamma)
            events.append(Scored(ScoredSample(completion, returned, result.error, result.parts)))
        return events

    def score(self, completions: list[Completion]) -> None:
        """Finished completions to the reward pool, each with the answer of the prompt it was asked for."""
        for c in completions:
            self.in_flight[c.request_id] = c
        self.rewards.submit([reward_item(c, self.prompts[c.request_id]) for c in completions])

    def requests_for(self, action: Submit) -> list[Request]:
        prompt_ids = self.tokenizer(action.prompt.text)["input_ids"]
        requests = []
        for rid in action.request_ids:
            self.prompts[rid] = action.prompt
            # No seed: vLLM samples seeded rows one by one (the built-in engine seeds from the run seed and id)
            params = self.friction.sampling(rid, SamplingParams(self.cfg.rollout.max_new_tokens_at(self.step),
                                                                self.cfg.rollout.temperature, self.cfg.rollout.top_p))
            resume = action.resume.get(rid)  # a partial rollout continues with this run's sampling params
            sample = env_sample(action.prompt) if self.cfg.tools.env else None
            requests.append(replace(resume, params=params, sample=sample) if resume
                            else Request(rid, action.prompt.uid, prompt_ids, params, sample=sample))
        return requests

    def submit(self, requests: list[Request]) -> None:
        self.stats.submitted(len(requests))
        self.rollout.submit(requests)

    def accumulate(self, action: Accumulate) -> None:
        """trainer.streamed: gradients of groups the next Train will hold, computed while generation goes on,
        and the updates of the mini-batches they complete. With trainer.scale_down_at they wait for the
        scale-down, then train on the GPUs it frees (RollPacker's stream trainer; the simulator's alike). RollPacker
        scales down in long rounds only: a short round has no long tail to lend GPUs from, so under scale_down_at
        its groups are not streamed and it trains at its Train, as a step without trainer.streamed does."""
        at = self.cfg.trainer.scale_down_at
        if not self.cfg.trainer.streamed or (at is not None and not action.long_round):
            return
        if not self.streamed_groups:
            self.trainer.stream_begin(action.train_groups, self.version)
        self.streamed_groups += len(action.groups)
        self.unstreamed += action.groups
        if at is not None and not self.lent:
            if self.streamed_groups < at * action.train_groups:
                return
            self.scale_down()
        groups, self.unstreamed = self.unstreamed, []
        self.trainer.stream_groups(groups)

    def scale_down(self) -> None:
        """Half the engines hand their requests to the other half (each resumed there with its tokens) and take
        none until the step's Train; emulated, the trainer's micro-batches meanwhile stand on their GPUs alone
        (rlsys/emulate.py)."""
        self.lent, self.scaled_down_at = self.rollout.scale_down(), time.time()
        if self.emulation:
            self.trainer.lend(self.emulation.budget.lent(self.lent, self.cfg.trainer.world_size))

    def scale_up(self) -> None:
        """At the Train, which has every request aborted or collected: every engine serves again, and the trainer's
        last micro-batches of the step have its own GPUs."""
        self.rollout.scale_up()
        if self.emulation:
            self.trainer.lend(None)
        self.lent = []

    def start_training(self, groups) -> None:
        """Launch the train step; generation and scoring go on while it runs (sync simply has no work)."""
        if self.training:
            raise RuntimeError(f"scheduler {self.cfg.control.scheduler!r} asked to train before the last "
                               "step's weights were published")
        rollout_metrics = self.stats.close_rollout(groups)
        if self.lent:  # when, on the timeline's clock (the run's seconds since its start), and requests moved so far
            self.scale_up()
            at = (self.scaled_down_at - self.t0) / self.clock_scale
            rollout_metrics.update({"rollout/scaled_down_at_s": round(at, 4), "rollout/moved": self.rollout.moved})
        if self.sleeps:  # the scheduler has aborted or collected every request: engines hold none
            self.rollout.sleep(SLEEP_LEVEL)
        if self.streamed_groups:  # the scheduler announced every group of this Train with Accumulate
            if self.streamed_groups != len(groups):
                raise RuntimeError(f"trainer.streamed: {self.streamed_groups} groups were accumulated but the "
                                   f"Train holds {len(groups)}; scheduler {self.cfg.control.scheduler!r} broke "
                                   "the Accumulate contract")
            refs, self.streamed_groups = self.trainer.stream_end(), 0
        else:
            refs = self.trainer.start_train_step(groups, self.version)
        self.training = RunningStep(groups, rollout_metrics, refs)

    def finish_training(self) -> list:
        step, self.training = self.training, None
        train_metrics = self.trainer.finish_train_step(step.refs)
        ended = time.time()
        t_train = ended - step.started
        overlap = self.stats.generating_share(step.started, ended)
        self.version += 1
        t = time.time()
        self.publish()
        t_sync = time.time() - t
        self.step += 1
        metrics = dict(step.rollout_metrics, **self.stats.step_totals())
        # on the training clock, as the metrics (evals and checkpoints left out): a resumed run's t0 is on it too
        self.log.timeline(self.stats.timeline_rows(self.step, self.t0 + self.paused_s, self.clock_scale))
        metrics.update({"policy_version": self.version, "timing/train_s": t_train,
                        "timing/generating_during_train": overlap,
                        "timing/weight_sync_s": t_sync, "reward/errors": self.rewards.errors,
                        "rollout/restarts": self.rollout.restarts})
        if self.cfg.rollout.max_new_tokens_stages:
            metrics["rollout/max_new_tokens"] = self.cfg.rollout.max_new_tokens_at(self.step - 1)  # the step's cap
        metrics.update({f"train/{k}": v for k, v in train_metrics.items() if not k.startswith("emulate_")})
        every = self.cfg.control.eval_every
        if every and self.step % every == 0 and self.step < self.cfg.trainer.total_steps:
            # Before on_trained: to the scheduler the step is still training, so it starts none meanwhile
            # and the engines keep these weights until the evaluation is done.
            metrics.update(self.evaluate())
        self.scheduler.on_trained(self.version, step.groups)
        if self.cfg.rollout.max_new_tokens_at(self.step) != self.cfg.rollout.max_new_tokens_at(self.step - 1):
            self.scheduler.sizer.workload_changed()  # the next step's answers have a new cap
        metrics.update(self.scheduler.metrics())
        if self.cfg.friction.on:
            metrics.update(self.friction.counts)
        if self.emulation:
            metrics.update(self.overruns.step(self.pacer_counts(train_metrics)))
            if self.lent_before is not None:  # trainer.scale_down_at: the step's micro-batches on lent GPUs
                lent = train_metrics.get("emulate_lent_held", 0)
                metrics["emulate/lent_micro_batches"], self.lent_before = lent - self.lent_before, lent
        self.log.write(self.step, self.now(), self.emulated(metrics))
        every = self.cfg.control.save_every
        self.done = self.step >= self.cfg.trainer.total_steps or self.stop_requested
        if (every and self.step % every == 0) or self.done:
            self.save()
        if self.done:
            return []
        self.stats.start_step()
        return self.scheduler.start(self.now())

    # --- eval, checkpoints, end -------------------------------------------------------------
    def evaluate(self) -> dict[str, float]:
        """Eval's requests go through the pump beside training's: training's requests in flight wait, suspended
        with their tokens, while rewards already asked for are scored; once the run is done, training's requests
        are dropped and their results left unread. control.eval_every=0: none at all, not even before and after
        training."""
        if not self.cfg.control.eval_every:
            return {}
        with self.paused():
            t = time.time()
            self.evaluation = Evaluation(self.tokenizer, self.eval_prompts, self.cfg.rollout)
            if self.done:  # sorted's and async's requests for steps that will not come
                self.rollout.drop_training()
            else:
                self.rollout.suspend()  # training's requests wait with the clock, as if eval took no time
            self.rollout.submit(self.evaluation.requests)
            with waiting(self.evaluation.progress, say=self.log.say):  # the bar stands still meanwhile
                while not self.evaluation.done:
                    events = self.next_events()
                    if not self.done:
                        self.handle(events)
            if not self.done:
                self.rollout.resume()
            metrics, self.evaluation = self.evaluation.metrics(), None
            ended = time.time()
            pace = engine_pace(self.rollout.stats((t, ended)), ended - t)
            return {**metrics, "timing/eval_s": ended - t, "eval/decode_step_ms": pace["decode_step_ms"],
                    "eval/engine_busy_share": pace["busy_share"]}

    def save(self) -> Path:
        def write(folder: Path) -> None:
            self.trainer.save(str(folder / "trainer"))
            write_json_atomic(folder / STATE_FILE, {
                "step": self.step, "version": self.version, "elapsed_s": self.wall_now(),
                "scheduler": self.scheduler.state_dict(), "reward_errors": self.rewards.errors})
        with self.paused():
            return self.checkpoints.save(self.step, write)

    def _restore(self) -> None:
        latest = self.checkpoints.latest()
        if latest is None:
            raise FileNotFoundError(f"--resume: no complete checkpoint under {self.checkpoints.root}")
        state = self.checkpoints.read_state(latest)
        self.trainer.load(str(latest / "trainer"))
        self.scheduler.load_state_dict(state["scheduler"])
        self.step, self.version, self.elapsed_before = state["step"], state["version"], state["elapsed_s"]
        self.rewards.errors = state.get("reward_errors", 0)
        self.publish()
        self.log.resumed(self.step, f"resumed from {latest} at step {self.step}")

    def finish(self) -> dict:
        """The last step's checkpoint is already written; evaluate and export unless pre-empted."""
        final = {"policy_version": self.version, "step": self.step}
        if not self.stop_requested:
            final.update(self.emulated(self.evaluate()), **self.describe())
            if self.emulation:
                final.update(self.overruns.summary())
            self.log.write(self.step, self.now(), final, final=True)
            self.trainer.export_hf(str(self.run_dir / "export"), str(self.model_dir))
            open_to_umask(self.run_dir / "export")
            write_json_atomic(self.run_dir / "export" / RUN_CONFIG, self.cfg.model_dump())  # its task goes with it
        self.log.close()
        try:  # matplotlib is optional: offline GPU hosts go without it (benchmarks/gpu/build_bundle.py)
            from rlsys.plot import plot_run
        except ModuleNotFoundError as e:
            print(f"no plots: {e.name} is not installed (`rlsys plot {self.run_dir}` draws them where it is)")
        else:
            plot_run(self.run_dir)
        return dict(final, stopped=self.stop_requested)  # what the command says: done, or how to go on

    def shutdown(self) -> None:
        for part in (self.rollout, self.rewards, self.trainer):
            part.shutdown()
        if self.placement:
            self.placement.remove()

    # --- small helpers ----------------------------------------------------------------------
    def wall_now(self) -> float:
        """The training clock: wall time since the start, less evaluation and checkpoint time."""
        return (self.paused_at or time.time()) - self.t0 - self.paused_s

    def now(self) -> float:
        """The training clock in the run's seconds: emulated ones under `emulate`."""
        return self.wall_now() / self.clock_scale

    def emulated(self, metrics: dict) -> dict:
        """Times and rates on the run's clock: wall seconds (`timing/*_s`) over emulate.time_scale."""
        if not self.emulation:
            return metrics
        out = {k: v / self.clock_scale if k.startswith("timing/") and k.endswith("_s") else v
               for k, v in metrics.items()}
        if "throughput/tokens_per_s" in out:
            out["throughput/tokens_per_s"] *= self.clock_scale
        return out

    def describe(self) -> dict:
        """The step-0 and final rows' account of the run: its emulated clock, and the model it started from."""
        return {**(self.emulation.describe() if self.emulation else {}),
                **({"model/fingerprint": self.fingerprint} if self.fingerprint else {})}

    def pacer_counts(self, train_metrics: dict) -> list[dict]:
        """Every pacer's cumulative counts: the engines', the trainer ranks' (summed) and the publish's."""
        engines = [e["emulate"] for e in self.rollout.stats() if "emulate" in e]
        trainer = {k: train_metrics.get(f"emulate_{k}", 0) for k in ("held", "overruns", "overrun_s")}
        return engines + [trainer, self.sync_pacer.counts()]

    @contextmanager
    def paused(self):
        """The training clock stands still while an evaluation or a checkpoint runs."""
        self.paused_at = time.time()
        try:
            yield
        finally:
            self.paused_s += time.time() - self.paused_at
            self.paused_at = None

    def publish(self) -> None:
        """The trainer's weights, as `self.version`, to every engine. Sleeping engines wake in vLLM's order: the
        weights, then the new ones load, then the KV cache, which is thus never held beside two weight copies."""
        started = time.perf_counter()
        asleep = self.rollout.asleep
        if asleep:
            self.rollout.wake_up(["weights"])
        self.weights.publish(self.version)
        if asleep:
            self.trainer.release_cached_memory()  # the trainer's cached activations would crowd the KV cache out
            self.rollout.wake_up(["kv_cache"])
        if self.sync_pacer:
            self.sync_pacer.hold(started, self.emulation.sync_s)

    def _on_stop_signal(self, signum, _frame):
        if signum == signal.SIGINT and self.stop_requested:  # a second Ctrl-C: stop at once, no checkpoint
            raise KeyboardInterrupt
        hint = " (Ctrl-C again stops at once, without a checkpoint)" if signum == signal.SIGINT else ""
        print(f"{signal.Signals(signum).name}: finishing the current step, saving a checkpoint, then exiting{hint}",
              flush=True)
        self.stop_requested = True

    def stopped_by(self, death: TrainerDied) -> str:
        """Where a dead trainer rank stopped the run, and how to go on from there."""
        step = self.checkpoints.latest_step()
        how = (f"`rlsys train` with the same config and --resume continues from the last checkpoint, step {step}"
               if step is not None else "no checkpoint was written yet: start it again")
        return f"trainer rank {death.rank} died in step {self.step + 1} ({death.why}). The run stopped; {how}."


def train(cfg: Config, resume: bool = False, controller_class: type[Controller] = Controller,
          overwrite: bool = False) -> dict:
    """One run; a benchmark may pass a Controller subclass that changes one of its jobs (a baseline). A finished
    run resumed is left as it is: `finished` in the result, nothing started."""
    problems = start_problems(cfg)
    if problems:  # seconds before anything starts, not after Ray, the engines and the trainer have
        raise UserError("this run would fail at start-up:\n  " + "\n  ".join(problems))
    claim_run_dir(cfg.output_dir, resume, overwrite)
    if resume and (step := finished_step(cfg.output_dir, cfg.trainer.total_steps)) is not None:
        return {"step": step, "finished": True, "stopped": False}
    controller = controller_class(cfg, resume=resume)
    try:
        return controller.run()
    except TrainerDied as death:
        raise RunStopped(controller.stopped_by(death)) from None
    finally:
        controller.shutdown()
