# Set-up, tests, local Slurm cluster and containers. `make test` does everything on a fresh machine.
PY            ?= python3
VENV          ?= .venv
BIN           := $(VENV)/bin
TORCH_VERSION ?= 2.13.0
# where torch comes from: pip's configured index unless set (PyTorch's install page gives one index per build:
# CPU, or a CUDA version); `make setup TORCH_INDEX_URL=...` picks the build
TORCH_INDEX_URL ?=
PYTEST_ARGS   ?=
# pytest-xdist workers of `make test-fast` (these machines: 2 cores)
FAST_WORKERS  ?= 2
BENCH_ARGS    ?=
BENCH_SLURM   ?= 1
# the local cluster's directory: fresh and private at each start (hpc/cluster/where.sh); HPC_CLUSTER_DIR picks one

.PHONY: kernels kernels-portable setup demo bench bench-gpu gpu-carry bench-steps bench-recipes faults-report test test-image test-fast test-under-load lint ruff lock image sif slurm-install slurm-up slurm-down slurm-env clean help

help:
	@echo "make setup        virtual environment in $(VENV) (torch==$(TORCH_VERSION), CPU build where available)"
	@echo "make demo         TiSASRec+mHC, 2-process DDP, on generated data (no download)"
	@echo "make kernels      the C++ CPU kernels now (else a CPU run builds them behind itself, about 3 min)"
	@echo "make kernels-portable  the C++ kernels also for x86-64-v3 (shared homes: other CPU types reuse it)"
	@echo "make bench        the harness: every recipe at 1 and 2 ranks, torchrun/srun (bench/results/harness)"
	@echo "make bench-gpu    one CUDA device: every recipe fp32/bf16/compiled, video MFU (bench/results/gpu-*.json)"
	@echo "make gpu-carry    ml-100k, Beauty and PyAV's wheel for bench/gpu_check.sh on a GPU machine without an index"
	@echo "make bench-steps  ATen ops and host syncs per training step, both paths (bench/results/steps.json)"
	@echo "make bench-recipes  accuracy and speed against the reference implementations (needs ../shared/data)"
	@echo "make faults-report  the fault tests with their time-to-exit figures (bench/results/faults.md)"
	@echo "make test         set up, install Slurm (Debian packages) and run the whole test suite"
	@echo "make test-fast    the quick tests in FAST_WORKERS workers: no cluster, image, long or timing tests"
	@echo "make lint         ruff, shellcheck, hadolint (ruff also runs in make test)"
	@echo "make image / sif  build the Docker / Apptainer image (make lock re-pins docker/requirements.lock)"
	@echo "make slurm-up     start the local Slurm cluster (2 nodes x 4 CPUs x 4 fake GPUs)"
	@echo "make slurm-down   stop it;  eval \"\$$(make -s slurm-env)\" points a shell at it"

$(BIN)/python:
	$(PY) -m venv $(VENV)

# torch is pinned first: an unpinned torch would pull several GB of CUDA wheels. scripts/ticking.py says every 10 s
# that pip still runs. No compiler runs here: a CPU run builds the C++ kernels behind itself when it first needs
# them (trainer/native/background.py) and trains on the PyTorch path meanwhile; `make kernels` builds them now.
$(VENV)/.installed: pyproject.toml | $(BIN)/python
	@$(PY) scripts/ticking.py "make setup: installing torch==$(TORCH_VERSION) (pip)" -- \
	  $(BIN)/pip install -q $(if $(TORCH_INDEX_URL),--index-url $(TORCH_INDEX_URL)) torch==$(TORCH_VERSION)
	@$(PY) scripts/ticking.py "make setup: installing hpc-trainer and its extras (pip)" -- \
	  $(BIN)/pip install -q -e ".[tensorboard,test,bench,video,submit,parquet,mlflow,wandb,search]"
	touch $@

# the C++ extensions now, side by side, each announced with its elapsed time every 10 s (the tests and the
# benchmarks want them from their first step; a user's run does not wait for them); quick once built
kernels: setup
	$(BIN)/python -m trainer.native build

# the C++ kernels for -march=x86-64-v3 as well: one build that compute nodes of other CPU types reuse from a
# shared home directory (TRAINER_EXTENSIONS_DIR on a shared file system)
kernels-portable: kernels
	$(BIN)/python -m trainer.native build --portable

setup: $(VENV)/.installed

demo: setup
	$(BIN)/python -m trainer.cli.demo

# the harness (python -m bench): synthetic data, about 6 minutes on 2 cores; the srun figures need the local
# Slurm cluster, started here unless BENCH_SLURM=0 (it stays up: make slurm-down)
bench: kernels
	@if [ "$(BENCH_SLURM)" = 1 ]; then $(MAKE) -s slurm-up || echo "no local Slurm cluster: srun figures left out"; fi
	$(BIN)/python -m bench $(BENCH_ARGS)

# on a GPU node: about 5 minutes (BENCH_ARGS=--quick: 2-3); ml-100k from ../shared/data or --ml100k DIR
bench-gpu: kernels
	$(BIN)/python -m bench.gpu $(BENCH_ARGS)

bench-steps: kernels
	$(BIN)/python -m bench.steps

