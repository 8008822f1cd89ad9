#!/usr/bin/env bash
# The offline GPU bundle rehearsed on a CPU machine, as the GPU host would run it: a fresh clone of this
# checkout's HEAD, a fresh venv with only the host's packages (torch, transformers 5.17, accelerate 1.15; no
# Ray, DeepSpeed or pydantic), the wheels build_bundle.py collects for that venv's Python, then run.sh with
# the CPU overrides configs/gpu/smoke.yaml lists. Writes the bundle's size, run.sh's output and its
# summary.json to RESULTS_JSON. About 10 minutes on 2 cores; needs the package index (the host does not).
#
#   PYTHON=python3 benchmarks/gpu/rehearse.sh [RESULTS_JSON]   (default benchmarks/results/gpu_rehearsal_cpu.json)
#
# PYTHON must have torch, pip and setuptools: it builds DeepSpeed's wheel. The venv's torch is the CPU
# 2.13.0 (torch 2.11, the host's, exists only as a CUDA build of several GB).
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
out=$(realpath -m "${1:-$repo/benchmarks/results/gpu_rehearsal_cpu.json}")
python=${PYTHON:-python3}
work=$(mktemp -d -t rlsys-rehearsal-XXXXXX)
trap 'rm -rf "$work"' EXIT
HOST_PINS=(torch==2.13.0 "transformers==5.17.*" accelerate==1.15.0)

git clone --quiet "$repo" "$work/clone"
clone=$work/clone
commit=$(git -C "$clone" rev-parse --short HEAD)
# The CPU overrides, from the one line of smoke.yaml that lists them.
read -r -a overrides < <(sed -n 's/^# On a machine without a GPU: //p' "$clone/configs/gpu/smoke.yaml")
[ ${#overrides[@]} -gt 0 ] || { echo "rehearse.sh: no CPU overrides line in configs/gpu/smoke.yaml" >&2; exit 2; }

echo "== host venv: ${HOST_PINS[*]}"
"$python" -m venv "$work/host"
"$work/host/bin/pip" install --quiet "${HOST_PINS[@]}"
# huggingface_hub's typer brings pydantic; the host has none, so the bundle's must be the one found.
"$work/host/bin/pip" uninstall --quiet --yes pydantic pydantic-core
host_python=$("$work/host/bin/python" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')

echo "== bundle for Python $host_python"
"$python" "$clone/benchmarks/gpu/build_bundle.py" --out "$work/bundle" --python-version "$host_python" \
  | tail -1

echo "== run.sh ${overrides[*]}"
status=0
start=$SECONDS
PYTHON=$work/host/bin/python SCRATCH=$work/scratch \
  bash "$clone/benchmarks/gpu/run.sh" "$work/bundle" "$work/results" "${overrides[@]}" 2>&1 \
  | tee "$work/run.log" || status=$?
wall=$((SECONDS - start))

mkdir -p "$(dirname "$out")"
"$work/host/bin/python" - "$work" "$out" "$commit" "$status" "$wall" "${overrides[*]}" <<'EOF'
import json, os, platform, sys
from pathlib import Path
work, out, commit, status, wall, overrides = sys.argv[1:]
work = Path(work)
wheels = sorted(work.glob("bundle/*.whl"))
summary = work / "results" / "summary.json"
lines = (work / "run.log").read_text().splitlines()
result = {
    "command": "PYTHON=python3 benchmarks/gpu/rehearse.sh",
    "machine": f"CPU only: {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}",
    "commit": commit, "overrides": overrides.split(), "exit_status": int(status), "run_sh_wall_s": int(wall),
    "bundle_wheels": len(wheels), "bundle_mib": round(sum(p.stat().st_size for p in wheels) / 2**20, 2),
    "summary": json.loads(summary.read_text()) if summary.is_file() else None,
    "output_tail": [line for line in lines[-60:] if "\r" not in line],  # no progress bars
}
# the stored record names no folder of this machine
text = json.dumps(result, indent=1).replace(str(work), "<work>").replace(str(Path.home()), "~")
Path(out).write_text(text + "\n")
print(f"rehearsal: exit {status}, bundle {result['bundle_mib']} MiB in {len(wheels)} wheels -> {out}")
EOF
exit $status
