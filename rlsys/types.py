"""The records that flow through rlsys: prompt -> request -> completion -> scored sample -> group.

Plain dataclasses with no torch inside, so the pure control/ code and the simulator can use them.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Optional


@dataclass(frozen=True)
class Prompt:
    uid: str  # stable across runs: "<split>-<index>"
    text: str
    answer: str
    data_source: str = "synthetic"
    index: int = 0  # position in its dataset, what the data cursor counts
    # The row's veRL `extra_info`, passed to a veRL-style reward function; a dict, so left out of the hash
    extra_info: Optional[dict] = field(default=None, hash=False)


def env_sample(prompt: Prompt) -> dict:
    """The sample an environment is reset with (tools.env): the prompt's text, its reference answer, data source,
    uid and extra_info (made JSON: it crosses to the environment's process), so the environment can judge the
    model's actions against the answer."""
    extra = json.loads(json.dumps(prompt.extra_info or {}, default=str))
    return {"prompt": prompt.text, "answer": prompt.answer, "data_source": prompt.data_source, "uid": prompt.uid,
            "extra_info": extra}


@dataclass
class SamplingParams:
    max_new_tokens: int = 96
    temperature: float = 1.0
    top_p: float = 1.0
    seed: Optional[int] = None  # per-request seed, so a sample is reproducible
    # The temperature its recorded log-probs are computed at, None: `temperature`. Only the friction testbed
    # sets it, to make a sampler misreport what it drew from (the built-in engine honours it).
    logprob_temperature: Optional[float] = None


@dataclass
class Request:
    """One sample to generate. `resume_*` carry tokens already generated (partial rollouts)."""
    request_id: str
    prompt_uid: str
    prompt_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    resume_ids: list[int] = field(default_factory=list)
    resume_logprobs: list[float] = field(default_factory=list)
    resume_versions: list[int] = field(default_factory=list)
    resume_mask: list[int] = field(default_factory=list)  # a conversation's: see Completion.mask
    resume_turns: list["ToolTurn"] = field(default_factory=list)
    # What an environment's reset receives (tools.env): env_sample(prompt); None: {"prompt": the prompt's text}
    sample: Optional[dict] = None
    # Eval's requests are off the run's clock (paused there), so an emulating engine does not hold them to it
    on_clock: bool = True


@dataclass(frozen=True)
class ToolTurn:
    """One tool call of a conversation: the tool, whether it answered, how long it took, and the reward an
    environment (tools.env) gave the turn."""
    name: str
    ok: bool
    error: Optional[str] = None
    elapsed_s: float = 0.0
    reward: float = 0.0
    call: int = 0  # its place among its model turn's calls (tools.max_calls_per_turn): 0 starts a turn
    # An environment's step that it answered: its action, replayed to rebuild the environment (ToolBox.run)
    action: Optional[str] = None
    answer: Optional[str] = None  # the text the model was given: what an environment's messages show of the turn


def trajectory_return(reward: float, turns: list[ToolTurn], rule: str = "sum", gamma: float = 1.0) -> float:
    """A sample's return, what every advantage estimator reads (ScoredSample.reward). With T tool turns (model
    turns that made calls, t = 0 the first; r_t the sum of turn t's calls' rewards) and the reward function's
    value R for the model's final turn, turn T:
    - "sum": R + sum_t r_t;
    - "discounted": sum_t gamma^t r_t + gamma^T R (gamma 1: the sum)."""
    gamma = gamma if rule == "discounted" else 1.0
    index, total = -1, 0.0
    for t in turns:
        index += t.call == 0  # a turn's first call opens it
        total += gamma ** index * t.reward
    return total + gamma ** (index + 1) * reward


@dataclass
class Completion:
    """What an engine returns for a request: finished ("stop" | "length") or cut ("abort")."""
    request_id: str
    prompt_uid: str
    prompt_ids: list[int]
    token_ids: list[int]  # response tokens only
    logprobs: list[float]  # behaviour log-prob of each response token
    versions: list[int]  # policy version that produced each response token
    finish_reason: str
    text: str = ""
    worker: int = 0
    slot: int = -1
    submit_time: float = 0.0
    start_time: float = 0.0  # when it took a slot
    end_time: float = 0.0
    stale_kv_tokens: int = 0  # tokens sampled over KV cache from older weights (weights.running_requests=keep)
    # A conversation with tools (tools.fns): 1 per token the model sampled, 0 per token of a tool's answer (its
    # log-prob 0.0, its version the one current when it came); empty: every token is the model's.
    mask: list[int] = field(default_factory=list)
    turns: list[ToolTurn] = field(default_factory=list)  # its tool calls, in order
    # A conversation's own text and token count, its tools' answers left out: what rewards and the overlong
    # penalty read (None: not a conversation, the text and token_ids are the model's alone)
    model_text: str | None = None
    model_tokens: int | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def drop_from_training(self) -> None:
        """Mask every token (tools.on_failure=drop, after a failed tool call): the sample still counts in its
        group's advantages, as an empty answer does, but trains nothing."""
        self.mask = [0] * len(self.token_ids)

    def resume_fields(self) -> dict:
        """The Request fields that continue this cut completion from where it stopped (partial rollouts). The
        token sequences pass as they are, not copied, as before conversations: the simulator's are run-length Runs,
        too long to walk."""
        return dict(resume_ids=self.token_ids, resume_logprobs=self.logprobs, resume_versions=self.versions,
                    resume_mask=list(self.mask), resume_turns=list(self.turns))


@dataclass
class ScoredSample:
    completion: Completion
    reward: float
    reward_error: Optional[str] = None  # why the fallback reward was used, if it was
    reward_parts: Optional[dict] = None  # each reward.fn part's value, where it names several


@dataclass
class Group:
    """All samples of one prompt that are trained together; advantages are relative within it."""
    prompt: Prompt
    samples: list[ScoredSample]

    @property
    def rewards(self) -> list[float]:
        return [s.reward for s in self.samples]

    @property
    def lengths(self) -> list[int]:
        return [s.completion.num_tokens for s in self.samples]


class RunStopped(RuntimeError):
    """A fault the run cannot survive; the message says where it stopped and how to go on."""


def reward_item(completion: Completion, prompt: Prompt) -> tuple:
    """The reward pool's item for a completion of `prompt`: (key, response, answer, num_tokens, data_source,
    extra_info, prompt text)."""
    c = completion
    return (c.request_id, c.text if c.model_text is None else c.model_text, prompt.answer,
            c.num_tokens if c.model_tokens is None else c.model_tokens, prompt.data_source, prompt.extra_info,
            prompt.text)
