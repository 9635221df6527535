"""Issue 86 point 4, the GPU's part (marked gpu; bench/gpu_check.sh step 13): the commands of the README and the
guides in a ```bash gpu block (docs/gpu.md's "Fast on a GPU", the video guide's three GPUs) run on a CUDA device as
a user types them, in a sandbox laid out as the repository root with the data they name (tests/pages.py), each
training budgeted to 2 steps (`make bench-gpu`'s recipe is the script's step 1). A command that asks for more GPUs
than the machine has (`--gpu-ids 0,1`, `--nproc-per-node 3`) is skipped, the reason printed. Where torch sees no CUDA
device every one is skipped, the reason printed."""
from __future__ import annotations

import re

import pytest
import torch

from tests.pages import PageCommand, page_commands, run_here, sandbox
from tests.procs import clean_env

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="no CUDA device here (torch.cuda.is_available() is False): bench/gpu_check.sh step 13 runs these on a GPU")]

ON_GPU = [c for c in page_commands() if "gpu" in c.needs and not c.needs & {"cluster", "container", "network"}]


def gpus_asked(command: PageCommand) -> int:
    """How many GPUs the command needs at least: --gpu-ids' count, --nproc-per-node's, else one."""
    ids = re.search(r"--gpu-ids (\S+)", command.text)
    procs = re.search(r"--nproc[-_]per[-_]node[ =](\d+)", command.text)
    return max(len(ids.group(1).split(",")) if ids else 1, int(procs.group(1)) if procs else 1)


def test_the_pages_mark_their_gpu_commands():
    assert len(ON_GPU) >= 3 and any(c.page == "docs/gpu.md" for c in ON_GPU)


@pytest.mark.parametrize("command", ON_GPU, ids=lambda c: c.where)
def test_a_gpu_command_of_the_pages_runs_on_this_gpu(command: PageCommand, tmp_path):
    if gpus_asked(command) > torch.cuda.device_count():
        pytest.skip(f"{command.where} asks for {gpus_asked(command)} GPUs, this machine has "
                    f"{torch.cuda.device_count()}")
    if command.program == "make":
        pytest.skip(f"{command.where}: {command.text}: its recipe, python -m bench.gpu, is bench/gpu_check.sh's step 1 "
                    f"(the device machine has no .venv for make)")
    work = sandbox(tmp_path)
    env = clean_env()
    env.pop("TRAINER_PLUGINS")
    code, out = run_here(command, work, env)
    assert code == 0, f"{command.where}: {command.text}\n{out[-3000:]}"
    if command.program == "trainer":
        assert "training completed" in out and "device=cuda" in out, out[-3000:]
