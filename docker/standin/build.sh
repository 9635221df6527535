#!/usr/bin/env bash
# Build the real Dockerfile, unchanged but for its BASE_IMAGE argument, on a stand-in of the pinned
# pytorch/pytorch base made here (no container registry can be reached): Debian bookworm from Debian's
# packages (debootstrap) + Python 3.11 + the pinned torch CPU wheel (docker/standin/Containerfile).
#   bash docker/standin/build.sh                 # -> localhost/hpc-trainer:test   (make test-image runs it)
# Knobs: IMAGE (tag of the result), BASE_IMAGE (build on this base instead of the stand-in),
#   TORCH_VERSION (default: the Makefile's), TORCH_WHEEL (a torch CPU wheel file to use), REBUILD=1.
# Needs root, podman, runc and debootstrap (make test-image installs them with apt-get).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
export CONTAINERS_CONF=${CONTAINERS_CONF:-$ROOT/docker/standin/containers.conf}
TORCH_VERSION=${TORCH_VERSION:-$(sed -n 's/^TORCH_VERSION *?= *//p' "$ROOT/Makefile")}
OS_IMAGE=localhost/hpc-trainer-standin-os:bookworm
STANDIN=localhost/hpc-trainer-standin:py3.11-torch$TORCH_VERSION
IMAGE=${IMAGE:-localhost/hpc-trainer:test}
say() { echo "build.sh: $*" >&2; }

for tool in podman runc debootstrap; do
  command -v "$tool" >/dev/null || { say "$tool not found: apt-get install podman runc debootstrap"; exit 2; }
done

stand_in_os() {      # Debian bookworm with Python 3.11 (the torch wheel's cp311), imported as an image
  local tmp; tmp=$(mktemp -d)
  say "debootstrap bookworm (Python 3.11) -> $OS_IMAGE"
  if ! debootstrap --variant=minbase --include=python3,python3-venv,python3-pip,ca-certificates,python-is-python3 \
      bookworm "$tmp/rootfs" > "$tmp/log" 2>&1; then
    tail -20 "$tmp/log" >&2; rm -rf "$tmp"; say "debootstrap failed (Debian's package archive unreachable?)"; exit 1
  fi
  tar -C "$tmp/rootfs" -c . | podman import -q - "$OS_IMAGE" > /dev/null
  rm -rf "$tmp"
}

stand_in() {         # + the pinned torch CPU wheel and the build host's CA bundle
  local ctx wheel cert; ctx=$(mktemp -d)
  if [ -n "${TORCH_WHEEL:-}" ]; then
    cp "$TORCH_WHEEL" "$ctx/"
  else
    "${PYTHON:-python3}" -m pip download -q --no-deps --only-binary=:all: --python-version 3.11 \
      --platform manylinux_2_28_x86_64 -d "$ctx" "torch==$TORCH_VERSION"
  fi
  wheel=$(find "$ctx" -name 'torch-*.whl' | head -1)
  case "$wheel" in
    *+cpu-cp311-*) ;;
    *) say "no torch $TORCH_VERSION CPU wheel for Python 3.11 (got: ${wheel:-none}); set TORCH_WHEEL=FILE"
       rm -rf "$ctx"; exit 2 ;;
  esac
  cert=${PIP_CERT:-/etc/ssl/certs/ca-certificates.crt}
  cp "$cert" "$ctx/ca-bundle.crt"
  cp "$ROOT/docker/standin/Containerfile" "$ctx/"
  say "stand-in base $STANDIN ($(basename "$wheel"))"
  podman build -q --network host --build-arg OS_IMAGE="$OS_IMAGE" -t "$STANDIN" "$ctx" > /dev/null
  rm -rf "$ctx"
}

replace() {          # build with "$@", then drop the image the tag named before (if nothing else uses it)
  local tag=$1 old; shift
  old=$(podman image inspect --format '{{.Id}}' "$tag" 2>/dev/null || true)
  "$@"
  if [ -n "$old" ] && [ "$old" != "$(podman image inspect --format '{{.Id}}' "$tag")" ]; then
    podman rmi "$old" > /dev/null 2>&1 || true
  fi
}

if [ -z "${BASE_IMAGE:-}" ]; then
  BASE_IMAGE=$STANDIN
  if [ -n "${REBUILD:-}" ] || ! podman image exists "$OS_IMAGE"; then replace "$OS_IMAGE" stand_in_os; fi
  if [ -n "${REBUILD:-}" ] || ! podman image exists "$STANDIN"; then replace "$STANDIN" stand_in; fi
fi
if ! podman image exists "$BASE_IMAGE"; then
  say "base image $BASE_IMAGE is not in podman's image store and no registry can be reached here."
  say "HINT: leave BASE_IMAGE unset to build the local stand-in, or load the base first (podman load -i FILE)."
  exit 2
fi
say "Dockerfile on $BASE_IMAGE -> $IMAGE"
# each rebuild would otherwise leave the last image (1.7 GB) behind, untagged
replace "$IMAGE" podman build --network host --build-arg BASE_IMAGE="$BASE_IMAGE" -t "$IMAGE" "$ROOT"
