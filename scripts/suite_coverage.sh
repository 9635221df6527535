#!/usr/bin/env bash
# Line and branch coverage of trainer/, hpc/ and bench/ over the whole suite (make test, the image's tests left out),
# every Python process of the checkout's venv counted: pytest-xdist workers, ranks, launchers, Slurm jobs (a .pth
# file starts coverage.py in each when COVERAGE_PROCESS_START names the settings; os._exit saves first). Issue 84's
# before/after figure: the same script over two checkouts (a checkout's own make test, whatever its layout).
#   bash scripts/suite_coverage.sh /work/clone-of-306df1d /tmp/before.json
#   bash scripts/suite_coverage.sh . /tmp/after.json
set -uo pipefail
repo=$(cd "${1:-.}" && pwd)
data=${TMPDIR:-/tmp}/suite-coverage.$(basename "$repo")     # outside the checkout: tests check it unchanged
out=$(realpath -m "${2:-$data.json}")
cd "$repo" || exit 1
make -s setup kernels >/dev/null || exit 1
.venv/bin/python -m pip install -q coverage==7.18.0 || exit 1
site=$(.venv/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
rm -rf "$data" && mkdir -p "$data"
cat > "$data/settings.ini" <<SETTINGS
[run]
branch = True
parallel = True
source = $repo/trainer, $repo/hpc, $repo/bench
data_file = $data/data
patch = _exit
disable_warnings = no-data-collected, module-not-imported, module-not-measured
SETTINGS
echo "import os, coverage; os.environ.get('COVERAGE_PROCESS_START') and coverage.process_startup()" \
  > "$site/zz_suite_coverage.pth"
trap 'rm -f "$site/zz_suite_coverage.pth"' EXIT
start=$(date +%s)
COVERAGE_PROCESS_START=$data/settings.ini make test
code=$?
echo "suite-coverage: make test exited $code in $(( $(date +%s) - start )) s"
py=$repo/.venv/bin/python
cd "$data" && $py -m coverage combine --rcfile=settings.ini -q . && \
  $py -m coverage json --rcfile=settings.ini -q -o "$out" && \
  $py -m coverage report --rcfile=settings.ini --format=total --precision=2 | \
  sed 's/^/suite-coverage: total (lines and branches) % /'
$py - "$out" "$code" <<'PY'
import json, sys
totals = json.load(open(sys.argv[1]))["totals"]
print(f"suite-coverage: lines {totals['covered_lines']}/{totals['num_statements']}, branches "
      f"{totals['covered_branches']}/{totals['num_branches']}, make test exit {sys.argv[2]}")
PY
exit "$code"
