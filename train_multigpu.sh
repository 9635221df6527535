#!/usr/bin/env bash
# Seed 003's launch script: the mouse-behaviour 3D CNN under DDP on N GPUs of this node, through the trainer.
# Extra arguments go to the trainer.
#   ./train_multigpu.sh 3
#   ./train_multigpu.sh "$(nvidia-smi -L | wc -l)" data.path=data/mouse
set -euo pipefail
# shellcheck source=scripts/seed_common.sh
source "$(dirname "${BASH_SOURCE[0]}")/scripts/seed_common.sh"
if [[ $# -lt 1 ]]; then
    echo "usage: $0 NUM_GPUS [trainer arguments...]   (e.g. $0 3)" >&2
    exit 2
fi
nproc="$1"
shift
seed_run "$(basename "$0")" "$nproc" train --config "$(seed_config video mouse)" "$@"
