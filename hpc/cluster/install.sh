#!/usr/bin/env bash
# Install what the local test cluster needs from Debian's packages (root): Slurm 22.05, munge, and
# slurmdbd + MariaDB for accounting (sacct; submitit's job-state watcher uses it).
set -euo pipefail
need=()
for pair in slurmctld:slurm-wlm munged:munge slurmdbd:slurmdbd mariadbd:mariadb-server bc:bc; do
  command -v "${pair%%:*}" >/dev/null 2>&1 || need+=("${pair#*:}")
done
if [ ${#need[@]} -eq 0 ]; then echo "slurm, munge, slurmdbd, mariadb already installed"; exit 0; fi
SUDO=""; [ "$(id -u)" = 0 ] || SUDO=sudo
echo "installing: ${need[*]}"
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
