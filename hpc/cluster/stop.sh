#!/usr/bin/env bash
# Stop only the daemons that start.sh started (pids from its pid files) and undo its /etc/hosts lines.
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=hpc/cluster/where.sh
source "$HERE/where.sh"
DIR=$(cluster_dir)
if [ -z "$DIR" ] || ! ours "$DIR"; then echo "no local slurm cluster to stop${DIR:+ ($DIR is not ours)}"; exit 0; fi
if [ -f "$DIR/slurm.conf" ] && [ -s "$DIR/slurmctld.pid" ] && kill -0 "$(cat "$DIR/slurmctld.pid")" 2>/dev/null; then
  export SLURM_CONF="$DIR/slurm.conf"
  ids=$(squeue -h -o %A 2>/dev/null || true)
  if [ -n "$ids" ]; then
    # shellcheck disable=SC2086
    scancel --full $ids 2>/dev/null || true
    for _ in $(seq 1 100); do [ -z "$(squeue -h -t R,CG -o %A 2>/dev/null)" ] && break; sleep 0.1; done
  fi
fi
pids=()
for f in "$DIR"/slurmd-*.pid "$DIR/slurmctld.pid" "$DIR/slurmdbd.pid" "$DIR/mariadbd.pid" "$DIR/munge/munged.pid"; do
  [ -s "$f" ] || continue
  p=$(cat "$f"); rm -f "$f"
  case "$(ps -o comm= -p "$p" 2>/dev/null)" in   # a stale pid file may name someone else's process
    slurmd|slurmctld|slurmdbd|mariadbd|munged) kill "$p" && pids+=("$p") ;;
  esac
done
for _ in $(seq 1 150); do
  alive=0; for p in "${pids[@]}"; do kill -0 "$p" 2>/dev/null && alive=1; done
  [ $alive = 0 ] && break; sleep 0.1
done
for p in "${pids[@]}"; do kill -0 "$p" 2>/dev/null && kill -9 "$p"; done
MARK=hpc-trainer-cluster
[ -s "$DIR/hosts-mark" ] && MARK=$(cat "$DIR/hosts-mark")
case "$MARK" in hpc-trainer-cluster|hpc-trainer-cluster-[a-z]*) ;; *) MARK=hpc-trainer-cluster;; esac
sed -i -E "/[[:space:]]# $MARK\$/d" /etc/hosts
if [ -s "$DIR/netns" ]; then                  # HPC_CLUSTER_NETNS=1: the nodes' namespaces (their veths go with them)
  while read -r ns; do case "$ns" in hpc-[a-z]*[0-9]) ip netns del "$ns" 2>/dev/null || true;; esac; done < "$DIR/netns"
  rm -f "$DIR/netns"
  [ -s "$DIR/ip_forward" ] && cat "$DIR/ip_forward" > /proc/sys/net/ipv4/ip_forward
fi
echo "stopped slurm cluster in $DIR"
