#!/usr/bin/env bash
# The GPU smoke test in one command, on a host with Python, PyTorch and transformers but no internet:
# installs the wheels of build_bundle.py into a scratch folder, checks the imports, trains
# configs/gpu/smoke.yaml (overrides pass through) and writes the run, the GPU memory log and summary.json
# into RESULTS_DIR.
#
#   benchmarks/gpu/run.sh BUNDLE_DIR RESULTS_DIR [key=value ...]
#   benchmarks/gpu/run.sh build/gpu_bundle results/smoke trainer.total_steps=10
#   CONFIG=configs/gpu/bench_0.5b.yaml benchmarks/gpu/run.sh build/gpu_bundle results/bench
#
# Environment: PYTHON (default python3), SCRATCH (default a new temporary folder: the installed wheels),
# CONFIG, GPU_MEMORY_MS (nvidia-smi's sampling interval, default 500; 0: no sampling).
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
usage="usage: benchmarks/gpu/run.sh BUNDLE_DIR RESULTS_DIR [key=value ...]"
[ $# -ge 2 ] || { echo "$usage" >&2; exit 2; }
case $2 in *=*) echo "run.sh: RESULTS_DIR is missing (got the override $2); $usage" >&2; exit 2 ;; esac
bundle=$(cd "$1" && pwd)
results=$(realpath -m "$2")
shift 2
python=$(realpath -s "$(command -v "${PYTHON:-python3}")")  # absolute: it runs from $scratch
config=$(realpath "${CONFIG:-$repo/configs/gpu/smoke.yaml}")
scratch=${SCRATCH:-$(mktemp -d -t rlsys-gpu-XXXXXX)}
run_dir=$results/run
overrides=("output_dir=$run_dir")
for item in "$@"; do  # a later output_dir= wins, as in rlsys; made absolute, as rlsys runs in $scratch
  case $item in output_dir=*) run_dir=$(realpath -m "${item#output_dir=}"); item=output_dir=$run_dir ;; esac
  overrides+=("$item")
done

shopt -s nullglob
wheels=("$bundle"/*.whl)
[ ${#wheels[@]} -gt 0 ] || { echo "run.sh: no wheels in $bundle (build them with build_bundle.py)" >&2; exit 2; }
[ -f "$bundle/SHA256SUMS" ] || { echo "run.sh: $bundle/SHA256SUMS is missing (build_bundle.py writes it)" >&2; exit 2; }
(cd "$bundle" && sha256sum --check --quiet SHA256SUMS) \
  || { echo "run.sh: wheels in $bundle do not match their SHA256SUMS (a broken copy?)" >&2; exit 2; }
mkdir -p "$scratch" "$results"
scratch=$(cd "$scratch" && pwd)
echo "installing ${#wheels[@]} wheels into $scratch/site"
"$python" -m pip install --quiet --no-index --no-deps --upgrade --target "$scratch/site" "${wheels[@]}"
# The bundle first: its pydantic must win over any older one on the host. Ray's workers inherit it.
export PYTHONPATH=$scratch/site${PYTHONPATH:+:$PYTHONPATH}
export PATH=$scratch/site/bin:$PATH  # ray's and ninja's commands
cd "$scratch"  # not the checkout: rlsys is imported from its wheel, here and in every actor

"$python" - <<'EOF'
import importlib
for name in ("torch", "transformers", "ray", "deepspeed", "pydantic", "math_verify", "rlsys.train"):
    module = importlib.import_module(name)
    top = importlib.import_module(name.split(".")[0])
    print(f"  {name:12} {getattr(top, '__version__', ''):14} {module.__file__}")
import torch
print(f"  CUDA: {torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'not available'}")
EOF

memory_log=$results/gpu_memory_mib.csv
sampler=
if [ "${GPU_MEMORY_MS:-500}" != 0 ] && command -v nvidia-smi > /dev/null; then  # the whole GPU: engine and trainer are other processes
  nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms "${GPU_MEMORY_MS:-500}" > "$memory_log" &
  sampler=$!
fi
status=0
start=$SECONDS
"$python" -m rlsys.cli train "$config" "${overrides[@]}" || status=$?
[ -z "$sampler" ] || kill "$sampler"
"$python" "$repo/benchmarks/gpu/summarize.py" "$run_dir" --gpu-memory-log "$memory_log" \
  --wall-s $((SECONDS - start)) > "$results/summary.json" || true
cat "$results/summary.json"
echo "run folder: $run_dir"
echo "summary:    $results/summary.json (bring it back; the run folder has metrics.jsonl and timeline.jsonl)"
exit $status
