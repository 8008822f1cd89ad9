#!/usr/bin/env bash
# Start the Ray head of an rlsys cluster on this node; then run `rlsys train CONFIG cluster.address=auto`
# here, or submit with launch/submit.py. The dashboard (which can run jobs) listens on 127.0.0.1 unless
# --dashboard-host says otherwise: reach it through an SSH tunnel rather than opening it to the network.
# Ray's own ports (--port, which the other nodes join, and the Ray client server on 10001 when ray[client]
# is installed) listen on the node's address whatever this script says: keep the cluster on a private network.
#
#   launch/ray_head.sh [--port 6379] [--dashboard-host 127.0.0.1] [--dashboard-port 8265]
#                      [--num-gpus N] [--num-cpus N] [--block] [--dry-run] [-- more `ray start` options]
set -euo pipefail
port=6379 dashboard_host=127.0.0.1 dashboard_port=8265 dry_run=0
extra=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --port) port="$2"; shift 2 ;;
    --dashboard-host) dashboard_host="$2"; shift 2 ;;
    --dashboard-port) dashboard_port="$2"; shift 2 ;;
    --num-gpus | --num-cpus) extra+=("$1=$2"); shift 2 ;;
    --block) extra+=(--block); shift ;;  # stay in the foreground (what srun needs)
    --dry-run) dry_run=1; shift ;;
    --) shift; extra+=("$@"); break ;;
    -h | --help) sed -n '/^[^#]/q;2,$p' "$0"; exit 0 ;;  # the header comment
    *) echo "ray_head.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
done
# No usage reporting: cluster nodes are often offline, and nothing should leave them unasked.
cmd=(ray start --head --port="$port" --dashboard-host="$dashboard_host" --dashboard-port="$dashboard_port"
     --disable-usage-stats ${extra[@]+"${extra[@]}"})
printf '%q ' "${cmd[@]}"; echo
if (( dry_run )); then exit 0; fi
exec "${cmd[@]}"
