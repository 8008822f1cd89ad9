"""A streamed train step: gradients of completed prompts accumulate while the round is still generating,
and each of the step's `trainer.mini_batches` optimizer updates runs as soon as its groups are all in
(docs/design.md "Tail batching"). Each update equals the synchronous step's on the same mini-batch.

The losses divide by the mini-batch's token (or sequence) count, which is unknown until its last group is
in. So each part is accumulated un-normalised (totals of 1) and `close` divides the summed gradients by the
count before clipping and stepping: the same gradient as the synchronous step up to float rounding.
Statistics are divided the same way. Each part is planned on its own (`plan_step`), so every rank runs the
same number of micro-batches per part, as ZeRO-2/3 need.

pi_prox of a mini-batch after the first cannot be recomputed: the weights that started the step are gone.
Each part takes it as the synchronous step does (`proximal_source`), judged on the part's own tokens: one
whose every token the starting weights sampled (tail's rounds are on-policy) takes the behaviour log-probs,
an older one is interpolated with `trainer.proximal=loglinear`; one that needs a recomputing forward is
refused.
"""
from __future__ import annotations

from collections import defaultdict

from rlsys.trainer.backend import TrainerBackend, proximal_source
from rlsys.trainer.batching import StepTotals, TrainSample, sampled_by
from rlsys.trainer.losses import LOSS_STATS, REJECTED_SHARE, STEP_NORMALISER, aggregation_of


class StreamedGradients:
    """One rank's streamed step: `accumulate` any number of parts, `close` each mini-batch but the last, then
    `finish` once. `version`: the policy version of the weights that started the step (None: not known)."""

    def __init__(self, backend: TrainerBackend, version: int | None = None):
        cfg = backend.cfg
        self.backend, self.version = backend, version
        self.normaliser = STEP_NORMALISER[aggregation_of(cfg)]
        self.closed: list[dict] = []  # the metrics of each mini-batch updated so far
        self._open()

    def _open(self) -> None:
        self.stats: dict[str, float] = defaultdict(float)
        self.tokens = self.sequences = 0  # this rank's share of the open mini-batch

    def accumulate(self, samples: list[TrainSample], micro_batches: int) -> None:
        """Add this rank's samples of one part; `micro_batches` is the part's count, the same on every rank."""
        if micro_batches == 0:
            return
        cfg, first = self.backend.cfg, not self.closed
        interpolate_at = None
        if cfg.mini_batches > 1:  # pi_prox as train_mini_batches takes it, without a recomputing forward
            fresh = sampled_by(samples, self.version)
            source = proximal_source(cfg, fresh, self.version)
            for sample in samples:  # None: this forward's
                sample.proximal_logprobs = list(sample.logprobs) if source == "behaviour" else None
            if not first and source == "recompute":
                why, fix = ((f"is corrected by {cfg.mismatch.describe()} against the trainer's own pi_old",
                             "use trainer.mini_batches=1") if fresh else
                            (f"has tokens not sampled by version {self.version}", "set trainer.proximal=loglinear"))
                raise ValueError(f"trainer.streamed with trainer.mini_batches={cfg.mini_batches}: mini-batch "
                                 f"{len(self.closed) + 1} {why}, and its pi_prox cannot be recomputed on weights "
                                 f"that already moved: {fix}")
            if not first and source == "loglinear":
                interpolate_at = self.version
        unnormalised = StepTotals(tokens=1, sequences=1, micro_batches=micro_batches)
        part = self.backend.accumulate_gradients(samples, unnormalised, closes_step=False,
                                                 interpolate_at=interpolate_at, at_start=first)
        for k, v in part.items():
            self.stats[k] += v
        self.tokens += sum(s.trained_tokens for s in samples)
        self.sequences += len(samples)

    def close(self, tokens: int, sequences: int) -> None:
        """The open mini-batch's optimizer update; `tokens` and `sequences` are its totals over every rank.
        No update where it has no token on any rank (no rank ran a micro-batch), as the synchronous split has
        no mini-batch without samples."""
        if tokens:
            count = {"tokens": tokens, "sequences": sequences, "constant": 1}[self.normaliser]
            # Accumulated over totals of 1: to the shares a synchronous step's statistics are, then (with mismatch
            # rejection) the loss and the gradient over the share kept, as there.
            share_of = {k: count for k in LOSS_STATS} | {REJECTED_SHARE["sequences"]: sequences}
            stats, kept = self.backend.divide_by_kept({k: v / share_of.get(k, tokens) for k, v in self.stats.items()})
            divisor = count * (kept or 1.0)
            self.closed.append(self.backend.close_step(stats, self.tokens, self.sequences, divisor=divisor))
        self._open()

    def finish(self, tokens: int, sequences: int) -> dict:
        """The last mini-batch's update (`close`). Returns what `TrainerBackend.train_mini_batches` returns,
        this rank's shares of the step's values; a step with no token at all is skipped."""
        self.close(tokens, sequences)
        metrics = self.backend.merge_mini_batches(self.closed) if self.closed else self.backend.skip_step()
        return metrics | {"lr": self.backend.end_step()}
