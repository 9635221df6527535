#!/usr/bin/env bash
# Start a throw-away Slurm cluster on this machine for tests and demos:
#   munged + mariadbd + slurmdbd + slurmctld + N slurmd ("slurmd -N nodeI"; Debian builds Slurm
#   with MULTIPLE_SLURMD), each node advertising CPUS cpus and GPUS fake GPUs (gres on char devices).
# Everything lives in a fresh private directory (see where.sh); clients need `source DIR/env.sh`
# (or: eval "$(make -s slurm-env)").  Stop with hpc/cluster/stop.sh (our pid files only).
# Needs root: it adds "127.0.0.1 nodeI" lines to /etc/hosts and mknod's the fake GPU devices.
# HPC_CLUSTER_NETNS=1: each node gets a network of its own (a network namespace with its own loopback, joined to
# this one by a veth "cl0" that the root namespace routes between: what crosses it can be slowed with tc), its
# slurmd runs there, and tasks bind gloo to it with GLOO_SOCKET_IFNAME=cl0. HPC_CLUSTER_NODE_PREFIX names the nodes
# (default node): a second cluster beside the first (with its own HPC_CLUSTER_DIR and HPC_CLUSTER_POINTER).
# Every daemon listens on 127.0.0.1 only; the accounting database gets a random password.
set -Eeuo pipefail      # -E: the ERR trap (stop what started) fires inside functions too
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=hpc/cluster/where.sh
source "$HERE/where.sh"
NNODES=${HPC_CLUSTER_NODES:-2}
CPUS=${HPC_CLUSTER_CPUS:-4}          # advertised per node; more than the real cores is fine (overcommit)
GPUS=${HPC_CLUSTER_GPUS:-4}          # fake GPUs per node: CUDA_VISIBLE_DEVICES is set, CUDA is not there
CTLD_PORT=${HPC_CLUSTER_CTLD_PORT:-6817}
DBD_PORT=${HPC_CLUSTER_DBD_PORT:-6819}
MYSQL_PORT=${HPC_CLUSTER_MYSQL_PORT:-3307}
SLURMD_PORT0=${HPC_CLUSTER_SLURMD_PORT0:-6830}
ACCOUNTING=${HPC_CLUSTER_ACCOUNTING:-1}
ADDR=127.0.0.1
NETNS=${HPC_CLUSTER_NETNS:-0}
PREFIX=${HPC_CLUSTER_NODE_PREFIX:-node}
NET=${HPC_CLUSTER_NET:-10.97}            # NETNS=1: node I is NET.I.2 on its cl0, this namespace NET.I.1
HOSTS_MARK="hpc-trainer-cluster"; [ "$PREFIX" = node ] || HOSTS_MARK="hpc-trainer-cluster-$PREFIX"
case "$PREFIX" in *[!a-z]*|"") echo "HPC_CLUSTER_NODE_PREFIX: lower-case letters only, not '$PREFIX'" >&2; exit 2;; esac
T0=$(date +%s.%N)

DIR=$(cluster_dir)
if [ -n "$DIR" ] && ours "$DIR" && [ -s "$DIR/slurmctld.pid" ] && kill -0 "$(cat "$DIR/slurmctld.pid")" 2>/dev/null; then
  echo "cluster already running in $DIR (source $DIR/env.sh)"; exit 0
fi
for exe in munged slurmctld slurmd; do
  command -v $exe >/dev/null || { echo "$exe not found: run hpc/cluster/install.sh (make slurm-install)" >&2; exit 1; }
done
command -v slurmdbd >/dev/null && command -v mariadbd >/dev/null || ACCOUNTING=0
if [ -n "${HPC_CLUSTER_DIR:-}" ]; then
  DIR=$HPC_CLUSTER_DIR
  if [ -e "$DIR" ] || [ -L "$DIR" ]; then
    if ! ours "$DIR"; then
      echo "start.sh: $DIR exists and is not a cluster directory of this user (no $MARKER, or a symlink, or" \
           "another owner): refusing to use or remove it. Unset HPC_CLUSTER_DIR or name a new path." >&2
      exit 1
    fi
    rm -rf -- "$DIR"
  fi
  mkdir -m 0711 -- "$DIR"          # fails if anything appeared at that path in the meantime
else
  DIR=$(mktemp -d "${TMPDIR:-/tmp}/hpc-trainer-slurm.XXXXXXXX")
fi
touch "$DIR/$MARKER"
# before anything can fail: stop.sh (the trap below) removes only this cluster's /etc/hosts lines
echo "$HOSTS_MARK" > "$DIR/hosts-mark"
mkdir -p "$(dirname "$POINTER")"
echo "$DIR" > "$POINTER"
trap 'echo "start.sh failed at line $LINENO; stopping what started (logs in $DIR/log)" >&2; HPC_CLUSTER_DIR="$DIR" bash "$HERE/stop.sh" >&2' ERR
mkdir -p "$DIR"/{munge,munge-key,state,spool,log,fakegpu}
# others may traverse (munged wants a world-executable path to its socket) but not list or read
chmod 711 "$DIR"; chmod 755 "$DIR/munge"; chmod 700 "$DIR"/{munge-key,state,spool,log}
# munged refuses a socket whose parent folders are not executable by all (group too)
p="$DIR"; while [ "$p" != / ]; do chmod go+x "$p" 2>/dev/null || true; p=$(dirname "$p"); done

