"""A streamed train step: gradients of completed prompts accumulate while the round is still generating,
and one optimizer update at the end equals the synchronous step's (docs/design.md "Tail batching").

The losses divide by the step's token (or sequence) count, which is unknown until the round ends. So each
part is accumulated un-normalised (step totals of 1) and `finish` divides the summed gradients by the count
before clipping and stepping: the same gradient as the synchronous step up to float rounding. Statistics
are divided the same way. Each part is planned on its own (`plan_step`), so every rank runs the same number
of micro-batches per part, as ZeRO-2/3 need.
"""
from __future__ import annotations

from collections import defaultdict

from rlsys.trainer.backend import TrainerBackend
from rlsys.trainer.batching import StepTotals, TrainSample
from rlsys.trainer.losses import STEP_NORMALISER, aggregation_of

LOSS_STATS = ("loss", "pg_loss")  # aggregated by the loss's own mode; every other statistic is a token mean


class StreamedGradients:
    """One rank's streamed step: `accumulate` any number of parts, then `finish` once."""

    def __init__(self, backend: TrainerBackend):
        cfg = backend.cfg
        if cfg.mini_batches != 1:
            raise ValueError(f"trainer.streamed needs trainer.mini_batches=1 (got {cfg.mini_batches}): "
                             "a streamed step ends in exactly one optimizer update")
        self.backend = backend
        self.normaliser = STEP_NORMALISER[aggregation_of(cfg)]
        self.stats: dict[str, float] = defaultdict(float)
        self.tokens = self.sequences = 0  # this rank's share

    def accumulate(self, samples: list[TrainSample], micro_batches: int) -> None:
        """Add this rank's samples of one part; `micro_batches` is the part's count, the same on every rank."""
        if micro_batches == 0:
            return
        unnormalised = StepTotals(tokens=1, sequences=1, micro_batches=micro_batches)
        part = self.backend.accumulate_gradients(samples, unnormalised, closes_step=False)
        for k, v in part.items():
            self.stats[k] += v
        self.tokens += sum(s.trained_tokens for s in samples)
        self.sequences += len(samples)

    def finish(self, tokens: int, sequences: int) -> dict:
        """The one optimizer update; `tokens` and `sequences` are the step's totals over every rank.
        Returns what `TrainerBackend.train_step` returns, this rank's shares of the step's values."""
        if tokens == 0:  # nothing streamed anywhere, so no rank ran a micro-batch: nothing to step on
            return self.backend.skip_step()
        divisor = {"tokens": tokens, "sequences": sequences}[self.normaliser]
        stats = {k: v / (divisor if k in LOSS_STATS else tokens) for k, v in self.stats.items()}
        return self.backend.close_step(stats, self.tokens, self.sequences, divisor=float(divisor))
