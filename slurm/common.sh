# shellcheck shell=bash
# Sourced by every slurm/*.sbatch script: the one place for the job environment.
# Knobs (environment variables, all optional):
#   IMAGE=trainer.sif   run every task in `apptainer exec --nv IMAGE` (else plain $PYTHON)
#   CONTAINER_ENGINE=podman   with IMAGE=REF (e.g. localhost/hpc-trainer:test): every task in `podman run`
#                       (host network, SLURM_*/NCCL_*/TORCH_* passed in, submit dir and TRAINER_HOME mounted;
#                       as yourself via --userns=keep-id, as the image's user uid 1000 when submitted by root)
#   CONFIG=FILE         YAML config (each script has a default)
#   EXTRA="k=v k2=v2"   key=value overrides appended to the trainer command (no spaces inside a value)
#   PYTHON=python3      interpreter when IMAGE is not set (default: TRAINER_HOME/.venv/bin/python if
#                       it exists, else python3; checked once here, before srun, that it imports torch)
#   RUN_DIR=DIR         default $SLURM_SUBMIT_DIR/runs/$SLURM_JOB_ID (stable across requeues)
#   TRAINER_HOME=DIR    the repository (default: the one the script was submitted from, found through
#                       `scontrol show job`'s Command; else $SLURM_SUBMIT_DIR)
#   DATA=DIR            the dataset: data.path=DIR for every script (har_1node and video_1node have a default);
#                       relative to the submit directory
#   PER_TASK_LOGS=1     each task's output in RUN_DIR/task-N.out (srun --output %t) instead of the job's .out
#   MAX_RESTARTS=2      relaunches of a failed training step inside this allocation (0: off; see run_training)

# ---------------------------------------------------------------- NCCL and torch
# WARN keeps logs quiet; NCCL_DEBUG=INFO shows the transports chosen when a job hangs at start-up.
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
# A failed or timed-out collective aborts the process instead of hanging the whole job.
export TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}
# torch's NCCL flight recorder: each rank's last collectives, which the hang watch dumps into RUN_DIR/hangs/
# (torch 2.13's name; the old TORCH_NCCL_TRACE_BUFFER_SIZE is still honoured and warned about once per rank)
export TORCH_FR_BUFFER_SIZE=${TORCH_FR_BUFFER_SIZE:-${TORCH_NCCL_TRACE_BUFFER_SIZE:-2000}}
# Network interface and InfiniBand adapters are site-specific: passed through when the site sets them.
if [ -n "${NCCL_SOCKET_IFNAME:-}" ]; then export NCCL_SOCKET_IFNAME; fi
if [ -n "${NCCL_IB_HCA:-}" ]; then export NCCL_IB_HCA; fi
# One OpenMP pool per task, sized by --cpus-per-task (Slurm does not set OMP_NUM_THREADS).
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-${SLURM_CPUS_PER_TASK:-1}}
# Slurm >= 22.05: srun no longer inherits --cpus-per-task from sbatch; without this every task is
# pinned to one CPU and data loading starves.
export SRUN_CPUS_PER_TASK=${SLURM_CPUS_PER_TASK:-1}
# Logs reach the .out file as they are written; a hard crash prints every thread's stack.
export PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1
# MASTER_ADDR/MASTER_PORT: the trainer derives them from SLURM_STEP_NODELIST and SLURM_JOB_ID
# (no scontrol needed inside containers); export them here only to override.

# ---------------------------------------------------------------- knobs
# Knobs come from the submitting shell: a newline would cut EXTRA short (read takes one line) and a
# control character in a path is never what was meant. Values are otherwise used literally (quoted).
for knob in IMAGE CONTAINER_ENGINE CONFIG EXTRA PYTHON RUN_DIR TRAINER_HOME DATA PER_TASK_LOGS MAX_RESTARTS CHECKPOINT OUT; do
  if [[ "${!knob:-}" =~ [[:cntrl:]] ]]; then
    echo "common.sh: $knob holds a control character (newline, tab, ...): refused; value: $(printf '%q' "${!knob}")" >&2
    exit 2
  fi
