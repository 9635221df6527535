#!/usr/bin/env bash
# Seed 000's launch script: KGAT under DDP on N GPUs of this node, through the trainer. Its flags --num_gpus N,
# --dataset NAME (amazon-book, last-fm, yelp2018), --batch_size_per_gpu B and --master_port P; other arguments
# (--epochs N among them) go to the trainer.
#   ./scripts/run_original_kgat_multi_gpu.sh --num_gpus 2 --dataset amazon-book
set -euo pipefail
# shellcheck source=scripts/seed_common.sh
source "$(dirname "${BASH_SOURCE[0]}")/seed_common.sh"
nproc="$(seed_gpus)" dataset=amazon-book rest=()
while [[ $# -gt 0 ]]; do
    case "$1" in
        --num_gpus|--dataset|--batch_size_per_gpu|--master_port)
            if [[ $# -lt 2 ]]; then echo "error: $1 needs a value" >&2; exit 2; fi
            case "$1" in
                --num_gpus) nproc="$2" ;;
                --dataset) dataset="$2" ;;
                --batch_size_per_gpu) rest+=(--batch-size "$2") ;;
                --master_port) export MASTER_PORT="$2" ;;
            esac
            shift 2 ;;
        --num_gpus=*) nproc="${1#*=}"; shift ;;
        --dataset=*) dataset="${1#*=}"; shift ;;
        --batch_size_per_gpu=*) rest+=(--batch-size "${1#*=}"); shift ;;
        --master_port=*) export MASTER_PORT="${1#*=}"; shift ;;
        *) rest+=("$1"); shift ;;
    esac
done
config="$(seed_config kgat "$dataset")"
seed_run "$(basename "$0")" "$nproc" train --config "$config" "${rest[@]}"
