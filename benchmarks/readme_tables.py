"""The result tables of README.md and docs/, rendered from benchmarks/results/.

Each table sits in a document between `<!-- table: NAME -->` and `<!-- /table -->`; the function registered as
`@table("NAME")` in benchmarks/doc_tables/ (one module per kind of measurement) renders it from its results file.
tests/test_readme.py fails when a document's table differs from its rendering, so a figure cannot drift from the
file it comes from. Figures quoted in prose are listed, per document, in `prose_figures`.

    python benchmarks/readme_tables.py           # exit 1 and name the stale tables
    python benchmarks/readme_tables.py --write   # rewrite them in place
"""
from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # doc_tables, when loaded by path (tests/test_readme.py)
from doc_tables import RESULTS, ROOT, TABLES, load  # noqa: E402,F401  (RESULTS: for the tests)
from doc_tables.cpu import (algorithms_round4_figures, async_profile_figures, async_profile_shares,  # noqa: E402
                            dg_net, lift_figures, loss_sweep_figures, tool_arith_figures, tool_guess_figures,
                            tool_guess_peaks, tool_guess_turns_figures)
from doc_tables.emulated import (BUDGET_REPLAYS, abort_landing_figures, best_on_budget,  # noqa: E402
                                 best_to_target_shortfall, budget_figures, budget_replay_figures,
                                 emulated_comparison_figures, emulated_sagc_figures, emulated_speeds,
                                 emulated_vs_sim_figures, four_gpu_figures, longcot32_budget_figures,
                                 longcot_budget_figures, old_tail, old_tail_vs_rollpacker, starting_model_figures)
from doc_tables.sim import sim_figures  # noqa: E402

DOCS = [ROOT / "README.md", *(ROOT / "docs" / f"{name}.md"
                              for name in ("performance", "emulation", "schedulers", "tools"))]
MARKED = re.compile(r"(<!-- table: ([\w-]+) -->\n)(.*?)(<!-- /table -->)", re.S)


