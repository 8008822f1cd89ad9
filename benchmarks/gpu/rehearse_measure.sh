#!/usr/bin/env bash
# measure.sh's plan for a lent GPU window (its header), rehearsed on a CPU machine with PYTHON's packages: a
# bundle of rlsys's wheel alone (build_bundle.py --rlsys-only, with its digest), the same two commands, every
# run with the CPU overrides of configs/gpu/smoke.yaml and a tiny model in place of the 0.47B one. On the CPU
# cuda_tests skip and the engine grid fails at its start (no CUDA); what is rehearsed is the harness: the
# checks, the phases under their limits, each run's results kept as it ends, and what each phase costs here.
#
#   PYTHON=.venv/bin/python benchmarks/gpu/rehearse_measure.sh [RESULTS_JSON]
#   (default benchmarks/results/gpu_measure_rehearsal_cpu.json)
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
out=$(realpath -m "${1:-$repo/benchmarks/results/gpu_measure_rehearsal_cpu.json}")
python=${PYTHON:-python3}
work=$(mktemp -d -t rlsys-measure-rehearsal-XXXXXX)
trap 'rm -rf "$work"' EXIT

"$python" "$repo/benchmarks/gpu/build_bundle.py" --rlsys-only --out "$work/bundle" > "$work/build.log" 2>&1
cpu=$(sed -n 's/^# On a machine without a GPU: //p' "$repo/configs/gpu/smoke.yaml")
tiny="model.hidden_size=64 model.num_layers=2 model.num_heads=4 model.num_kv_heads=2 model.intermediate_size=128"
tiny+=" model.warm_start.steps=0 model.warm_start.device=cpu"  # one line: measure.sh reads one
# the two commands of measure.sh's header, as written there
mapfile -t plan < <(sed -n 's|^#   benchmarks/gpu/measure.sh build/gpu_bundle "$OUT" ||p' "$repo/benchmarks/gpu/measure.sh")
[ ${#plan[@]} -gt 0 ] || { echo "rehearse_measure.sh: no plan in measure.sh's header" >&2; exit 2; }
start=$SECONDS
for i in "${!plan[@]}"; do
  read -r -a phases <<< "${plan[$i]}"
  begin=$SECONDS
  MEASURE_OVERRIDES="$cpu $tiny" PYTHON=$python SCRATCH=$work/scratch \
    bash "$repo/benchmarks/gpu/measure.sh" "$work/bundle" "$work/out" "${phases[@]}" || true
  echo "command $((i + 1)): $((SECONDS - begin)) s" >> "$work/commands.txt"
done
wall=$((SECONDS - start))

"$python" - "$work" "$out" "$wall" "$(git -C "$repo" rev-parse --short HEAD 2> /dev/null || echo unknown)" \
  "$cpu $tiny" "${plan[@]}" <<'PY'
import json, os, platform, sys
from pathlib import Path
work, out, wall, commit, overrides, *plan = sys.argv[1:]
work = Path(work)
phases = {}
for line in (work / "out" / "phases.txt").read_text().splitlines():  # "NAME: exit N after S s"
    name, rest = line.split(": exit ")
    status, seconds = rest.split(" after ")
    phases[name] = {"exit": int(status), "seconds": int(seconds.split()[0])}
runs = {}
for name in ("sched_sync", "sched_tail"):
    log = (work / "out" / f"{name}.log").read_text()
    start = log.rfind('{\n "run_dir"')
    runs[name] = json.loads(log[start:log.index("\n}", start) + 2]) if start >= 0 else None
result = {
    "command": "PYTHON=.venv/bin/python benchmarks/gpu/rehearse_measure.sh",
    "machine": f"CPU only: {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}",
    "load_average_1m": round(os.getloadavg()[0], 2), "commit": commit, "overrides": overrides.split(),
    "plan": [c.split() for c in plan], "wall_s": int(wall),
    "commands_s": [int(line.split()[-2]) for line in (work / "commands.txt").read_text().splitlines()],
    "phases": phases, "runs": runs,
}
text = json.dumps(result, indent=1).replace(str(work), "<work>").replace(str(Path.home()), "~")
Path(out).write_text(text + "\n")
print(f"rehearsal: {wall} s, phases {phases} -> {out}")
PY
