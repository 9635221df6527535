#!/usr/bin/env bash
# Issue 54's GPU validation as one script, each step under its own time cap, for a device machine that has torch,
# numpy, pytest but neither this project installed, nor PyAV, matplotlib or a package index.
#
#   make gpu-carry                              # here, once: .gpu-carry/ holds ml-100k and PyAV's wheel
#   OUT=/tmp/gpu bash bench/gpu_check.sh        # on the device machine (the run tool: carry .gpu-carry)
#   GPU_CHECK_ON_CPU=1 OUT=/tmp/gpu-cpu bash bench/gpu_check.sh   # the same steps on a CPU: a plumbing check
#
# Steps (caps in seconds, overridable as CAP_<N>=...; about 9 minutes at most, leaving time for one rerun
# of a failing step: STEPS="3 4" runs only those):
#   1 bench.gpu --quick (180; its own budget 130 s, rows saved one by one; ONLY=har,kgat: those rows, joined to
#     the JSON already in $OUT), then the tests marked gpu but those of steps 3-4 (120); 1b or 1t: one of the two
#     (PARALLEL=1: the tests of steps 1, 3 and 4 side by side, after the timings)
#   2 our SASRec ml-100k epoch beside the stock PyTorch SASRec, added to step 1's JSON (60)
#   3 two ranks on the one GPU over gloo: train and resume, bitwise equal to an uninterrupted run (60)
#   4 SIGTERM and resume, bitwise, train.deterministic=true, every recipe; the same run twice, bitwise (100)
#   5 the straggler watch on CUDA: two ranks share the GPU over gloo, one slowed, it is named (90; not in STEPS'
#     default)
#   6 the device clock (issue 69): two ranks on the GPU, rank 1's device work slowed, rank 0's stream waiting for it
#     through an interprocess event as under NCCL: the device clock names it, the window's time does not (90)
#   7 the straggler watch's cost: DDP under NCCL in a world of one, SASRec and video steps, plain against the comm
#     hook and against the device clock (bench/comm_hook.py; 150; HOOK_ARGS="--rounds 9 --steps 100": its
#     options). STEPS="6 7": issue 69's device checks alone
#   8 issue 71: SASRec with the full softmax (loss.kind=ce) on Amazon Beauty, the paper's protocol, BEAUTY_EPOCHS
#     (10) epochs (bench/sasrec_beauty.py; its beauty.txt from $CARRY/beauty, which `make gpu-carry` fills; 160 per
#     seed; BEAUTY_SEEDS="2 3 4": those seeds, one after another, one report)
#   9 issue 71's losses on the GPU: their steps with no host sync (sync debug mode "error"; off, bf16, fp16) and the
#     full softmax compiled with CUDA graphs (100)
#   10 issue 70: video's bare step at batch 16, model.layout conv3d beside frames, eager and compiled (90)
#   11 issue 70 (d): SASRec at MovieLens-20M's shape (20M generated rows, width 256, maxlen 200) beside the stock
#     model, batch 128 and 1024, ours eager and compiled (bench/sasrec_at_size.py, into the step-1 JSON; 420;
#     AT_SIZE_ARGS="--batches 128": its options)
#   12 issue 70 (c): compile.step_graph=on, the whole step one CUDA graph: bitwise equal to the eager step (SASRec, HAR,
#     KGAT; tests/gpu/test_step_graph_cuda.py), then the SASRec ml-100k, HAR and KGAT steps bf16 / compiled / graph /
#     graph-compiled (bench.gpu --amps, into the step-1 JSON, its rows within BUDGET_12 (200) s; 300)
#   13 issue 86: the docs' GPU commands (```bash gpu blocks) as a user types them, each training 2 steps
#     (tests/gpu/test_page_commands_cuda.py; 240)
# ONLY=video,epoch: step 1's bench measures those rows only (its log 1-bench-video-epoch.log); AMPS=bf16,deterministic:
# each row's modes (bench.gpu --amps; deterministic's cost is its step over the bf16 row's of the same run)
# Everything lands in $OUT: each step's log, summary.txt (step, exit code, seconds), versions.txt, the JSON.
# PACK=FILE: after every step, $OUT (checkpoints left out) is packed into FILE.tgz, for a machine that sends back
# a few files only.
# Draw the PNG afterwards where matplotlib is: python -m bench.gpu --plot $OUT/gpu-<device>.json
set -u
cd "$(dirname "$0")/.." || exit 2
OUT=${OUT:?set OUT to a folder for the results}
mkdir -p "$OUT"
PY=${PY:-python3}
CARRY=${CARRY:-.gpu-carry}
STEPS=${STEPS:-1 2 3 4}
site=/tmp/gpu-check-site
if compgen -G "$CARRY/whl/*.whl" >/dev/null && ! "$PY" -c "import av" 2>/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --target "$site" "$CARRY"/whl/*.whl >"$OUT/pip.log" 2>&1
fi
export PYTHONPATH="$PWD:$site" TRAINER_CPU_KERNELS=0 TRAINER_DATA_KERNELS=0 PYTHONUNBUFFERED=1
export CUBLAS_WORKSPACE_CONFIG=:4096:8     # train.deterministic sets it too; here it is in place before any handle
ml100k=$CARRY/ml-100k
[ -f "$ml100k/u.data" ] || ml100k=../shared/data/ml-100k
if [ "${GPU_CHECK_ON_CPU:-0}" = 1 ]; then
    export GPU_CHECK_ON_CPU
    bench=(--device cpu --tiny)
    name=cpu
else
    bench=()
    name=$("$PY" -c "import torch; print(torch.cuda.get_device_name().replace(' ', '-'))" 2>/dev/null || echo none)
fi
json=$OUT/gpu-$name.json
xdist=()
"$PY" -c "import xdist" 2>/dev/null && xdist=(-n 4)

"$PY" - >"$OUT/versions.txt" 2>&1 <<'EOF'
import platform, torch
cuda = torch.cuda.is_available()
print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda,
      "nccl", ".".join(map(str, torch.cuda.nccl.version())) if cuda else None,
      "device", torch.cuda.get_device_name() if cuda else "cpu")
EOF
command -v nvidia-smi >/dev/null && nvidia-smi >"$OUT/nvidia-smi.txt" 2>&1
# the shared-memory all-reduce's extension (step 3's two ranks attach it), built while step 1 runs
"$PY" -c "from trainer.distributed import shm; shm.EXT.load()" >"$OUT/shm-build.log" 2>&1 &
shm_build=$!

step() {   # step NAME CAP COMMAND...: run it under its cap, log to $OUT/NAME.log, one line in summary.txt
    local name=$1 cap=$2 start rc
    shift 2
    start=$(date +%s)
    timeout -k 10 "$cap" "$@" >"$OUT/$name.log" 2>&1
    rc=$?
    echo "$name rc=$rc $(( $(date +%s) - start ))s (cap ${cap}s)$([ $rc = 124 ] && echo ' TIMED OUT')" \
        | tee -a "$OUT/summary.txt"
    pack
}
pack() {   # $OUT as one archive (PACK): what a cap cuts short still comes back with the steps before it
    [ -n "${PACK:-}" ] || return 0
    tar czf "$PACK.tgz.tmp" --exclude='*.pt' --exclude='*.npz' -C "$OUT" . && mv "$PACK.tgz.tmp" "$PACK.tgz"
    cp "$OUT/summary.txt" "$PACK.summary.txt" 2>/dev/null
}
wants() { [[ " $STEPS " == *" $1 "* ]]; }

if wants 1 || wants 1b; then
    step "1-bench${ONLY:+-${ONLY//,/-}}" "${CAP_1:-180}" "$PY" -m bench.gpu --quick --budget-s "${BUDGET_1:-130}" \
        --no-stock --ml100k "$ml100k" --out "$json" ${ONLY:+--only "$ONLY"} ${AMPS:+--amps "$AMPS"} "${bench[@]}"
fi
if wants 2; then
    step 2-stock "${CAP_2:-60}" "$PY" -m bench.gpu --stock-only --ml100k "$ml100k" --out "$json" "${bench[@]}"
fi
wait "$shm_build"
# the checks of correctness: one after another, or side by side with PARALLEL=1 (the timings are steps 1 and 2)
pids=()
later() { if [ "${PARALLEL:-0}" = 1 ]; then step "$@" & pids+=($!); else step "$@"; fi; }
if wants 1 || wants 1t; then
    later 1-tests "${CAP_1T:-120}" "$PY" -m pytest -q -p no:cacheprovider -m gpu tests/gpu/test_cuda.py -rs "${xdist[@]}"
fi
if wants 3; then
    later 3-shared-gpu "${CAP_3:-60}" "$PY" -m pytest -q -p no:cacheprovider -rs tests/gpu/test_cuda_resume.py \
        -k two_ranks_share
fi
if wants 4; then
    later 4-bitwise "${CAP_4:-100}" "$PY" -m pytest -q -p no:cacheprovider -rs tests/gpu/test_cuda_resume.py \
        -k "resume_after_sigterm or same_bits" "${xdist[@]}"
fi
if wants 5; then
    later 5-stragglers "${CAP_5:-90}" "$PY" -m pytest -q -p no:cacheprovider -rs tests/gpu/test_cuda_stragglers.py -s
fi
if wants 6; then
    later 6-device-clock "${CAP_6:-90}" "$PY" -m pytest -q -p no:cacheprovider -rs tests/gpu/test_device_clock_cuda.py -s
fi
if wants 7; then
    step 7-hook-cost "${CAP_7:-150}" "$PY" -m bench.comm_hook --ml100k "$ml100k" --out "$OUT/comm-hook-$name.json" \
        ${HOOK_ARGS:-} \
        ${GPU_CHECK_ON_CPU:+--device cpu --tiny}
fi
if wants 8; then
    beauty=$CARRY/beauty/beauty.txt
    [ -f "$beauty" ] || beauty=../shared/data/beauty/beauty.txt
    for seed in ${BEAUTY_SEEDS:-0}; do      # one row per seed in the one report (each seed under the step's cap)
        step "8-beauty-ce-seed$seed" "${CAP_8:-160}" "$PY" -m bench.sasrec_beauty --runs ce --seed "$seed" \
            --epochs "${BEAUTY_EPOCHS:-10}" --data "$beauty" --out "$OUT/beauty"
    done
fi
if wants 9; then
    step 9-losses-gpu "${CAP_9:-100}" "$PY" -m pytest -q -p no:cacheprovider -rs -m gpu tests/gpu/test_cuda.py \
        -k issue71 "${xdist[@]}"
fi
if wants 10; then
    step 10-video-layouts "${CAP_10:-90}" "$PY" -m bench.gpu --only video-bare --video-layouts conv3d,frames \
        --video-batches "${VIDEO_BATCHES:-16}" --video-eager --out "$json" "${bench[@]}"
fi
if wants 11; then
    # shellcheck disable=SC2086  # AT_SIZE_ARGS: options, split on purpose
    small=()
    [ "${GPU_CHECK_ON_CPU:-0}" = 1 ] && small=(--device cpu --rows 30000 --width 16 --maxlen 20 --batches 32 --warmup 2)
    step 11-sasrec-at-size "${CAP_11:-420}" "$PY" -m bench.sasrec_at_size --out "$json" --work /tmp/sasrec-at-size \
        "${small[@]}" ${AT_SIZE_ARGS:-}
fi
if wants 12; then
    step 12-step-graph "${CAP_12:-300}" bash -c '"$0" -m pytest -q -p no:cacheprovider -rs -s \
        tests/gpu/test_step_graph_cuda.py; t=$?; "$0" -m bench.gpu --only "${ONLY_12:-sasrec-ml100k,har,kgat}" \
        --amps bf16,compiled,graph,graph-compiled --budget-s "${BUDGET_12:-200}" --no-stock --ml100k "$2" \
        --out "$1" "${@:3}"; b=$?; exit $(( t > b ? t : b ))' "$PY" "$json" "$ml100k" "${bench[@]}"
fi
if wants 13; then
    step 13-page-commands "${CAP_13:-240}" "$PY" -m pytest -q -p no:cacheprovider -rs \
        tests/gpu/test_page_commands_cuda.py
fi
for pid in "${pids[@]}"; do wait "$pid"; done
cat "$OUT/summary.txt"