done

# ---------------------------------------------------------------- where things are
TRAINER_HOME=${TRAINER_HOME:-$SLURM_SUBMIT_DIR}
RUN_DIR=${RUN_DIR:-$SLURM_SUBMIT_DIR/runs/$SLURM_JOB_ID}
mkdir -p "$RUN_DIR"
export TRAINER_HOME RUN_DIR

# ---------------------------------------------------------------- container wrapper
# shellcheck disable=SC2034  # LAUNCH and EXTRA_ARGS are used by the sbatch scripts
if [ "${CONTAINER_ENGINE:-apptainer}" = podman ]; then
  if [ -z "${IMAGE:-}" ] || ! podman image exists "$IMAGE"; then
    echo "common.sh: CONTAINER_ENGINE=podman: image '${IMAGE:-}' is not in podman's store (make test-image builds localhost/hpc-trainer:test)" >&2
    exit 2
  fi
  PODMAN_USER=(--userns=keep-id)            # rootless podman: files in the run dir stay yours
  if [ "$(id -u)" = 0 ]; then PODMAN_USER=(); fi   # never root inside: the image's own user (uid 1000)
  PODMAN_MOUNTS=(-v "$SLURM_SUBMIT_DIR:$SLURM_SUBMIT_DIR")
  if [ "$TRAINER_HOME" != "$SLURM_SUBMIT_DIR" ]; then PODMAN_MOUNTS+=(-v "$TRAINER_HOME:$TRAINER_HOME:ro"); fi
  if [ "${RUN_DIR#"$SLURM_SUBMIT_DIR"/}" = "$RUN_DIR" ]; then PODMAN_MOUNTS+=(-v "$RUN_DIR:$RUN_DIR"); fi
  # --network host: the rendezvous port and MASTER_ADDR are the node's; srun's signals reach the trainer
  # through podman's signal proxy
  LAUNCH=(podman run --rm --network host --ipc host "${PODMAN_USER[@]}" "${PODMAN_MOUNTS[@]}" -w "$SLURM_SUBMIT_DIR"
          --env 'SLURM_*' --env 'NCCL_*' --env 'TORCH_*' --env OMP_NUM_THREADS --env SRUN_CPUS_PER_TASK
          --env 'MASTER_*' --env TRAINER_ATTEMPT "$IMAGE" python)
elif [ "${CONTAINER_ENGINE:-apptainer}" != apptainer ]; then
  echo "common.sh: CONTAINER_ENGINE=$CONTAINER_ENGINE: expected apptainer (the default, with IMAGE=FILE.sif) or podman" >&2
  exit 2
elif [ -n "${IMAGE:-}" ]; then
  if [ ! -f "$IMAGE" ]; then
    echo "common.sh: IMAGE=$IMAGE: no such file (build it with: make sif)" >&2
    exit 2
  fi
  # --nv: the host's NVIDIA driver inside; the submit directory holds data, configs and runs
  LAUNCH=(apptainer exec --nv --bind "$SLURM_SUBMIT_DIR" "$IMAGE" python)
else
  if [ -z "${PYTHON:-}" ]; then
    PYTHON=python3
    if [ -x "$TRAINER_HOME/.venv/bin/python" ]; then PYTHON=$TRAINER_HOME/.venv/bin/python; fi
  fi
  # once here rather than a ModuleNotFoundError from every rank
  if ! "$PYTHON" -c "import torch, trainer" >/dev/null 2>&1; then
    echo "common.sh: $PYTHON cannot import torch and trainer (no virtual environment active?)." >&2
    echo "  run \`make setup\` in $TRAINER_HOME (the scripts then find its .venv), or submit with" >&2
    echo "  PYTHON=/path/to/venv/bin/python sbatch ..., or IMAGE=hpc-trainer.sif sbatch ..." >&2
    exit 2
  fi
  LAUNCH=("$PYTHON")
