#!/usr/bin/env bash
# make test: pytest ARGS in two halves side by side, the tests that use the local Slurm cluster
# (TEST_PART=cluster; they mostly wait on the scheduler: requeue delays, signals, time limits; in
# TEST_CLUSTER_WORKERS pytest-xdist workers, default 2, a file to a worker, sharing the cluster but for the tests
# marked cluster_alone) and the rest (TEST_PART=rest, on the CPUs; in TEST_WORKERS pytest-xdist workers, default 3;
# with 1, one process, the long CPU tests (marker long) then run in the cluster half). Tests that share a fixed
# resource or much memory are marked one_at_a_time, those that judge a time timing (a CPU share of their own).
# The cluster half's report follows the other's; the exit status is the worse. 1 and 1: each half in one process.
#   bash tests/run.sh .venv/bin/python -rs -m "not image"
#   TEST_WORKERS=1 TEST_CLUSTER_WORKERS=1 bash tests/run.sh .venv/bin/python -rs     (each half in one process)
set -u
py=$1
shift
# the rest's workers; both halves read it (before either starts): with 1, the long tests run in the cluster half
export TEST_WORKERS=${TEST_WORKERS:-3}
cluster_workers=${TEST_CLUSTER_WORKERS:-2}
cluster_spread=()
[ "$cluster_workers" -gt 1 ] && cluster_spread=(-n "$cluster_workers" --dist loadfile)
log=$(mktemp "${TMPDIR:-/tmp}/pytest-cluster.XXXXXX")
TEST_PART=cluster "$py" -m pytest "${cluster_spread[@]}" "$@" > "$log" 2>&1 &
cluster_pid=$!
trap 'kill "$cluster_pid" 2>/dev/null; rm -f "$log"' EXIT
spread=()
[ "$TEST_WORKERS" -gt 1 ] && spread=(-n "$TEST_WORKERS" --dist load)
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
