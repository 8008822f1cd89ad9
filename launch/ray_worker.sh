#!/usr/bin/env bash
# Join this node to a running Ray head (started by launch/ray_head.sh) as a worker.
#
#   launch/ray_worker.sh --address HEAD_IP:6379 [--num-gpus N] [--num-cpus N] [--block] [--dry-run]
#                        [-- more `ray start` options]
set -euo pipefail
address="" dry_run=0
extra=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --address) address="$2"; shift 2 ;;
    --num-gpus | --num-cpus) extra+=("$1=$2"); shift 2 ;;
    --block) extra+=(--block); shift ;;  # stay in the foreground (what srun needs)
    --dry-run) dry_run=1; shift ;;
    --) shift; extra+=("$@"); break ;;
    -h | --help) sed -n '/^[^#]/q;2,$p' "$0"; exit 0 ;;  # the header comment
    *) echo "ray_worker.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
done
if [[ -z "$address" ]]; then
  echo "ray_worker.sh: --address HEAD_IP:PORT is required (the head's address, port 6379 by default)" >&2
  exit 2
fi
cmd=(ray start --address="$address" --disable-usage-stats ${extra[@]+"${extra[@]}"})
printf '%q ' "${cmd[@]}"; echo
if (( dry_run )); then exit 0; fi
exec "${cmd[@]}"
