"""The rollout engine interface (docs/design.md principle 4): what a rollout worker needs from an engine.

An engine holds a fixed number of slots (concurrent sequences). Requests wait until a slot frees up,
are generated token by token, and come back as Completions with per-token behaviour log-probs and
policy versions. The built-in engine (rollout.engine=cpu, on the CPU or a GPU) and the vLLM engine both
implement this; the worker and everything above it only ever see this interface.

Sleep (colocated layout): an engine gives its accelerator memory back while the trainer on the same GPU
trains, and wakes in vLLM's order: "weights", then the new weights are loaded, then "kv_cache".
Engines are found by name in rlsys/rollout/registry.py (`rollout.engine`); `register_engine` adds one.
"""
from __future__ import annotations

import json
import time
from abc import ABC, abstractmethod
from collections import deque
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from rlsys.types import Completion, Request, ToolTurn

if TYPE_CHECKING:  # annotations only: `rlsys check` loads the engine registry without torch
    from torch import Tensor

    from rlsys.weights.transfer import WeightUpdate

SLEEP_TAGS = ("weights", "kv_cache")  # vLLM's tags, in the order an engine wakes (new weights load in between)


class RolloutEngine(ABC):
    name = "engine"
    tokenizer = None  # set by engines that return text
    eos_ids: set[int] = set()
    asleep: tuple[str, ...] = ()  # what sleep() gave back and wake_up() has not restored: no step runs meanwhile
    # Conversations with tools (`use_tools`): a model turn ends when its text reaches call_close
    call_open: str | None = None
    call_close: str | None = None
    max_turns: int = 0
    max_calls: int = 1  # per model turn
    answer_turns: bool = False  # a turn that ends at EOS without a call is handed out too (an environment answers)
    # The worker's queued aborts, applied now: for `interrupt_step`, on the generation thread inside a step
    between_decode_steps: Callable[[], None] | None = None

    def _decode(self, tokens: list[int]) -> str:
        """The completion's text: what reward functions read."""
        if self.tokenizer is None:
            return ""
        if tokens and tokens[-1] in self.eos_ids:  # the trainer learns EOS; the text never shows it
            tokens = tokens[:-1]
        return self.tokenizer.decode(tokens, skip_special_tokens=True)

    @abstractmethod
    def add(self, request: Request) -> None:
        """Queue a request; it starts as soon as a slot is free. Bad requests raise ValueError."""

    def validate(self, request: Request) -> None:
        """Raise ValueError, naming the request and field, if this engine can never run the request.
        Depends only on the request and the model, so a worker may call it from any thread."""

    def use_tools(self, call_open: str, call_close: str, max_turns: int, max_calls: int = 1,
                  answer_turns: bool = False) -> None:
        """Make every request a conversation: the model's turn ends at a tool call (its text from call_open to
        call_close), `take_calls` hands it out, and `extend` appends the tool's answer, up to max_turns turns.
        With max_calls > 1 a turn may make several calls: it ends at the model's end-of-turn token (EOS) after at
        least one call, or at the closing tag of its max_calls-th call, and its text holds them all. With
        `answer_turns`, a turn that ends at EOS without a call is handed out as well (its text holds no closing tag),
        for an environment to answer as the user.
        The sequence keeps its place (and, where the engine can, its KV cache) while the tool runs."""
        if self.tokenizer is None:
            raise ValueError(f"{self.name}: tools need the model's tokenizer to read tool calls (none in its directory)")
        self.call_open, self.call_close, self.max_turns, self.max_calls = call_open, call_close, max_turns, max_calls
        self.answer_turns = answer_turns
        self._calls: list[tuple[str, int, str]] = []
        # The tail read for the closing tag: at least a byte per token, so a tag the model sampled in any split
        # (not only the tokenizer's own, `</tool_call>` as one token or twelve) ends within this many tokens.
        self._close_tokens = len(call_close.encode()) + 1

    def take_calls(self) -> list[tuple[str, int, str]]:
        """The model turns that ended at tool calls since the last take: (request id, its token count then, the
        turn's text from its first call on: one call, or several (ToolFormat.split_calls))."""
        if not self.call_close:
            return []
        calls, self._calls = self._calls, []
        return calls

    def extend(self, request_id: str, at: int, ids: list[int], turn: ToolTurn | list[ToolTurn]) -> None:
        """Append the answer `ids` to a turn's calls (tokenized once, one ToolTurn per call) to the conversation
        waiting on the call it made at
        `at` tokens; the model goes on from there. A request no longer waiting (aborted, resumed) is ignored."""
        raise NotImplementedError(f"{self.name} does not run conversations with tools")

    def waits_on_tool(self, request_id: str) -> bool:
        """Whether the engine holds this conversation waiting on a tool's answer (its call from `take_calls`)."""
        seq = self._record_of(request_id) if self.call_close else None
        return seq is not None and seq.held

    def request_of(self, request_id: str) -> Request | None:
        """The request the engine holds by this id (None if none): a tool call's conversation, for its tools."""
        seq = self._record_of(request_id)
        return None if seq is None else seq.request

    def turns_of(self, request_id: str) -> list[ToolTurn]:
        """The tool turns so far of the conversation the engine holds by this id (those it resumed included)."""
        seq = self._record_of(request_id)
        return [] if seq is None else list(seq.turns)

    def model_turns_of(self, request_id: str) -> list[str]:
        """The text of each of the model's turns so far in the conversation the engine holds by this id (its runs
        of own tokens, its end-of-turn tokens left out): what an environment's messages show of them."""
        seq = self._record_of(request_id)
        if seq is None:
            return []
        mask = seq.mask or [1] * len(seq.tokens)
        runs, run = [], []
        for token, own in zip(seq.tokens, mask):
            if own and token not in self.eos_ids:
                run.append(token)
            elif run:
                runs, run = runs + [run], []
        runs += [run] if run else []
        return [self.tokenizer.decode(r).strip() for r in runs]

    def can_step(self) -> bool:
        """Whether a step would do anything: not while every request it could advance waits on a tool."""
        if not self.call_close:  # no conversations: nothing ever waits on a tool
            return self.has_work()
        return bool(self.finished_early or any(not seq.held for seq in self._records()))

    def _records(self):
        """The engine's record (`seq` below) of every request a step could advance, held ones included: every
        request it holds, less those that cannot start yet whatever the step does."""
        raise NotImplementedError(f"{self.name} does not run conversations with tools")

    def _record_of(self, request_id: str):
        raise NotImplementedError(f"{self.name} does not run conversations with tools")

    def _waiting_on(self, request_id: str, at: int):
        """The record of `request_id` if it still waits on the call it made at `at` tokens, else None."""
        seq = self._record_of(request_id)
        return seq if seq is not None and seq.held and len(seq.tokens) == at else None

    def _call_made(self, tokens: list[int], mask: list[int]) -> str | None:
        """The turn's call text if the model's turn just ended at its calls (its decoded tail reached call_close,
        or with several calls a turn allows, its EOS after one: the ids are never re-tokenized); with answer_turns,
        the whole turn's text if it ended at EOS without one; else None."""
        if not self.call_close or not tokens or (mask and mask[-1] == 0):
            return None
        at_eos = self.ends_turns_at_eos and tokens[-1] in self.eos_ids
        k = min(self._close_tokens, len(tokens))  # read per token: the tail only, the model's own tokens of it
        if not at_eos and self.call_close not in self.tokenizer.decode(
                tokens[len(tokens) - k + self._turn_start(mask[-k:]):]):
            return None
        text = self.tokenizer.decode(tokens[self._turn_start(mask):])
        calls = text.count(self.call_close)
        if at_eos and not calls and self.answer_turns:
            return text
        if self.max_calls > 1 and not (calls >= self.max_calls or (at_eos and calls)):
            return None  # the model may write another call before its turn ends
        first = text.split(self.call_close)[0].rfind(self.call_open)  # the first call's opening tag
        return text[first:] if first >= 0 else text

    @property
    def ends_turns_at_eos(self) -> bool:
        """Whether EOS may end a model turn the conversation goes on from (several calls a turn, or an environment
        answering every turn), rather than the conversation."""
        return self.max_calls > 1 or self.answer_turns

    @staticmethod
    def _turn_start(mask: list[int]) -> int:
        """The index of the current model turn's first token: after the last tool token."""
        return len(mask) - mask[::-1].index(0) if 0 in mask else 0

    # `seq` below is an engine's record of a request: request, tokens, logprobs, versions, mask, turns, held
    @staticmethod
    def _conversation_so_far(request: Request) -> dict:
        """A new record's mask and turns: those of the conversation it resumes (a plain resume: all the model's)."""
        return dict(mask=list(request.resume_mask) or [1] * len(request.resume_ids), turns=list(request.resume_turns))

    def _conversation_of(self, seq) -> dict:
        """A completion's mask and turns (an empty mask: every token is the model's), and for a conversation the
        model's own text and token count, tool answers left out: what rewards read."""
        if 0 not in seq.mask:
            return dict(mask=[], turns=list(seq.turns))
        own = [t for t, m in zip(seq.tokens, seq.mask) if m]
        return dict(mask=list(seq.mask), turns=list(seq.turns), model_text=self._decode(own), model_tokens=len(own))

    def _call_or_end(self, seq) -> str | None:
        """If the model's turn just ended at a tool call (or, answer_turns, at EOS): hold the conversation and hand
        the turn out; with no turns left to answer (tools.max_turns), end it: "length" at a call, "stop" at EOS."""
        call = self._call_made(seq.tokens, seq.mask)
        if call is None:
            return None
        if sum(t.call == 0 for t in seq.turns) >= self.max_turns:  # turns, not calls
            return "length" if self.call_close in call else "stop"
        seq.held = True
        self._calls.append((seq.request.request_id, len(seq.tokens), call))
        return None

    def _resume_reason(self, seq) -> str | None:
        """A resumed record's finish reason, or None: it goes on, or (held) waits on the calls it made again (a
        turn that ended at EOS after its calls, with several calls a turn allowed, included)."""
        request = seq.request
        if not (self.ends_turns_at_eos and request.resume_ids and request.resume_ids[-1] in self.eos_ids):
            return resume_finish_reason(request, self.eos_ids, self.max_len) or self._call_or_end(seq)
        reason = self._call_or_end(seq)
        return None if seq.held else reason or "stop"

    def _append_answer(self, seq, ids: list[int], turn: ToolTurn | list[ToolTurn]) -> bool:
        """Append a tool's answer to a held conversation, cut to its token budget (a tool's tokens count in
        max_new_tokens); True if the answer used the budget up, which ends the conversation."""
        room = token_budget(seq.request, self.max_len) - len(seq.tokens)
        ids = list(ids[:max(0, room)])
        seq.tokens += ids
        seq.logprobs += [0.0] * len(ids)
        seq.versions += [self.version] * len(ids)
        seq.mask += [0] * len(ids)
        seq.turns += [replace(t, call=i) for i, t in enumerate(turn if isinstance(turn, list) else [turn])]
        seq.held = False
        return len(ids) >= room

    @abstractmethod
    def step(self) -> list[Completion]:
        """Advance generation by one step; return the requests that finished during it."""

    @abstractmethod
    def abort(self, request_ids: list[str]) -> list[Completion]:
        """Cut these requests now (finish_reason "abort", tokens so far) and free their slots.

        Ids the engine does not hold (already finished, never added) are ignored.
        """

    def interrupt_step(self) -> None:
        """Called from another thread once an abort is queued: an engine whose step stands for many decode steps
        (the built-in one, emulated) calls `between_decode_steps` after the one it is in, on its own thread, to
        apply it. Like `validate`, safe to call off the generation thread."""

    @abstractmethod
    def has_work(self) -> bool:
        """True while any request is running or waiting."""

    @abstractmethod
    def load(self) -> dict:
        """{"running": n, "waiting": n, "slots": n}."""

    @abstractmethod
    def load_weights(self, state_dict: dict[str, Tensor], version: int) -> None:
        """Swap in weights (Hugging Face names) between steps; later tokens are tagged `version`. Refuses a
        version older than the one held (`refuse_older`)."""

    @abstractmethod
    def init_weight_group(self, host: str, port: int, world_size: int, rank_offset: int, backend: str,
                          timeout_s: float) -> None:
        """Join trainer rank 0's weight group (rlsys/weights/group.py) as ranks rank_offset.., one per process
        that holds weights. Blocks until every member has joined."""

    @abstractmethod
    def receive_weights(self, update: WeightUpdate) -> None:
        """Load a version bucket by bucket as it arrives (`update.buckets`, rlsys/weights/transfer.py), between
        steps; later tokens are tagged `update.version`. The trainer may be sending meanwhile. Refuses a
        version older than the one held (`refuse_older`)."""

    counters: "EngineCounters"  # every engine records its steps here; workers read occupancy from it
    version: int = 0  # the weights' version, tagged on every new token

    def refuse_older(self, version: int) -> None:
        """Before a byte of new weights loads: an older version than the one held (a late or reordered publish)
        would roll the policy back while its tokens were tagged as newer, so it is refused. The same version
        again is fine (a replaced worker, `rlsys eval`)."""
        if version < self.version:
            raise RuntimeError(f"{self.name}: refused weights version {version}, older than the version {self.version} "
                               "it holds (weight updates must arrive in order)")

    def stats(self) -> dict:
        """Cumulative counters: decode_steps, active_slot_steps, generated_tokens, busy_s,
        saturated_tokens_per_s (None until every slot was busy at least once), with the version and load."""
        return dict(self.counters.report(), version=self.version, **self.load())

    def sleep(self, level: int = 1) -> None:
        """Give the accelerator memory back to a colocated trainer: the KV cache, and the weights (level 1 keeps
        them in host memory, level 2 drops them: load new ones before waking "kv_cache"). Refused while the
        engine holds requests: their KV cache would go (vLLM would abort them)."""
        if level not in (1, 2):
            raise ValueError(f"{self.name}: sleep level must be 1 or 2 (got {level})")
        if self.has_work():
            raise RuntimeError(f"{self.name}: cannot sleep while it holds requests ({self.load()}); abort them or "
                               "let them finish first")
        if not self.asleep:
            self._release(level)
        self.asleep = SLEEP_TAGS

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Take back `tags` (None: all). Generation resumes once nothing is asleep."""
        tags = list(SLEEP_TAGS) if tags is None else tags
        unknown = set(tags) - set(SLEEP_TAGS)
        if unknown:
            raise ValueError(f"{self.name}: unknown wake_up tags {sorted(unknown)} (expected {list(SLEEP_TAGS)})")
        waking = [t for t in self.asleep if t in tags]
        if waking:
            self._reclaim(waking)
        self.asleep = tuple(t for t in self.asleep if t not in tags)

    def _release(self, level: int) -> None:
        """Free what sleep(level) gives back; engines that hold accelerator memory override this and _reclaim."""

    def _reclaim(self, tags: list[str]) -> None:
        """Allocate `tags` again (weights dropped at level 2 hold garbage until new ones are loaded)."""


def check_request(req: Request, vocab: int, max_len: int) -> None:
    """The checks of `validate` that hold for every engine: ValueError naming the request and the field."""
    rid, p = req.request_id, req.params
    if not req.prompt_ids:
        raise ValueError(f"request {rid}: prompt_ids is empty")
    for name in ("prompt_ids", "resume_ids"):
        for i, t in enumerate(getattr(req, name)):
            if not isinstance(t, int) or not 0 <= t < vocab:
                raise ValueError(f"request {rid}: {name}[{i}]={t!r} is not a token id in [0, {vocab})")
    if req.resume_mask and len(req.resume_mask) != len(req.resume_ids):
        raise ValueError(f"request {rid}: resume_mask has {len(req.resume_mask)} entries for {len(req.resume_ids)} "
                         "resume_ids")
    if not len(req.resume_ids) == len(req.resume_logprobs) == len(req.resume_versions):
        raise ValueError(f"request {rid}: resume_ids, resume_logprobs and resume_versions must have the "
                         f"same length (got {len(req.resume_ids)}, {len(req.resume_logprobs)}, "
                         f"{len(req.resume_versions)})")
    if len(req.prompt_ids) >= max_len:
        raise ValueError(f"request {rid}: prompt of {len(req.prompt_ids)} tokens leaves no room in "
                         f"max_len={max_len}")
    if p.max_new_tokens < 1:
        raise ValueError(f"request {rid}: params.max_new_tokens must be >= 1 (got {p.max_new_tokens})")
    if p.temperature < 0:
        raise ValueError(f"request {rid}: params.temperature must be >= 0 (got {p.temperature})")
    if not 0 < p.top_p <= 1:
        raise ValueError(f"request {rid}: params.top_p must be in (0, 1] (got {p.top_p})")


def resume_finish_reason(req: Request, eos_ids: set[int], max_len: int) -> str | None:
    """The finish reason of a resumed request with nothing left to generate: "stop" if it ended in EOS,
    "length" if its token or context budget is spent; None if it goes on."""
    r = req.resume_ids
    if not r:
        return None
    if r[-1] in eos_ids:
        return "stop"
    if len(r) >= token_budget(req, max_len):
        return "length"
    return None


def token_budget(req: Request, max_len: int) -> int:
    """The response tokens a request may have, tool answers included: max_new_tokens, and no more than the
    context leaves after its prompt (prompt + response never exceeds max_len, so the trainer can score it)."""
    return min(req.params.max_new_tokens, max_len - len(req.prompt_ids))


OCCUPANCY_HISTORY = 200_000  # decode steps kept for occupied_slot_s (minutes of generation)


@dataclass
class EngineCounters:
    """What every engine's stats() reports; saturated_* count only steps with every slot busy.

    Each decode step is also kept as (wall end, duration, active sequences), so the slot occupancy of
    any recent time window can be read, in-flight requests included: the bubble ratio of a step is
    measured here, where requests that are aborted or still running are seen as well as finished ones.
    """
    decode_steps: int = 0
    active_slot_steps: int = 0
    generated_tokens: int = 0
    busy_s: float = 0.0
    saturated_tokens: int = 0
    saturated_s: float = 0.0
    prefilled_tokens: int = 0  # written to the KV cache by prefills (admissions, conversations' continuations)
    steps: deque = field(default_factory=lambda: deque(maxlen=OCCUPANCY_HISTORY))

    def record(self, active: int, slots: int, new_tokens: int, elapsed: float) -> None:
        """One step: `active` sequences generated (0: none), `new_tokens` sampled in all, in `elapsed` seconds."""
        if active:
            self.decode_steps += 1
            self.active_slot_steps += active
            self.steps.append((time.time(), elapsed, active))
        self.generated_tokens += new_tokens
        self.busy_s += elapsed
        if active >= slots:
            self.saturated_tokens += new_tokens
            self.saturated_s += elapsed

    def occupied_slot_s(self, start: float, end: float) -> float:
        """Slot-seconds spent decoding within the wall-clock window [start, end] (call it where `record` runs)."""
        return self._within(start, end, by_slot=True)

    def busy_s_within(self, start: float, end: float) -> float:
        """Seconds spent decoding within the wall-clock window [start, end], however many slots were busy."""
        return self._within(start, end, by_slot=False)

    def decode_steps_within(self, start: float, end: float) -> int:
        """Decode steps that ran within the wall-clock window [start, end], in whole or in part (a step records
        its end after the completions it finished, so a window that ends with them holds part of it)."""
        return sum(t_end - elapsed < end for t_end, elapsed, _ in self._since(start))

    def _since(self, start: float):
        """The recorded steps that ended after `start`, newest first: only the window's steps are read."""
        for step in reversed(self.steps):
            if step[0] <= start:
                return
            yield step

    def _within(self, start: float, end: float, by_slot: bool) -> float:
        total = 0.0
        for t_end, elapsed, active in self._since(start):
            total += (active if by_slot else 1) * max(0.0, min(t_end, end) - max(t_end - elapsed, start))
        return total

    def report(self) -> dict:
        sat = self.saturated_tokens / self.saturated_s if self.saturated_s > 0 else None
        return dict(decode_steps=self.decode_steps, active_slot_steps=self.active_slot_steps,
                    generated_tokens=self.generated_tokens, busy_s=self.busy_s, saturated_tokens_per_s=sat,
                    prefilled_tokens=self.prefilled_tokens)


def read_eos_ids(model_dir: Path, eos_token_id: int | None = None) -> set[int]:
    """`eos_token_id` if given, else the model directory's (generation_config.json wins, as in HF)."""
    if eos_token_id is not None:
        return {eos_token_id}
    for name in ("generation_config.json", "config.json"):
        f = model_dir / name
        if f.exists():
            eos = json.loads(f.read_text()).get("eos_token_id")
            if eos is not None:
                return set(eos) if isinstance(eos, list) else {eos}
    return set()


def read_tokenizer(model_dir: Path):
    """The model directory's tokenizer, or None where it has none (the engine then returns no text)."""
    if not any((model_dir / f).exists() for f in ("tokenizer.json", "tokenizer_config.json")):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))
