#!/usr/bin/env bash
# Seed 001's launch script: TiSASRec+mHC under DDP on every GPU of this node (NUM_GPUS=N for N; BATCH_SIZE=B
# for a global batch of B), through the trainer. Extra arguments go to the trainer.
#   ./train_distributed.sh ml-1m tisasrec_dist
#   NUM_GPUS=2 BATCH_SIZE=256 ./train_distributed.sh ml-1m tisasrec_2gpu
set -euo pipefail
# shellcheck source=scripts/seed_common.sh
source "$(dirname "${BASH_SOURCE[0]}")/scripts/seed_common.sh"
if [[ $# -lt 2 ]]; then
    echo "usage: $0 DATASET TRAIN_DIR [trainer arguments...]   (e.g. $0 ml-1m tisasrec_dist)" >&2
    exit 2
fi
dataset="$1" train_dir="$2"
shift 2
config="$(seed_config tisasrec "$dataset")"
args=(train --config "$config" model.mhc=true --run-dir "runs/$train_dir")
if [[ -n "${BATCH_SIZE:-}" ]]; then args+=(--global-batch-size "$BATCH_SIZE"); fi
seed_run "$(basename "$0")" "${NUM_GPUS:-$(seed_gpus)}" "${args[@]}" "$@"