fi

# shellcheck disable=SC2034  # split on spaces only: read -a does no globbing and no expansion
read -r -a EXTRA_ARGS <<< "${EXTRA:-}"
if [ -n "${DATA:-}" ]; then EXTRA_ARGS=("data.path=$DATA" "${EXTRA_ARGS[@]}"); fi    # EXTRA's own data.path wins

# SRUN_LOG is used by the sbatch scripts' srun line; appended to after a requeue, as the job's .out is
SRUN_LOG=()
# shellcheck disable=SC2034
case "${PER_TASK_LOGS:-0}" in
  1|true|yes) SRUN_LOG=(--output "$RUN_DIR/task-%t.out" --open-mode append) ;;   # %t: the task's rank
  0|false|no|"") ;;
  *) echo "common.sh: PER_TASK_LOGS=$PER_TASK_LOGS: expected 1 or 0" >&2; exit 2 ;;
esac

MAX_RESTARTS=${MAX_RESTARTS:-2}
if ! [[ "$MAX_RESTARTS" =~ ^[0-9]+$ ]]; then
  echo "common.sh: MAX_RESTARTS=$MAX_RESTARTS: expected a whole number (0 turns relaunching off)" >&2
  exit 2
fi
JOB_START=$(date +%s.%N)      # this allocation's start, as far as the time-left rule is concerned

echo "job $SLURM_JOB_ID restart ${SLURM_RESTART_COUNT:-0} on $SLURM_JOB_NODELIST: run dir $RUN_DIR" >&2

# wait_forwarding PID: wait for the srun step in the background, passing on the signals that reach
# the batch shell (--signal=B:USR1@120 before the time limit; TERM on preemption and scancel).
# srun relays them to every task; the trainer checkpoints, and requeues itself on USR1.
# After a TERM (to this shell, or to the tasks only: they then exit 143 after their checkpoint) the
# shell stays alive until Slurm kills it: a job that ends by itself during the preemption GraceTime
# is recorded FAILED and never requeued (Slurm 22.05).
STEP_TERM=0     # set once a TERM reached this shell: no relaunch after that
STEP_USR1=0     # set once the time-limit warning came (--signal=B:USR1): no relaunch after that
wait_forwarding() {
  local pid=$1 rc=0
  trap 'STEP_USR1=1; kill -USR1 "$pid" 2>/dev/null' USR1
  trap 'STEP_TERM=1; kill -TERM "$pid" 2>/dev/null' TERM
  while :; do
    rc=0
    wait "$pid" || rc=$?   # `|| rc=`: the scripts run under set -e
    # wait returns early (>128) when a trapped signal arrives: keep waiting while the step runs
    if [ "$rc" -gt 128 ] && kill -0 "$pid" 2>/dev/null; then continue; fi
    break
  done
  # rc 143 alone is not enough: srun --kill-on-bad-exit also ends healthy tasks with TERM when one crashes;
  # the trainer leaves RUN_DIR/.preempted only after a signal checkpoint.
  if [ "$STEP_TERM" = 1 ] || { [ "$rc" = 143 ] && [ -f "$RUN_DIR/.preempted" ]; }; then
    echo "step ended after SIGTERM (rc $rc): waiting up to ${TERM_HOLD_S:-600}s for Slurm to requeue or cancel" >&2
    sleep "${TERM_HOLD_S:-600}" & wait $! || true
  fi
  return "$rc"
}

