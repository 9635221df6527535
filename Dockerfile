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
WORKDIR /src
COPY docker/requirements.lock docker/requirements.lock
# --system-site-packages: torch stays the base image's own build (CUDA-matched), not a PyPI wheel
RUN python -m venv --system-site-packages /opt/venv \
 && /opt/venv/bin/pip install --no-cache-dir --require-hashes -r docker/requirements.lock
COPY pyproject.toml README.md ./
COPY trainer trainer
COPY hpc hpc
# no build isolation: build with the pinned setuptools from the lock, not an unpinned download
RUN /opt/venv/bin/pip install --no-cache-dir --no-deps --no-build-isolation .

FROM ${BASE_IMAGE}
ARG UID=1000
LABEL org.opencontainers.image.title="hpc-trainer" \
      org.opencontainers.image.version="0.1.0" \
      org.opencontainers.image.base.name="pytorch/pytorch:2.13.0-cuda12.6-cudnn9-runtime" \
      io.hpc-trainer.torch="2.13.0" io.hpc-trainer.cuda="12.6" io.hpc-trainer.cudnn="9"
COPY --from=builder /opt/venv /opt/venv
COPY configs /opt/hpc-trainer/configs
COPY slurm /opt/hpc-trainer/slurm
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    TORCH_NCCL_ASYNC_ERROR_HANDLING=1 \
    NCCL_DEBUG=WARN
RUN useradd --create-home --uid "${UID}" --shell /bin/bash trainer
USER ${UID}
WORKDIR /work
HEALTHCHECK NONE
CMD ["python", "-m", "trainer", "doctor"]