# munge with our own key and socket (independent of /etc/munge)
mungekey --create --keyfile="$DIR/munge-key/munge.key"
munged --key-file="$DIR/munge-key/munge.key" --socket="$DIR/munge/munge.sock" \
       --pid-file="$DIR/munge/munged.pid" --log-file="$DIR/munge/munged.log" --seed-file="$DIR/munge/munged.seed"

node_addr() { if [ "$NETNS" = 1 ]; then echo "$NET.$1.2"; else echo "$ADDR"; fi; }
if [ "$NETNS" = 1 ]; then
  # a namespace per node, its veth's far end here; this namespace routes between them (ip_forward, put back by
  # stop.sh); the daemons listen on node 1's gateway address, which every node reaches by its default route
  cat /proc/sys/net/ipv4/ip_forward > "$DIR/ip_forward"
  for i in $(seq 1 "$NNODES"); do
    ns="hpc-$PREFIX$i"
    ip netns add "$ns"; echo "$ns" >> "$DIR/netns"
    ip link add "$ns" type veth peer name cl0 netns "$ns"
    ip addr add "$NET.$i.1/24" dev "$ns"; ip link set "$ns" up
    ip -n "$ns" addr add "$NET.$i.2/24" dev cl0; ip -n "$ns" link set cl0 up; ip -n "$ns" link set lo up
    ip -n "$ns" route add default via "$NET.$i.1"
  done
  echo 1 > /proc/sys/net/ipv4/ip_forward
  ADDR=$NET.1.1
fi
# node names resolve to their address, loopback unless NETNS=1 (MASTER_ADDR = first node of the step)
sed -i -E "/[[:space:]]# $HOSTS_MARK\$/d" /etc/hosts
for i in $(seq 1 "$NNODES"); do echo "$(node_addr "$i") $PREFIX$i # $HOSTS_MARK" >> /etc/hosts; done

# fake GPUs must be character devices (regular files are rejected by gres)
for g in $(seq 0 $((GPUS-1))); do mknod -m 666 "$DIR/fakegpu/nvidia$g" c 1 3; done

ACCT="AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none"
if [ "$ACCOUNTING" = 1 ]; then
  M="$DIR/mysql"
  mariadb-install-db --user=root --datadir="$M" --auth-root-authentication-method=normal --skip-test-db \
      > "$DIR/log/mariadb-install.log" 2>&1
  setsid -f mariadbd --user=root --datadir="$M" --socket="$M/mysql.sock" --pid-file="$DIR/mariadbd.pid" \
      --port="$MYSQL_PORT" --bind-address=127.0.0.1 --skip-name-resolve --log-error="$DIR/log/mariadbd.log" \
      --innodb-buffer-pool-size=64M </dev/null >/dev/null 2>&1
  for _ in $(seq 1 300); do mariadb-admin -S "$M/mysql.sock" ping >/dev/null 2>&1 && break; sleep 0.1; done
  DB_PASS=$(head -c 24 /dev/urandom | base64 | tr -dc 'A-Za-z0-9')
  mariadb -S "$M/mysql.sock" -e "CREATE USER 'slurm'@'127.0.0.1' IDENTIFIED BY '$DB_PASS';
      GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1';"
  cat > "$DIR/slurmdbd.conf" <<CONF
AuthType=auth/munge
AuthInfo=socket=$DIR/munge/munge.sock
DbdHost=localhost
DbdAddr=127.0.0.1
CommunicationParameters=NoInAddrAny
DbdPort=$DBD_PORT
SlurmUser=root
PidFile=$DIR/slurmdbd.pid
LogFile=$DIR/log/slurmdbd.log
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=$MYSQL_PORT
StorageUser=slurm
StoragePass=$DB_PASS
StorageLoc=slurm_acct_db
CONF
  chmod 600 "$DIR/slurmdbd.conf"
  ACCT="AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=$ADDR
AccountingStoragePort=$DBD_PORT
AccountingStoragePass=$DIR/munge/munge.sock
JobAcctGatherType=jobacct_gather/linux
JobAcctGatherFrequency=30"
fi