# run_training srun [SRUN_OPTIONS] COMMAND...: the training step, relaunched inside this allocation after a
# retryable failure (trainer/launch/exitcodes.py), up to MAX_RESTARTS times per allocation (a Slurm requeue starts the
# count again), into the same run directory from the newest agreed checkpoint (the command has --resume auto),
# with a fresh port (a new step id). trainer/launch/restarts.py decides from each rank's exit record and writes
# RUN_DIR/restarts.jsonl; never relaunched: a usage/configuration error, a non-finite loss, a run directory that
# cannot be written (exit 4: a full disk, a quota), a checkpointed preemption (Slurm requeues that), less time left than the last attempt needed to reach a checkpoint. A host
# that failed twice is left out when the others can go on (a recipe that resumes exactly on a smaller world).
run_training() {
  local attempt=0 rc start end stop verdict summary nodes tasks_per_node job_log exclude=() excluded=""
  nodes=$(scontrol show hostnames "$SLURM_JOB_NODELIST" 2>/dev/null | tr '\n' ' ' || echo "$SLURM_JOB_NODELIST")
  tasks_per_node=${SLURM_NTASKS_PER_NODE:-$(( ${SLURM_NTASKS:-1} / ${SLURM_NNODES:-1} ))}
  job_log=$(scontrol show job "$SLURM_JOB_ID" 2>/dev/null | sed -n 's/^ *StdOut=//p' || true)
  if [ "${SLURM_RESTART_COUNT:-0}" -gt 0 ] && [ -s "$RUN_DIR/restarts.jsonl" ]; then
    echo "restart loop: requeue ${SLURM_RESTART_COUNT} of job $SLURM_JOB_ID: the relaunch count starts again" \
         "(MAX_RESTARTS=$MAX_RESTARTS in this allocation)" >&2
  fi
  while :; do
    start=$(date +%s.%N)
    export TRAINER_ATTEMPT=$attempt
    # a signal checkpoint counts only if this attempt made it: an earlier allocation's marker would otherwise stop
    # the loop when a relaunched step dies before its trainer starts (and clears the marker) itself
    rm -f "$RUN_DIR/.preempted"
    rc=0
    "$1" "${exclude[@]}" "${@:2}" &
    wait_forwarding $! || rc=$?
    if [ "$rc" = 0 ] || [ "$STEP_TERM" = 1 ]; then break; fi
    end=$(squeue -h -j "$SLURM_JOB_ID" -o %e 2>/dev/null | head -n1 || true)
    case "$end" in          # 2026-11-26T13:57:00; empty (no squeue), N/A or Unknown: no time limit known
      [0-9]*T*) end=$(date -d "$end" +%s 2>/dev/null || true) ;;
      *) end="" ;;
    esac
    stop=""
    if [ "$STEP_USR1" = 1 ]; then stop="the time-limit warning (USR1) came: no time for a relaunch"; fi
    verdict=$("${LAUNCH[@]}" -m trainer.launch.restarts decide --run-dir "$RUN_DIR" --rc "$rc" --attempt "$attempt" \
              --max "$MAX_RESTARTS" --attempt-start "$start" --job-start "$JOB_START" --end-time "$end" \
              --nodes "$nodes" --excluded "${excluded//,/ }" --tasks-per-node "$tasks_per_node" \
              --job "$SLURM_JOB_ID" --requeue "${SLURM_RESTART_COUNT:-0}" --job-log "$job_log" \
              --stop "$stop") || verdict=stop
    if [ "$STEP_TERM" = 1 ] || [ "${verdict%% *}" != relaunch ]; then break; fi
    if [ "$STEP_USR1" = 1 ]; then
      echo "restart loop: the time-limit warning (USR1) came meanwhile: no relaunch" >&2
      break
    fi
    attempt=$((attempt + 1))
    excluded=${verdict#relaunch}; excluded=${excluded# }
    exclude=()
    if [ -n "$excluded" ]; then
      local left=$(( $(wc -w <<< "$nodes") - $(tr ',' ' ' <<< "$excluded" | wc -w) ))
      exclude=(--exclude="$excluded" --nodes="$left" --ntasks=$(( left * tasks_per_node )))
    fi
    echo "restart loop: relaunching the training step (attempt $attempt) ${exclude[*]}" >&2
  done
  if [ "$attempt" -gt 0 ]; then
    summary=$("${LAUNCH[@]}" -m trainer.launch.restarts summary "$RUN_DIR" 2>&1 || true)
    echo "$summary" >&2
  fi
  return "$rc"
}
