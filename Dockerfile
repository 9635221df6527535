# syntax=docker/dockerfile:1
# GPU image of the suite: CUDA 12.6, cuDNN 9, NCCL and torch 2.13.0 from the pinned official PyTorch
# image; every other Python dependency pinned with hashes in docker/requirements.lock.
#   make image                                   # docker build -t hpc-trainer:0.1.0 .
#   docker run --gpus all --ipc=host hpc-trainer:0.1.0 python -m trainer doctor
#   docker run --gpus all --ipc=host -v "$PWD:/work" hpc-trainer:0.1.0 \
#       torchrun --nproc_per_node 4 -m trainer train --config configs/sasrec/ml-1m.yaml data.path=data/ml-1m
# Pins must agree with apptainer.def, the Makefile (TORCH_VERSION) and the lock: tests/container checks it.
ARG BASE_IMAGE=pytorch/pytorch:2.13.0-cuda12.6-cudnn9-runtime@sha256:6acf597eeb8e376a96580dde4952f37cc017fef732bb40bfc73f28f25e3f64b4

FROM ${BASE_IMAGE} AS builder
# the base's Python minor version: the stand-in of make test-image has the same; checked, not assumed
ARG PYTHON_MINOR=3.11
WORKDIR /src
RUN python -c "import sys; v = '%d.%d' % sys.version_info[:2]; \
sys.exit(0 if v == '${PYTHON_MINOR}' else f'base image has Python {v}, this Dockerfile expects ${PYTHON_MINOR}')"
COPY docker/requirements.lock docker/requirements.lock
# --system-site-packages: torch stays the base image's own build (CUDA-matched), not a PyPI wheel
RUN python -m venv --system-site-packages /opt/venv \
 && /opt/venv/bin/pip install --no-cache-dir --require-hashes -r docker/requirements.lock
# The kernels' compiler (built below) from the base's own distribution, whose versions differ between the base
# and its stand-in; Python's headers too where the base's Python lacks them (a distribution's python3 without
# python3-dev). A layer before the sources: a change to them rebuilds the kernels, not the compiler's install.
# hadolint ignore=DL3008,SC2086
RUN pkgs="g++ ninja-build" \
 && { python -c "import os, sys, sysconfig; sys.exit(not os.path.exists(sysconfig.get_paths()['include'] + '/Python.h'))" \
      || pkgs="$pkgs python3-dev"; } \
 && apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends $pkgs \
 && rm -rf /var/lib/apt/lists/*
COPY pyproject.toml README.md ./
COPY trainer trainer
COPY hpc hpc
# no build isolation: build with the pinned setuptools from the lock, not an unpinned download. Then the C++ CPU
# kernels for the portable target (-march=x86-64-v3: any AVX2 node), so that no run in the image waits on a
# compiler (the runtime stage has none); a node without AVX2 runs the PyTorch paths, with a warning. The build
# cache mount outlives this layer: a rebuild for a change to the Python alone copies the kernels, compiling
# nothing (their builds are keyed by sources, torch, flags, compiler and Python).
RUN --mount=type=cache,target=/var/cache/hpc-trainer-kernels \
    /opt/venv/bin/pip install --no-cache-dir --no-deps --no-build-isolation . \
 && TRAINER_EXTENSIONS_DIR=/opt/hpc-trainer/extensions /opt/venv/bin/python -m trainer.native build --portable-only \
      --strict --cache /var/cache/hpc-trainer-kernels
# torch (and its torchrun script) is the base's: a torchrun of the venv's own, first on PATH, starts the
# workers with the venv's python, which sees the trainer (the base's would not: "No module named trainer")
RUN printf '#!/opt/venv/bin/python\nimport sys\nfrom torch.distributed.run import main\nsys.exit(main())\n' \
      > /opt/venv/bin/torchrun \
 && chmod 755 /opt/venv/bin/torchrun

FROM ${BASE_IMAGE}
ARG BASE_IMAGE
ARG UID=1000
# what the image pins; base.name is the base it was really built on (make test-image: the local stand-in)
LABEL org.opencontainers.image.title="hpc-trainer" \
      org.opencontainers.image.version="0.1.0" \
      org.opencontainers.image.base.name="${BASE_IMAGE}" \
      io.hpc-trainer.torch="2.13.0" io.hpc-trainer.cuda="12.6" io.hpc-trainer.cudnn="9" \
      io.hpc-trainer.python="3.11"
# the kernels' OpenMP runtime (libgomp1: the compiler's, not torch's bundled copy); /work belongs to the user:
# `runs/` is writable there without a mounted volume (WORKDIR alone makes it root's under some builders).
# Before the builder's copies, which change with every source change: a rebuild does not install it again.
# hadolint ignore=DL3008
RUN apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends libgomp1 \
 && rm -rf /var/lib/apt/lists/* \
 && useradd --create-home --uid "${UID}" --shell /bin/bash trainer \
 && install -d -o "${UID}" -g "${UID}" /work
COPY configs /opt/hpc-trainer/configs
COPY slurm /opt/hpc-trainer/slurm
COPY --from=builder /opt/venv /opt/venv
COPY --from=builder /opt/hpc-trainer/extensions /opt/hpc-trainer/extensions
ENV PATH=/opt/venv/bin:$PATH \
    TRAINER_EXTENSIONS_DIR=/opt/hpc-trainer/extensions \
    HPC_TRAINER_BASE_IMAGE=${BASE_IMAGE} \
    PYTHONUNBUFFERED=1 \
    TORCH_NCCL_ASYNC_ERROR_HANDLING=1 \
    NCCL_DEBUG=WARN
USER ${UID}
WORKDIR /work
HEALTHCHECK NONE
CMD ["python", "-m", "trainer", "doctor"]
