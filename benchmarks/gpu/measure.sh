#!/usr/bin/env bash
# The GPU measurements of a lent GPU, phase by phase, each under its own time limit, each writing its log and
# results into OUT_DIR as it ends (the runs' records in records.tgz), so a run cut off keeps what it measured:
#   prepare    the bench model and its warm start, into the model cache the runs below read
#   smoke      benchmarks/gpu/run.sh with configs/gpu/smoke.yaml: install, train, publish, checkpoint
#   engine     the built-in engine's decode and prefill cost at the 0.5B bench model's size, beside rlsys.costs
#   engine_eager  the same with the eager decode step, on a subset of the grid
#   engine_sdpa   the same with the graph step's attention on SDPA (the default before split-KV), on a subset
#   live       the engine's decode step alone, behind its worker thread, in a Ray actor, beside a CUDA peer
#   publish_cuda_ipc, publish_object_store   a short 0.5B run per transport one GPU can run: weight sync time
#   cuda_tests tests/test_engine_cuda.py on the GPU
#   diagnose   a short sync run at 0.5B publishing by object store, its engine steps profiled (RLSYS_PROFILE_ENGINE)
#   bench      sync, tail, async and sorted by `rlsys bench` in one process, same workload and seed as the sched
#              phases; its report (bench.json) rewritten after each run
#   schedulers sync, then tail, on the 0.5B model's untrained (long, geometric) answers, same seed and steps
#              (sched_sync and sched_tail: each alone)
#
#   benchmarks/gpu/measure.sh BUNDLE_DIR OUT_DIR PHASE[:SECONDS] ...
#
# One lent GPU window is 15 minutes of device time, the machine's start included, in commands of at most 10
# minutes; results come back when a command ends. The plan for a window, two commands:
#   benchmarks/gpu/measure.sh build/gpu_bundle "$OUT" cuda_tests:40 engine:150 engine_sdpa:80
#   benchmarks/gpu/measure.sh build/gpu_bundle "$OUT" prepare:220 sched_sync:160 sched_tail:160
# A command's limits may add up to MEASURE_BUDGET_S (default 540: a 10-minute command less the set-up and the
# records); more is refused before anything runs. The bundle's rlsys must be this checkout's (RLSYS_SHA256).
# MEASURE_OVERRIDES: overrides added to every run's (a CPU rehearsal's: benchmarks/gpu/rehearse_measure.sh).
set -uo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
[ $# -ge 3 ] || { echo "usage: benchmarks/gpu/measure.sh BUNDLE_DIR OUT_DIR PHASE[:SECONDS] ..." >&2; exit 2; }
bundle=$(cd "$1" && pwd)
out=$(realpath -m "$2")
shift 2
# run.sh into $work/NAME with these overrides (it prints its summary.json into the phase's log)
train() {
  local name=$1 config=$2; shift 2
  CONFIG=$config bash "$repo/benchmarks/gpu/run.sh" "$bundle" "$work/$name" "$@" ${extra[@]+"${extra[@]}"}
}

phase_smoke() { train smoke "$repo/configs/gpu/smoke.yaml"; }

phase_engine() {
  PYTHONPATH=$SCRATCH/site:$repo "$python" "$repo/benchmarks/engine_throughput.py" --device cuda \
    --config "$bench" --vocab 259 --gpu "$gpu" --sweep 1,8,32,64,128,256 --lengths 128,1024,4096 \
    --repeats 3 --out "$out/engine_decode.json"
}

phase_engine_eager() {  # the eager step on a subset of the same grid, for the graph step's gain in one window
  PYTHONPATH=$SCRATCH/site:$repo "$python" "$repo/benchmarks/engine_throughput.py" --device cuda \
    --config "$bench" --vocab 259 --gpu "$gpu" --sweep 1,64,256 --lengths 128,1024,4096 --prefill 1x1024 \
    --repeats 2 --decode eager --out "$out/engine_decode_eager.json"
}

phase_engine_sdpa() {  # the graph step over SDPA on a subset of the grid, for split-KV's gain in one window
  PYTHONPATH=$SCRATCH/site:$repo "$python" "$repo/benchmarks/engine_throughput.py" --device cuda \
    --config "$bench" --vocab 259 --gpu "$gpu" --sweep 1,8,32,64 --lengths 128,1024,4096 --prefill 1x1024 \
    --repeats 2 --attention sdpa --out "$out/engine_decode_sdpa.json"
}

phase_live() {  # the KV cache a bench_0.5b run gives the engine: 128 prompt + 4096 response positions per slot
  PYTHONPATH=$SCRATCH/site:$repo "$python" "$repo/benchmarks/gpu/live_engine.py" --config "$bench" \
    --max-len 4224 --out "$out/live_engine.json"
}

phase_live_smi() {  # the same, while nvidia-smi samples memory as run.sh does
  nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 500 > /dev/null &
  local sampler=$!
  PYTHONPATH=$SCRATCH/site:$repo "$python" "$repo/benchmarks/gpu/live_engine.py" --config "$bench" \
    --out "$out/live_engine_smi.json"
  kill $sampler
}

short_0_5b=(trainer.total_steps=3 rollout.max_new_tokens=128 control.prompts_per_step=8 control.group_size=8)
phase_cuda_tests() {
  PYTHONPATH=$SCRATCH/site:$repo "$python" -m pytest -q -p no:cacheprovider "$repo/tests/test_engine_cuda.py"
}

phase_diagnose() {  # the profiles land in the run's folder, so in records.tgz
  RLSYS_PROFILE_ENGINE=$work/diagnose/profile GPU_MEMORY_MS=0 train diagnose "$bench" trainer.total_steps=2 \
    rollout.max_new_tokens=256 control.prompts_per_step=8 control.group_size=8 data.eval_size=2 \
    weights.transfer=object_store
}

phase_publish_cuda_ipc() { train publish_cuda_ipc "$bench" "${short_0_5b[@]}" weights.transfer=cuda_ipc; }
phase_publish_object_store() { train publish_object_store "$bench" "${short_0_5b[@]}" weights.transfer=object_store; }

sched=(trainer.total_steps=3 rollout.max_new_tokens=512 control.prompts_per_step=8 control.group_size=8 data.eval_size=4)
# sync, then tail, same seed and steps, after `prepare`: the 0.47B model's warm start (200 steps, 130 s on an
# H200 on 2026-11-28) built once into the model cache the runs read, in the same command (a new machine has none)
phase_prepare() {
  cd "$work" && PYTHONPATH=$SCRATCH/site "$python" -c 'import sys
from rlsys.models import prepare_model
from rlsys.startup import load_config
print(prepare_model(load_config(sys.argv[1], sys.argv[2:])))' "$bench" "${sched[@]}" logging.progress=true \
    ${extra[@]+"${extra[@]}"}
}
# sync unprofiled, as tail (the diagnose phase profiles): the profiled 2026-11-26 sync run was not comparable
phase_sched_sync() { GPU_MEMORY_MS=0 train sched_sync "$bench" "${sched[@]}" control.scheduler=sync; }
phase_sched_tail() { GPU_MEMORY_MS=0 train sched_tail "$bench" "${sched[@]}" control.scheduler=tail; }
phase_schedulers() { phase_sched_sync; phase_sched_tail; }

# from $work, with the bundle's rlsys (as run.sh runs it), not the checkout's; every schedule with its engine awake
# beside the trainer (async generates while it trains, so cannot sleep it), one layout for all four
phase_bench() {
  cd "$work" && PYTHONPATH=$SCRATCH/site PATH=$SCRATCH/site/bin:$PATH "$python" -m rlsys.cli bench "$bench" \
    "${sched[@]}" rollout.enable_sleep_mode=false --presets sync,tail,async,sorted --repeats 1 \
    --out-dir "$work/bench" --output "$out/bench.json"
}

# The processes a phase started carry its token in their environment, Ray's daemons too (they inherit it, and
# keep it when their parent is gone): those, and only those, end with the phase; never another Ray here.
phase_processes() {
  local pid
  for pid in $(pgrep -u "$(id -u)" .); do
    { tr '\0' '\n' < "/proc/$pid/environ"; } 2> /dev/null | grep -qxF "RLSYS_MEASURE_PHASE=$1" && echo "$pid"
  done
}

# checked before anything runs: every phase known, the limits within one command, the bundle this checkout's
budget=${MEASURE_BUDGET_S:-540}
total=0
for item in "$@"; do
  name=${item%%:*}; limit=${item#*:}; [ "$limit" = "$item" ] && limit=300
  declare -F "phase_$name" > /dev/null || { echo "measure.sh: unknown phase $name" >&2; exit 2; }
  total=$((total + limit))
done
[ "$total" -le "$budget" ] || { echo "measure.sh: the phases' limits add up to $total s, over MEASURE_BUDGET_S=$budget s (one lent command is at most 600 s): split them into two commands" >&2; exit 2; }
digest=$(cd "$repo" && find rlsys -type f ! -path '*/__pycache__/*' | LC_ALL=C sort | xargs sha256sum | sha256sum | cut -d' ' -f1)
[ "$(cat "$bundle/RLSYS_SHA256" 2>/dev/null)" = "$digest" ] || { echo "measure.sh: the bundle's rlsys ($bundle/RLSYS_SHA256: $(cat "$bundle/RLSYS_SHA256" 2>/dev/null || echo missing)) is not this checkout's ($digest): rebuild it with build_bundle.py" >&2; exit 2; }

mkdir -p "$out"
python=$(realpath -s "$(command -v "${PYTHON:-python3}")")  # absolute: some phases run from $work
export PYTHONUNBUFFERED=1 SCRATCH=${SCRATCH:-/tmp/rlsys-gpu-scratch}
work=$(mktemp -d -t rlsys-measure-XXXXXX)
bench=$repo/configs/gpu/bench_0.5b.yaml
gpu=$("$python" -c 'import torch; n = torch.cuda.get_device_name(0).lower(); print(next((g for g in ("h200", "h100", "h800", "h20") if g in n), "h100"))' 2> /dev/null || echo none)
read -r -a extra <<< "${MEASURE_OVERRIDES:-}"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$out/machine.txt" 2>&1
"$python" -c 'import torch, platform; print("torch", torch.__version__, "cuda", torch.version.cuda, "python", platform.python_version())' >> "$out/machine.txt"

# the bundle once, for the phases that import rlsys from the checkout (run.sh installs it again, the same)
[ -d "$SCRATCH/site" ] || "$python" -m pip install --quiet --no-index --no-deps --target "$SCRATCH/site" "$bundle"/*.whl

for item in "$@"; do
  name=${item%%:*}; limit=${item#*:}; [ "$limit" = "$item" ] && limit=300
  echo "== $name (at most $limit s)"
  start=$SECONDS
  token=$$-$name-$RANDOM
  # a subshell under timeout, marked with the phase's token
  RLSYS_MEASURE_PHASE=$token timeout --kill-after=10 "$limit" bash -c "$(declare -f train phase_sched_sync phase_sched_tail "phase_$name"); $(declare -p repo bundle out python work bench gpu short_0_5b sched extra); phase_$name" \
    > "$out/$name.log" 2>&1
  status=$?
  echo "$name: exit $status after $((SECONDS - start)) s" | tee -a "$out/phases.txt"
  phase_processes "$token" | xargs -r kill -9 2> /dev/null  # what the phase left behind (one cut at its limit)
  tail -5 "$out/$name.log"
  # every run's summary and records so far, weights left out: one file (few files come back from a lent GPU)
  tar -czf "$out/records.tgz" -C "$work" --exclude='*.safetensors' --exclude='*.pt' --exclude='*.bin' . 2>/dev/null
done
