#!/usr/bin/env bash
# The load-proof check of the tests that judge a speed or a time (marker `timing`, issue 84): ROUNDS runs in a row
# (default 5) of `pytest -m timing`, with one busy loop per core beside them the whole time (LOOPS=0: idle). Every
# round must pass; each round's outcome and duration is printed as one line at the end.
#   bash tests/under_load.sh .venv/bin/python 5            (make test-under-load)
#   LOOPS=0 bash tests/under_load.sh .venv/bin/python 1 -k stragglers
set -u
py=$1
rounds=${2:-5}
shift $(( $# >= 2 ? 2 : 1 ))
loops=${LOOPS:-$(nproc)}
busy=()
for (( i = 0; i < loops; i++ )); do
  taskset -c "$(( i % $(nproc) ))" bash -c 'while :; do :; done' &
  busy+=("$!")
done
trap 'kill "${busy[@]}" 2>/dev/null' EXIT
summary=()
worst=0
for (( r = 1; r <= rounds; r++ )); do
  start=$(date +%s)
  "$py" -m pytest -rs -m timing -p no:cacheprovider "$@"
  code=$?
  took=$(( $(date +%s) - start ))
  summary+=("under load ($loops busy loop(s)): round $r of $rounds: exit $code in ${took}s")
  (( code > worst )) && worst=$code
done
printf '%s\n' "${summary[@]}"
exit "$worst"
