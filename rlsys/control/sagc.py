"""`sagc`: straggler-aware group control (docs/design.md "SAGC"), a drift-plus-penalty choice of G.

Before each step: G_t = argmax V * U(G) - max(Q_t, 0) * p(G) over the sizes whose risk p(G) fits the
step's allowance delta - Q_t (the smallest size if none does). After it: Q_{t+1} = max(Q_t + S_t - delta,
-delta), S_t the step's realised straggler rate. Q is a virtual queue of straggler budget overspent so far
(Neely's drift-plus-penalty: as long as the smallest size keeps S under delta on average, Q stays bounded
and the long-run rate meets the budget); below zero it is one step's unspent budget, carried as credit.

Why the allowance: pure drift-plus-penalty starts with Q = 0, which ignores risk, so it takes the largest
size and learns the spread only by paying for it; over a short run, or after the lengths drift, that
overspends (measured: docs/emulation.md "SAGC against static group sizes"). With the allowance every
step is expected to stay within the budget, plus what the last step left unspent, so the sizer still
mixes two sizes to spend the budget, and the queue still corrects what the model gets wrong.

Risk model. A group straggles when its slowest sample exceeds kappa times its median. Taking each
sample's length/median ratio as an independent draw from one distribution F gives
p(G) = 1 - F(kappa)^G. Only F(kappa) matters, so the running empirical CDF is kept as two counts
(ratios seen, ratios above kappa), discounted by `decay` each step so the fit follows lengths that
drift during training, with a Beta prior (`prior_tail_share` over `prior_samples` pseudo-samples)
that carries the first steps. When the run changes its workload on purpose (a new cap on answers,
`rollout.max_new_tokens_stages`) the counts restart from the prior: the old spread says nothing of
the new one. Independence is the weak point: a group's samples share its median, so the model
overstates the risk (measured 4-6x at G 8-16 on the emulated runs). A calibration factor, the
discounted ratio of straggling groups seen to the risk the model gave them (one pseudo-group of
prior, so it starts at 1), scales p(G) to what is realised.

Utility: `informative`, the expected share of groups whose rewards are not all equal,
1 - p_s^G - (1 - p_s)^G with p_s the running share of rewards > 0.5; or `log`, log G.
Ties go to the larger size, so with no straggler risk the largest size is always chosen.

Defaults, against realistic spreads. Under the shared straggler definition (kappa 2, the one rollout/straggler_rate
logs) realistic groups straggle often: on cot_sum's emulated two-GPU runs (benchmarks/results/
emulated_budget_longcot_2gpu.json) sync's groups of 8 straggled at 0.60-0.70 a step and SAGC's groups of 4 at
0.41-0.46, a per-sample tail share near 0.13 (1 - 0.87^4 = 0.43, 1 - 0.87^8 = 0.67); the simulator's lognormal
RL lengths (configs/sim/sagc_7b_8k.yaml) straggle at 0.27 / 0.54 / 0.80 at G 4 / 8 / 16. A budget of 0.1 was
out of every size's reach there, so the sizer sat at its smallest size, paying and never moving. The default
budget, delta 0.5, is one G 4 meets on both and G 8 just misses: the sizer mixes 4 and 8 (more 8 the calmer the
lengths) and takes 16 when the tail thins. A tighter budget is for workloads whose tails are thinner
(sagc-tight). The prior tail share stays 0.02: raised to these spreads' 0.1, the calibration learns from the
prior-led risks of a run's first steps that the model overstates (25x after 40 calm steps), and that outlives a
restart of the spread (`workload_changed`).

Where it pays: the budget buys wall time only where a group's slowest sample holds back its training
(sorted, tail) or where the sample count follows G (constant_prompts). A sync step of constant samples
waits for the slowest of all its samples whatever G is (docs/performance.md "Where group size costs wall time").

Known limit: when even the smallest size overspends the budget, Q grows without bound, and once
the lengths calm down the smallest size is kept until Q drains at delta a step (measured on scripted
lengths: 200 steps with a 5% per-sample tail, where G4 straggles 19% of the time, at delta 0.05 left
Q at 24 and took 490 calm steps to return to the largest size).

The decision is taken when a step is observed (and at construction or restore), so `next_shape()`
only reads it: the shape changes at step boundaries only, costs O(|sizes|), and depends on nothing
but the observed history.
"""
from __future__ import annotations

