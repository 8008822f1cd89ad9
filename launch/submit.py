#!/usr/bin/env python3
"""Submit `rlsys train CONFIG [key=value ...]` to a running Ray cluster as a Ray job (`ray job submit`).

    python launch/submit.py CONFIG [key=value ...] [--address http://127.0.0.1:8265] [--resume] [--no-wait] [--dry-run]

The config and overrides are checked here first, as `rlsys check` does (its user code imported, its GPU
plan printed), so a typo fails before anything is queued. Run it from your project's folder: that folder
is uploaded as the job's working directory (without runs/ and .git/), so the config and the paths in it
resolve there as they do here, from the working directory. rlsys and its dependencies must already be
installed on every node. The job joins the cluster it runs in
(cluster.address=auto unless given). The address is the head's dashboard, 127.0.0.1 by default:
from another machine, tunnel to it (ssh -L 8265:127.0.0.1:8265 HEAD) rather than exposing it.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RUNTIME_ENV = {"working_dir": ".", "excludes": ["runs/", ".git/"]}


def build_command(config: str, overrides: list[str], address: str, wait: bool, resume: bool = False) -> list[str]:
    if not any(o.startswith("cluster.address=") for o in overrides):
        overrides = overrides + ["cluster.address=auto"]
    entrypoint = ["rlsys", "train", config, *overrides, *(["--resume"] if resume else [])]
    return ["ray", "job", "submit", "--address", address, "--runtime-env-json", json.dumps(RUNTIME_ENV),
            *([] if wait else ["--no-wait"]), "--", *entrypoint]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="launch/submit.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config", help="a run config, relative to the working directory (which is uploaded)")
    parser.add_argument("overrides", nargs="*", metavar="key=value")
    parser.add_argument("--address", default=os.environ.get("RAY_ADDRESS", "http://127.0.0.1:8265"),
                        help="the Ray dashboard of the head (default $RAY_ADDRESS or http://127.0.0.1:8265)")
    parser.add_argument("--resume", action="store_true", help="continue the run in output_dir from its last checkpoint")
    parser.add_argument("--no-wait", action="store_true", help="return once submitted, without following the logs")
    parser.add_argument("--dry-run", action="store_true", help="check and print the plan and the command; submit nothing")
    args = parser.parse_args(argv)

    sys.path.insert(0, str(ROOT))  # rlsys itself, when run from a checkout without installing it
    from rlsys.config import ConfigError
    from rlsys.startup import check_report, load_config

    if Path(os.path.normpath(args.config)).parts[:1] == ("..",):  # an absolute path is taken as one every node sees
        print(f"submit.py: config {args.config} lies outside the working directory {Path.cwd()}, the folder the job "
              "receives: run submit.py from a folder that holds it", file=sys.stderr)
        return 2
    try:
        print(check_report(load_config(args.config, args.overrides)))
    except ConfigError as e:
        print(f"submit.py: {e}", file=sys.stderr)
        return 2
    cmd = build_command(args.config, args.overrides, args.address, wait=not args.no_wait, resume=args.resume)
    print(shlex.join(cmd), flush=True)
    if args.dry_run:
        return 0
    return subprocess.call(cmd)


if __name__ == "__main__":
    sys.exit(main())
