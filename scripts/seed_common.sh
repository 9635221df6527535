#!/usr/bin/env bash
# Shared by the seed guides' shell scripts (train_distributed.sh, train_multigpu.sh,
# scripts/run_original_kgat_multi_gpu.sh): say the command that does the same here, then run it.
# Arguments are passed as arrays, never re-split or concatenated into a command string.

SEED_REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

# The repository's environment where it has one, else python3 from PATH.
seed_python() {
    if [[ -x "$SEED_REPO/.venv/bin/python" ]]; then
        echo "$SEED_REPO/.venv/bin/python"
    else
        command -v python3
    fi
}

# GPUs on this node (1 without nvidia-smi: one CPU process).
seed_gpus() {
    local n=0
    if command -v nvidia-smi >/dev/null 2>&1; then
        n="$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)"
    fi
    if [[ "$n" -lt 1 ]]; then n=1; fi
    echo "$n"
}

# seed_run SCRIPT NPROC TRAINER_ARGS...: torchrun NPROC processes of `python -m trainer TRAINER_ARGS`.
seed_run() {
    local script="$1" nproc="$2"
    shift 2
    if ! [[ "$nproc" =~ ^[1-9][0-9]*$ ]]; then
        echo "error: $script: the process count must be a positive integer, got '$nproc'" >&2
        exit 2
    fi
    local py launch=(--nproc-per-node "$nproc")
    py="$(seed_python)"
    # the guides' "port in use" advice (change the port in the script): MASTER_PORT=PORT instead
    if [[ -n "${MASTER_PORT:-}" ]]; then launch+=(--master-port "$MASTER_PORT"); fi
    printf '%s: the seed script; here the same is torchrun' "$script" >&2
    printf ' %q' "${launch[@]}" -m trainer "$@" >&2
    printf '\n' >&2
    # run from anywhere: the trainer importable from this checkout (relative paths stay the caller's)
    PYTHONPATH="$SEED_REPO${PYTHONPATH:+:$PYTHONPATH}" exec "$py" -m torch.distributed.run "${launch[@]}" \
        -m trainer "$@"
}

# seed_config RECIPE DATASET: the config of that name (relative where the caller stands in the repository,
# else absolute), or exit 2 naming the ones there are.
seed_config() {
    local rel="configs/$1/$2.yaml" names=()
    if [[ -f "$SEED_REPO/$rel" ]]; then
        if [[ -f "$rel" ]]; then echo "$rel"; else echo "$SEED_REPO/$rel"; fi
        return
    fi
    for f in "$SEED_REPO/configs/$1"/*.yaml; do names+=("$(basename "$f" .yaml)"); done
    echo "error: no $1 config for dataset '$2' ($rel); there are: ${names[*]}" >&2
    exit 2
}
