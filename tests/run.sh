#!/usr/bin/env bash
# make test: pytest ARGS in two halves side by side, the tests that use the local Slurm cluster
# (TEST_PART=cluster; they mostly wait on the scheduler: requeue delays, signals, time limits) and the rest
# (TEST_PART=rest, on the CPUs; TEST_WORKERS=N > 1: in N pytest-xdist workers, the long CPU tests marked
# beside_cluster then among them; tests that share a fixed resource name an xdist_group). The cluster half's report
# follows the other's; the exit status is the worse.
#   bash tests/run.sh .venv/bin/python -rs -m "not image"
#   TEST_WORKERS=3 bash tests/run.sh .venv/bin/python -rs     (the rest half in three workers)
set -u
py=$1
shift
log=$(mktemp "${TMPDIR:-/tmp}/pytest-cluster.XXXXXX")
TEST_PART=cluster "$py" -m pytest "$@" > "$log" 2>&1 &
cluster_pid=$!
trap 'kill "$cluster_pid" 2>/dev/null; rm -f "$log"' EXIT
export TEST_WORKERS=${TEST_WORKERS:-1}     # both halves read it: it decides where beside_cluster tests run
spread=()
[ "$TEST_WORKERS" -gt 1 ] && spread=(-n "$TEST_WORKERS" --dist loadgroup)
TEST_PART=rest "$py" -m pytest "${spread[@]}" "$@"
rest=$?
wait "$cluster_pid"
cluster=$?
echo
echo "---------------------------------- the tests on the local Slurm cluster (run beside the above)"
cat "$log"
# 5: nothing collected in that half (an argument selected tests of the other half only)
if [ "$rest" = 5 ] && [ "$cluster" = 5 ]; then exit 5; fi
[ "$rest" = 5 ] && rest=0
[ "$cluster" = 5 ] && cluster=0
exit $(( rest > cluster ? rest : cluster ))