C="$DIR/slurm.conf"
cat > "$C" <<CONF
ClusterName=hpctrainer
SlurmctldHost=$(hostname -s)($ADDR)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# cred_expire (minimum 5) is also how long a requeued job waits before it may start again
AuthInfo=socket=$DIR/munge/munge.sock,cred_expire=5
SlurmctldPort=$CTLD_PORT
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool/%n
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd-%n.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd-%n.log
# bind to SlurmctldHost/NodeAddr/DbdAddr (127.0.0.1), not to every interface
CommunicationParameters=NoInAddrAny,NoCtldInAddrAny
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
MailProg=/bin/true
SwitchType=switch/none
SchedulerType=sched/backfill
SchedulerParameters=batch_sched_delay=0,sched_min_interval=0,sched_interval=2,bf_interval=1
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
$ACCT
JobCompType=jobcomp/none
SlurmdParameters=config_overrides
ReturnToService=2
# state is wiped at every start: a time-based first id keeps ids from colliding with old outputs
FirstJobId=$(( ($(date +%s) % 5000000) * 10 + 1 ))
MinJobAge=300
# SIGTERM to SIGKILL, and the preemption grace below: short, the test jobs checkpoint in under a second
KillWait=5
InactiveLimit=0
Waittime=0
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
CONF
[ "$GPUS" -gt 0 ] && echo "GresTypes=gpu" >> "$C"
for i in $(seq 1 "$NNODES"); do
  gres=""; [ "$GPUS" -gt 0 ] && gres="Gres=gpu:$GPUS"
  echo "NodeName=$PREFIX$i NodeAddr=$(node_addr "$i") Port=$((SLURMD_PORT0+i-1)) CPUs=$CPUS RealMemory=16000 $gres State=UNKNOWN" >> "$C"
done
# debug (the default, preemptible), high (preempts debug), gpu (the partition the docs' commands name)
cat >> "$C" <<CONF
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP PriorityTier=1 PreemptMode=REQUEUE GraceTime=5
PartitionName=high Nodes=ALL MaxTime=INFINITE State=UP PriorityTier=2 PreemptMode=OFF
PartitionName=gpu Nodes=ALL MaxTime=INFINITE State=UP PriorityTier=1 PreemptMode=OFF
CONF
{ echo "AutoDetect=off"; [ "$GPUS" -gt 0 ] && echo "Name=gpu File=$DIR/fakegpu/nvidia[0-$((GPUS-1))]"; } > "$DIR/gres.conf"
echo "export SLURM_CONF=$C" > "$DIR/env.sh"
export SLURM_CONF="$C"

if [ "$ACCOUNTING" = 1 ]; then
  slurmdbd
  for _ in $(seq 1 100); do timeout 5 sacctmgr -n list cluster >/dev/null 2>&1 && break; sleep 0.1; done
  timeout 20 sacctmgr -i add cluster hpctrainer >/dev/null
fi
# With NETNS=1 each daemon runs with a hosts file of its own (in a mount namespace of its own) that names this host
# by the daemon's address: NoInAddrAny/NoCtldInAddrAny bind to what the host's name resolves to (else 127.0.0.1,
# unreachable across namespaces), and a node's tasks bind gloo to it too. The host's own lines are left out:
# getaddrinfo would sort a loopback address first.
as_host() {  # ADDR CMD...: CMD where this host's name is ADDR
  local hosts="$DIR/hosts-$1"
  { echo "$1 $(hostname -s) $(hostname)"
    awk -v s="$(hostname -s)" -v l="$(hostname)" '{ for (f = 2; f <= NF; f++) if ($f == s || $f == l) next } 1' \
        /etc/hosts; } > "$hosts"
  shift
  # shellcheck disable=SC2016  # (the inner shell expands them)
  unshare --mount --propagation private sh -c 'mount --bind "$1" /etc/hosts && shift && exec "$@"' sh "$hosts" "$@"
}
if [ "$NETNS" = 1 ]; then as_host "$ADDR" slurmctld -f "$C"; else slurmctld -f "$C"; fi
for i in $(seq 1 "$NNODES"); do
  mkdir -p "$DIR/spool/$PREFIX$i"
  # nsenter, not `ip netns exec`: that remounts /sys, and slurmd wants the cgroup file system under it
  if [ "$NETNS" = 1 ]; then as_host "$NET.$i.2" nsenter --net="/run/netns/hpc-$PREFIX$i" slurmd -f "$C" -N "$PREFIX$i"
  else slurmd -f "$C" -N "$PREFIX$i"; fi
done

idle=0; deadline=$(( $(date +%s) + 60 ))
while [ "$(date +%s)" -lt "$deadline" ]; do
  idle=$(timeout 10 sinfo -h -N -o '%N %T' 2>/dev/null | sort -u | awk '$2=="idle"' | wc -l || true)
  [ "$idle" -ge "$NNODES" ] && break
  sleep 0.1
done
if [ "$idle" -lt "$NNODES" ]; then echo "cluster did not come up; logs in $DIR/log" >&2; sinfo -N >&2 || true; false; fi
trap - ERR
echo "slurm cluster up in $(echo "$(date +%s.%N) - $T0" | bc)s: $NNODES nodes x $CPUS CPUs x $GPUS fake GPUs, accounting=$ACCOUNTING"
echo "use it: source $DIR/env.sh   (or: eval \"\$(make -s slurm-env)\")"
