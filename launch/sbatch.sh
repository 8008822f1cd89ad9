#!/usr/bin/env bash
# Check the config as `rlsys check` does (on the cluster this job asks for: --nodes, --gpus-per-node; its
# GPU plan printed to stderr), then fill in launch/slurm.sbatch and submit it with sbatch; --dry-run prints the
# filled-in script and the sbatch command instead. Overrides after the options go to `rlsys train`. Paths
# (--config, those in the config) are relative to the working directory, where the job runs too.
#
#   launch/sbatch.sh --config CONFIG [--nodes 1] [--gpus-per-node 8] [--cpus-per-node 64]
#                    [--time 24:00:00] [--partition NAME] [--job-name rlsys] [--dry-run] [key=value ...]
set -euo pipefail
shopt -u patsub_replacement 2>/dev/null || true  # "&" in a value stays "&"
here=$(cd "$(dirname "$0")" && pwd)  # launch/: the job starts Ray with the scripts beside this one
config="" nodes=1 gpus=8 cpus=64 time=24:00:00 partition="" job=rlsys dry_run=0
overrides=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --config) config="$2"; shift 2 ;;
    --nodes) nodes="$2"; shift 2 ;;
    --gpus-per-node) gpus="$2"; shift 2 ;;
    --cpus-per-node) cpus="$2"; shift 2 ;;
    --time) time="$2"; shift 2 ;;
    --partition) partition="$2"; shift 2 ;;
    --job-name) job="$2"; shift 2 ;;
    --dry-run) dry_run=1; shift ;;
    -h | --help) sed -n '/^[^#]/q;2,$p' "$0"; exit 0 ;;  # the header comment
    -*) echo "sbatch.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
    *) overrides+=("$1"); shift ;;
  esac
done
if [[ -z "$config" ]]; then echo "sbatch.sh: --config CONFIG is required (e.g. configs/qwen2.5_7b_dapo_64gpu.yaml)" >&2; exit 2; fi
for n in "$nodes" "$gpus" "$cpus"; do
  [[ "$n" =~ ^[1-9][0-9]*$ ]] || { echo "sbatch.sh: --nodes, --gpus-per-node and --cpus-per-node take positive integers (got $n)" >&2; exit 2; }
done
command -v rlsys >/dev/null || { echo "sbatch.sh: rlsys is not on PATH: activate the environment it is installed in (the job runs it too)" >&2; exit 2; }
# as the job will run it: its cluster first, then the overrides, which win
rlsys check "$config" cluster.nodes="$nodes" cluster.gpus_per_node="$gpus" ${overrides[@]+"${overrides[@]}"} >&2 \
  || { echo "sbatch.sh: nothing submitted" >&2; exit 2; }
quoted=""
if (( ${#overrides[@]} )); then quoted=$(printf '%q ' "${overrides[@]}"); fi
partition_line=""
if [[ -n "$partition" ]]; then partition_line="#SBATCH --partition=$partition"; fi

text=$(<"$here/slurm.sbatch")
text=${text//@JOB_NAME@/$job}
text=${text//@NODES@/$nodes}
text=${text//@GPUS_PER_NODE@/$gpus}
text=${text//@CPUS_PER_NODE@/$cpus}
text=${text//@TIME@/$time}
text=${text//@LAUNCH_DIR@/$(printf '%q' "$here")}
text=${text//@PARTITION_LINE@/$partition_line}
text=${text//@CONFIG@/$(printf '%q' "$config")}
text=${text//@OVERRIDES@/${quoted% }}

out="runs/slurm/$job-$(date +%Y%m%d-%H%M%S).sbatch"
if (( dry_run )); then
  printf '%s\n' "$text"
  echo "# would write $out and run: sbatch $out"
  exit 0
fi
mkdir -p runs/slurm
printf '%s\n' "$text" > "$out"
echo "wrote $out"
exec sbatch "$out"
