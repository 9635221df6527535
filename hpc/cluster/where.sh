# shellcheck shell=bash
# Sourced by start.sh and stop.sh: where the local cluster lives.
# Each start makes a fresh private directory (mktemp, not a fixed /tmp name that another local user could
# have created first) and records its path in a pointer file under the user's own state directory.
# HPC_CLUSTER_DIR=DIR picks the directory instead; start.sh removes an old one only when it carries our marker.
POINTER=${HPC_CLUSTER_POINTER:-${XDG_STATE_HOME:-$HOME/.local/state}/hpc-trainer/cluster-dir}
MARKER=.hpc-trainer-cluster

# cluster_dir: the directory of the running (or last) cluster, or nothing
cluster_dir() {
  if [ -n "${HPC_CLUSTER_DIR:-}" ]; then echo "$HPC_CLUSTER_DIR"; return; fi
  if [ -s "$POINTER" ]; then cat "$POINTER"; fi
}

# ours DIR: true when DIR is a real directory (no symlink) of this user that start.sh made
ours() {
  [ -d "$1" ] && [ ! -L "$1" ] && [ -O "$1" ] && [ -f "$1/$MARKER" ] && [ ! -L "$1/$MARKER" ]
}