def prose_figures() -> dict[str, list[str]]:
    """Figures quoted in prose, as each document must spell them: a changed file or a changed digit fails."""
    s, speed = load("bench_schedulers_cpu")["results"], load("bench_schedulers_cpu")["speedup_vs_sync"]
    load_cpu = load("controller_load_cpu")["results"]
    rate = [f"{r['events_per_s'] / 1000:.0f}k" for r in load_cpu.values()]
    bf16 = load("mismatch_bf16_cpu")["results"]["bf16-tis"]
    run = load("default_run_cpu")
    overlap = load("bench_async_cpu")["speedup_vs_sync"]
    sim = sim_figures()
    plain, fast = overlap["async"], overlap["async-loglinear"]
    eta2 = overlap["async-eta2"]["per_sample"]
    return {
        "README.md": [f"lifts the default task by {100 * (run['evals'][-1]['eval/accuracy'] - run['evals'][0]['eval/accuracy']):.0f} points",
                      f"load average {run['machine']['load_average_at_start']:.1f} at its start",
                      sim["readme_range"]],
        "docs/schedulers.md": [
            *(sim[k] for k in ("in_sample", "held_out", "one_out", "whole_groups", "selection", "range", "centre",
                               "runaway", "mfu", "lengths", "overhead", "unvalidated", "anchors")),
            *budget_figures(),
            starting_model_figures()[0],
            "streamed `tail` {streamed:.2f}x and `async` with eta 2 {eta2:.2f}x sooner".format(**emulated_speeds()),
            f"trained {fast['per_sample']:.2f}x faster per sample than `sync` and reached the "
            f"target {fast['time_to_target']:.2f}x sooner",
            f"recomputed it was {plain['per_sample']:.2f}x",
            f"is missed by {100 * (1 - fast['per_sample'] / 1.4):.0f}%",
            "the engine the train step runs {:.0f}% longer".format(*async_profile_shares()),
            "published, the next step launched), {:.0f}% of each step".format(async_profile_shares()[1]),
            f"wastes nothing ({fast['per_sample']:.2f}x per sample",
            f"{s['sorted']['bubble_ratio'] / s['sync']['bubble_ratio']:.2f}x sync's bubble",
            f"{s['tail']['bubble_ratio'] / s['sync']['bubble_ratio']:.2f}x sync's bubble",
            f"this CPU ({speed['sorted']['per_sample']:.2f}x to {speed['sagc']['per_sample']:.2f}x"],
        "docs/tools.md": [*tool_guess_figures(), *tool_guess_turns_figures()],
        "docs/algorithms.md": [f"mismatch KL of {bf16['mismatch_kl_mean']:.0e} per token"],
        "docs/design.md": algorithms_round4_figures(),
        "docs/emulation.md": [
            *emulated_vs_sim_figures(),
            *emulated_comparison_figures(),
            *(f for name in BUDGET_REPLAYS for f in budget_replay_figures(name)),
            *abort_landing_figures(),
            *starting_model_figures(),
            *longcot_budget_figures(),
            *best_on_budget("emulated_budget_old_2gpu"),
            *(f for gpus in (2, 4) for f in (old_tail(gpus), old_tail_vs_rollpacker(gpus))),
            *best_on_budget("emulated_budget_old_4gpu"), best_to_target_shortfall("emulated_budget_old_4gpu"),
            *four_gpu_figures(),
            *longcot32_budget_figures(),
            *emulated_sagc_figures()],
        "docs/performance.md": [
            *(v for k, v in sim.items() if k != "readme_range"),
            *loss_sweep_figures(),
            f"zero or upward in every draw ({dg_net('dg')}; PPO's {dg_net('ppo')})",
            *async_profile_figures(),
            *tool_arith_figures(),
            *tool_guess_figures(),
            tool_guess_peaks(),
            lift_figures("tool_guess_lift_cap200_cpu"),
            f"reaches the target {fast['time_to_target']:.2f}x sooner with final accuracy within the error, but is "
            f"{fast['per_sample']:.2f}x per sample, {100 * (1 - fast['per_sample'] / 1.4):.0f}% short",
            f"is {plain['per_sample']:.2f}x per sample, {100 * (1 - plain['per_sample'] / 1.4):.0f}% short, and "
            f"{plain['time_to_target']:.2f}x sooner; eta 2 adds nothing to eta 1 ({eta2:.2f}x)",
            f"stays near {bf16['mismatch_kl_mean']:.0e}",
            f"cuts the bubble to {s['sorted']['bubble_ratio'] / s['sync']['bubble_ratio']:.2f}x sync's",
            "Per sample it is {:.2f}x sync, with pairs from {:.2f}x to {:.2f}x".format(
                speed["tail"]["per_sample"], *speed["tail"]["per_sample_spread"]),
            f"Per sample it is {speed['sagc']['per_sample']:.2f}x sync: the larger group",
            f"straggler rates on this task stay near {s['sagc-tight']['straggler_rate']:.2f}",
            f"{min(rate, key=lambda x: int(x[:-1]))} to {max(rate, key=lambda x: int(x[:-1]))} completion events"],
    }


def render(text: str) -> str:
    """`text` with every marked table rendered from its results file."""
    def fill(m: re.Match) -> str:
        if m.group(2) not in TABLES:
            raise KeyError(f"table {m.group(2)!r} has no renderer in benchmarks/doc_tables/")
        return m.group(1) + "\n" + TABLES[m.group(2)]() + "\n" + m.group(4)
    return MARKED.sub(fill, text)


def marked_names(text: str) -> list[str]:
    return [m.group(2) for m in MARKED.finditer(text)]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--write", action="store_true", help="rewrite the stale tables in place")
    args = p.parse_args()
    stale = []
    for doc in DOCS:
        text = doc.read_text()
        if render(text) != text:
            stale.append(doc.relative_to(ROOT))
            if args.write:
                doc.write_text(render(text))
    verb = "rewrote" if args.write else "stale (run with --write)"
    for doc in stale:
        print(f"{verb}: {doc}")
    return 1 if stale and not args.write else 0


if __name__ == "__main__":
    sys.exit(main())