# what bench/gpu_check.sh needs on a GPU machine without an index (ignored, never committed: the data's licence
# forbids shipping it): ml-100k, Amazon Beauty and PyAV's wheel for that machine's Python (GPU_PY, default 3.12)
GPU_PY ?= 3.12
gpu-carry: setup
	mkdir -p .gpu-carry/whl
	if [ -f ../shared/data/ml-100k/u.data ]; then cp -r ../shared/data/ml-100k .gpu-carry/; fi
	if [ -f ../shared/data/beauty/beauty.txt ]; then \
		mkdir -p .gpu-carry/beauty && cp ../shared/data/beauty/beauty.txt .gpu-carry/beauty/; fi
	$(BIN)/pip download -q --no-deps --only-binary=:all: --python-version $(GPU_PY) --implementation cp \
		--platform manylinux_2_28_x86_64 -d .gpu-carry/whl 'av>=12,<19'

# accuracy/speed against the reference implementations; the real datasets in ../shared/data (not shipped:
# licences); hours on 2 cores
bench-recipes: kernels
	$(BIN)/python -m bench.sasrec
	$(BIN)/python -m bench.sasrec_stock
	$(BIN)/python -m bench.mhc_cost
	$(BIN)/python -m bench.kgat --data ../shared/data/ml-100k --seeds 2019 1 2
	$(BIN)/python -m bench.kgat --data ../shared/data/ml-100k --seeds 2019 1 2 --section ml100k_original \
	  --extra model.layer_input=raw
	$(BIN)/python -m bench.kgat --scale amazon-book
	$(BIN)/python -m bench.har
	$(BIN)/python -m bench.video

# the fault tests with their measurements recorded: bench/results/faults.{jsonl,md} (the README's fault table)
faults-report: kernels slurm-install
	rm -f bench/results/faults.jsonl
	FAULT_FIGURES=$(CURDIR)/bench/results/faults.jsonl $(BIN)/python -m pytest -q tests/faults \
		tests/distributed/test_resume_and_faults.py tests/unit/test_submit_offline.py tests/slurm/test_restart_loop.py \
		tests/distributed/test_torchrun_restart.py $(PYTEST_ARGS)
	$(BIN)/python -m bench.faults bench/results/faults.jsonl

# tests/run.sh: the tests on the local cluster (mostly waiting on the scheduler) in a pytest beside the rest
test: kernels slurm-install ruff
	bash tests/run.sh $(BIN)/python -rs --durations=30 -m "not image" $(PYTEST_ARGS)

# the real Dockerfile built on a local stand-in of its pinned base (docker/standin/build.sh: Debian packages +
# Python 3.11 + the pinned torch CPU wheel; no registry is reachable here), then run with podman + runc:
# doctor, 2-rank DDP with SIGTERM and a bitwise resume, an sbatch job in the image on 2 nodes (tests marked image)
test-image: kernels slurm-install
	@command -v podman >/dev/null && command -v runc >/dev/null && command -v debootstrap >/dev/null || \
	  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq podman runc debootstrap >/dev/null; }
	PYTHON=$(BIN)/python bash docker/standin/build.sh
	$(BIN)/python -m pytest -rs --durations=5 -m image tests/container $(PYTEST_ARGS)

# the tests that judge a speed or a time (marker timing), five rounds in a row beside one busy loop per core
test-under-load: kernels slurm-install
	bash tests/under_load.sh $(BIN)/python 5 $(PYTEST_ARGS)

# the developer's loop: every test but those of the cluster, the image, long CPU work (marker long: the guides' and
# pages' command runs, benchmarks, compiles) and the verdicts against a time (marker timing), which `make test` runs
test-fast: kernels
	$(BIN)/python -m pytest -rs -n $(FAST_WORKERS) --dist load -m "not slurm and not image and not long and not timing" \
	  $(PYTEST_ARGS)

# the Python linter (pinned in the test extra, settings in pyproject.toml); part of `make test`
ruff: setup
	$(BIN)/ruff check .

lint: setup ruff
	$(BIN)/python -m compileall -q trainer hpc tests
	$(BIN)/shellcheck -x slurm/common.sh slurm/*.sbatch hpc/cluster/*.sh .ci/run scripts/*.sh train_*.sh bench/gpu_check.sh
	$(BIN)/hadolint Dockerfile

# docker/requirements.lock: every pip dependency of the images, pinned with hashes (torch is the base image's)
lock: setup
	$(BIN)/pip install -q uv
	$(BIN)/uv pip compile docker/requirements.in --universal --python-version 3.10 --generate-hashes \
		--no-header -o docker/requirements.lock

# container images (need a Docker engine / Apptainer; tests check the recipes statically)
IMAGE_TAG ?= hpc-trainer:0.1.0
image:
	docker build -t $(IMAGE_TAG) .
sif:
	apptainer build hpc-trainer.sif apptainer.def

slurm-install:
	bash hpc/cluster/install.sh

slurm-up: slurm-install
	bash hpc/cluster/start.sh

slurm-down:
	bash hpc/cluster/stop.sh

slurm-env:
	@bash -c 'source hpc/cluster/where.sh; d=$$(cluster_dir); if [ -n "$$d" ]; then echo "export SLURM_CONF=$$d/slurm.conf"; else echo "echo no local cluster: make slurm-up >&2"; fi'

clean:
	rm -rf $(VENV) runs .pytest_cache
