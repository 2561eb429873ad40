#!/usr/bin/env bash
# Start workers for every hardware type of the cluster: one Slurm job per (partition, constraint) pair.
# Edit the table below to match your cluster: partition, feature constraint ("" for none), autofit's
# hardware name (a preset, or "auto" to detect), nodes, GPUs per node.
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
: "${AUTOFIT_STORAGE:?set AUTOFIT_STORAGE to the PostgreSQL URL the workers share}"

while read -r partition constraint hardware nodes gpus; do
    [[ -z "$partition" || "$partition" == \#* ]] && continue
    args=(--partition="$partition" --nodes="$nodes" --gres="gpu:$gpus" --export="ALL,AUTOFIT_HARDWARE=$hardware")
    [[ "$constraint" != "-" ]] && args+=(--constraint="$constraint")
    sbatch "${args[@]}" "$HERE/workers.sbatch"
done <<'TABLE'
# partition  constraint  hardware   nodes  gpus
h100         h100_80gb   h100-80gb  2      8
h200         -           h200       1      8
a100         a100_40gb   a100-40gb  1      8
l4           -           l4         4      1
TABLE