import math
from bisect import bisect_right

from rlsys.control.sizing import GROUP_SIZERS, GroupSizer, StepShape
from rlsys.types import Group

CALIBRATION_PRIOR_GROUPS = 1.0  # the calibration's prior: one straggling group, exactly as the model predicted

UTILITIES = {
    "informative": lambda g, p_s: 1.0 - p_s ** g - (1.0 - p_s) ** g,
    "log": lambda g, p_s: math.log(g),
}


@GROUP_SIZERS.register("sagc")
class SAGCSizer(GroupSizer):
    def __init__(self, cfg):
        super().__init__(cfg)
        self.sagc = cfg.sagc
        self.sizes = sorted(cfg.sagc.sizes)
        self.queue = 0.0  # Q_t
        self.ratios = 0.0  # discounted count of observed length/median ratios
        self.over = 0.0  # ... of those above kappa
        self.rewards = 0.0  # discounted count of observed rewards
        self.successes = 0.0  # ... of those above 0.5
        self.realised = 0.0  # discounted count of straggling groups
        self.predicted = 0.0  # ... and the sum of the risks the model gave them
        self.steps = 0
        self.last_rate = 0.0  # S of the last observed step
        self.last: tuple[int, float] | None = None  # (G, predicted risk) of the last observed step
        self.by_size = {g: [0, 0, 0] for g in self.sizes}  # over the run, per size: steps, groups, straggling groups
        self._decide()

    # --- the model ------------------------------------------------------------------------
    def tail_share(self) -> float:
        """1 - F(kappa): the share of samples longer than kappa times their group's median."""
        prior = self.sagc.prior_samples
        if self.ratios + prior == 0:
            return self.sagc.prior_tail_share
        return (self.over + prior * self.sagc.prior_tail_share) / (self.ratios + prior)

    def success_rate(self) -> float:
        prior = self.sagc.prior_samples
        return (self.successes + prior * 0.5) / (self.rewards + prior) if self.rewards + prior else 0.5

    def model_risk(self, g: int) -> float:
        """The independence model's chance that a group of g samples holds a straggler."""
        return 1.0 - (1.0 - self.tail_share()) ** g

    def calibration(self) -> float:
        """Straggling groups seen over the model's risk for them: what scales the model to the realised rate."""
        return (self.realised + CALIBRATION_PRIOR_GROUPS) / (self.predicted + CALIBRATION_PRIOR_GROUPS)

    def risk(self, g: int) -> float:
        """p(G): the calibrated chance that a group of g samples holds a straggler."""
        return min(1.0, self.calibration() * self.model_risk(g))

    def _decide(self) -> None:
        utility, p_s = UTILITIES[self.sagc.utility], self.success_rate()
        allowance = self.sagc.delta - self.queue
        fitting = [g for g in self.sizes if self.risk(g) <= allowance] or self.sizes[:1]
        best = None
        for g in fitting:  # ascending, and `>=` below hands ties to the larger size
            risk = self.risk(g)
            score = self.sagc.v * utility(g, p_s) - max(self.queue, 0.0) * risk
            if best is None or score >= best[0]:
                best = (score, g, risk)
        _, g, self.chosen_risk = best
        p0, g0 = self.cfg.prompts_per_step, self.cfg.group_size
        prompts = max(1, round(p0 * g0 / g)) if self.sagc.prompt_rule == "constant_samples" else p0
        self.shape = StepShape(prompts, g)

    # --- the sizer interface ----------------------------------------------------------------
    def next_shape(self) -> StepShape:
        return self.shape

    def observe(self, groups: list[Group]) -> None:
        self.last = (self.shape.group_size, self.chosen_risk)
        kappa, decay = self.cfg.straggler_kappa, self.sagc.decay
        samples = successes = ratios = over = stragglers = predicted = 0
        for group in groups:  # one pass, one sort per group: this runs on every step's ~1000 samples
            samples += len(group.samples)
            successes += len([1 for s in group.samples if s.reward > 0.5])
            lengths = sorted([s.completion.num_tokens for s in group.samples])
            n = len(lengths)
            if n < 2:
                continue
            median = lengths[n // 2] if n % 2 else (lengths[n // 2 - 1] + lengths[n // 2]) / 2
            group_over = n - bisect_right(lengths, kappa * max(median, 1))
            ratios, over = ratios + n, over + group_over
            stragglers += group_over > 0  # exactly metrics.is_straggler
            tally = self.by_size.setdefault(n, [0, 0, 0])  # by the size trained: sorted reads G once a round
            tally[1], tally[2] = tally[1] + 1, tally[2] + (group_over > 0)
            predicted += self.model_risk(n)  # the counts it reads change after the loop
        self.realised, self.predicted = self.realised * decay + stragglers, self.predicted * decay + predicted
        self.ratios, self.over = self.ratios * decay + ratios, self.over * decay + over
        self.rewards, self.successes = self.rewards * decay + samples, self.successes * decay + successes
        self.last_rate = stragglers / len(groups) if groups else 0.0
        self.by_size.setdefault(len(groups[0].samples) if groups else self.shape.group_size, [0, 0, 0])[0] += 1
        self.queue = max(self.queue + self.last_rate - self.sagc.delta, -self.sagc.delta)
        self.steps += 1
        self._decide()

    def workload_changed(self) -> None:
        self.ratios = self.over = 0.0
        self._decide()

    def metrics(self) -> dict[str, float]:
        """For the step just observed (the log line's step), plus the size chosen for the next one."""
        g, risk = self.last or (self.shape.group_size, self.chosen_risk)
        return {"group_size": g, "sagc/risk": risk, "sagc/queue": self.queue,
                "sagc/straggler_rate": self.last_rate, "sagc/tail_share": self.tail_share(),
                "sagc/calibration": self.calibration(),
                "sagc/success_rate": self.success_rate(), "sagc/next_group_size": self.shape.group_size,
                **self.per_size()}

    def per_size(self) -> dict[str, float]:
        """Over the run so far: each size's share of the steps, and the straggler rate realised at it."""
        steps = sum(t[0] for t in self.by_size.values())
        out = {f"sagc/share_g{g}": (t[0] / steps if steps else 0.0) for g, t in self.by_size.items()}
        out.update({f"sagc/straggler_rate_g{g}": t[2] / t[1] for g, t in self.by_size.items() if t[1]})
        return out

    def state_dict(self) -> dict:
        return {"queue": self.queue, "ratios": self.ratios, "over": self.over, "rewards": self.rewards,
                "successes": self.successes, "realised": self.realised, "predicted": self.predicted,
                "steps": self.steps, "last_rate": self.last_rate,
                "last": list(self.last) if self.last else None,
                "by_size": [[g, *t] for g, t in self.by_size.items()]}

    def load_state_dict(self, state: dict) -> None:
        self.queue, self.ratios, self.over = state["queue"], state["ratios"], state["over"]
        self.rewards, self.successes, self.steps = state["rewards"], state["successes"], state["steps"]
        # A checkpoint from before calibration starts it at its prior
        self.realised, self.predicted = state.get("realised", 0.0), state.get("predicted", 0.0)
        self.last_rate = state["last_rate"]
        self.last = tuple(state["last"]) if state["last"] else None
        if "by_size" in state:  # checkpoints from before it have none
            self.by_size = {g: list(t) for g, *t in state["by_size"]}
        self._decide()
