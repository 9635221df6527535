"""The real image (issue 20): the Dockerfile built on the local stand-in of its pinned base by `make test-image`
(docker/standin/build.sh), run with podman + runc as its non-root user. Marked `image`: `make test-image`
builds the image and runs these; `make test` leaves them to it."""
import json
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import torch

from tests.conftest import PY, REPO, assert_bitwise_equal, clean_env, slurm_env, weights
from tests.slurm.test_cluster import wait_job
from tests.timeouts import limit

pytestmark = pytest.mark.image
IMAGE = os.environ.get("HPC_TRAINER_TEST_IMAGE", "localhost/hpc-trainer:test")
CONF = REPO / "docker" / "standin" / "containers.conf"
UID = 1000           # the image's user (Dockerfile ARG UID)
HAR = ("train", "--recipe", "har", "log.tensorboard=false", "model.width=16", "model.channel_width=16",
       "model.head_width=32", "--batch-size", "16", "--seed", "3", "ckpt.every_steps=5")


def podman(*args: str, timeout: float = limit("long"), check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(["podman", *args], env=dict(os.environ, CONTAINERS_CONF=str(CONF)), text=True,
                          capture_output=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"podman {' '.join(args[:3])} ... exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    return proc


@pytest.fixture(scope="module")
def image() -> str:
    if not shutil.which("podman"):
        pytest.skip("podman is not installed: `make test-image` installs it, builds the image and runs these tests")
    if podman("image", "exists", IMAGE, check=False).returncode != 0:
        pytest.skip(f"{IMAGE} is not built: `make test-image` builds it and runs these tests")
    return IMAGE


def writable_dir(path: Path) -> Path:
    """A host directory the image's user can write (it is not root inside)."""
    path.mkdir(parents=True, exist_ok=True)
    os.chown(path, UID, UID)
    return path


def test_doctor_runs_as_the_images_non_root_user_and_reports_the_pins(image):
    proc = podman("run", "--rm", image, "sh", "-c", "id -u && python -m trainer doctor --json")
    uid, report = proc.stdout.split("\n", 1)
    assert uid == str(UID)
    facts = json.loads(next(line for line in report.splitlines() if line.startswith("{")))
    versions = facts["versions"]
    assert versions["torch"].startswith(torch.__version__.split("+")[0]) and versions["python"].startswith("3.11.")
    assert versions["image_base"].startswith("localhost/hpc-trainer-standin:")
    assert versions["cuda"] is None and versions["nccl"] is None      # the CPU stand-in: no CUDA to report
    assert facts["allreduce"]["allreduce_ok"]


def test_labels_record_the_pins_and_agree_with_the_makefile_and_the_dockerfile(image):
    labels = json.loads(podman("image", "inspect", "--format", "{{json .Labels}}", image).stdout)
    make_torch = re.search(r"^TORCH_VERSION\s*\?=\s*(\S+)", (REPO / "Makefile").read_text(), re.M).group(1)
    base = re.search(r"^ARG BASE_IMAGE=pytorch/pytorch:(\S+?)-cuda(\S+?)-cudnn(\d+)-runtime@",
                     (REPO / "Dockerfile").read_text(), re.M)
    assert labels["io.hpc-trainer.torch"] == make_torch == base.group(1)
    assert (labels["io.hpc-trainer.cuda"], labels["io.hpc-trainer.cudnn"]) == (base.group(2), base.group(3))
    assert labels["org.opencontainers.image.base.name"].startswith("localhost/hpc-trainer-standin:")  # really built on
    inside = podman("run", "--rm", image, "python", "-c", "import sys; print('%d.%d' % sys.version_info[:2])")
    assert labels["io.hpc-trainer.python"] == inside.stdout.strip()


def test_training_without_a_mounted_directory_writes_under_the_workdir(image):
    proc = podman("run", "--rm", image, "sh", "-c",
                  "python -m trainer " + " ".join(HAR) + " --epochs 1 --run-dir runs/a && ls runs/a/checkpoints")
    assert "final.pt" in proc.stdout, proc.stderr[-2000:]


def test_ddp_in_the_image_survives_sigterm_and_resumes_bitwise_equal_to_the_run_outside(image, tmp_path):
    """2 ranks (torchrun, gloo) on generated data into a bind-mounted run directory; SIGTERM to the container
    after the first checkpoint; --resume auto in a new container; the final weights equal, bit for bit, the
    same run outside the image (same seed, same CPU torch)."""
    args = (*HAR, "--epochs", "10")
    outside = tmp_path / "outside"
    subprocess.run([PY, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "trainer", *args,
                    "--run-dir", str(outside)], cwd=REPO, env=clean_env(), check=True, capture_output=True,
                   timeout=limit("long"))
    runs = writable_dir(tmp_path / "runs")
    run = ["run", "--rm", "-v", f"{runs}:/runs", "-e", "OMP_NUM_THREADS=1", image, "torchrun",
           "--nproc-per-node", "2", "-m", "trainer", *args, "--run-dir", "/runs/run"]
    name = f"hpc-trainer-test-{os.getpid()}"
    first = subprocess.Popen(["podman", *run[:2], "--name", name, *run[2:]], text=True, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, env=dict(os.environ, CONTAINERS_CONF=str(CONF)))
    deadline = time.monotonic() + limit("run")
    while not list((runs / "run" / "checkpoints").glob("step-*.pt")):
        assert time.monotonic() < deadline and first.poll() is None, "no checkpoint in the container"
        time.sleep(0.05)
    podman("kill", "--signal", "TERM", name)
    _, err = first.communicate(timeout=limit("run"))
    stopped = re.search(r"received SIGTERM: checkpointing at epoch \d+ step (\d+)", err)
    assert stopped and "training completed" not in err, err[-3000:]
    resumed = podman(*run, "--resume", "auto")
    assert f"step-{int(stopped.group(1)):08d}.pt" in resumed.stderr
    assert (runs / "run" / "checkpoints" / "final.pt").stat().st_uid == UID
    assert_bitwise_equal(weights(runs / "run"), weights(outside))


def test_predict_in_the_image_on_two_ranks_writes_the_rows_of_one_process_outside(image, tmp_path):
    """`trainer predict` under torchrun inside the image, on a checkpoint trained outside: the file equals, byte
    for byte, one process's outside it (the same parts: the same batches)."""
    runs = writable_dir(tmp_path / "runs")
    subprocess.run([PY, "-m", "trainer", *HAR, "--epochs", "1", "--run-dir", str(runs / "run")], cwd=REPO,
                   env=clean_env(), check=True, capture_output=True, timeout=limit("long"))
    subprocess.run([PY, "-m", "trainer", "predict", "--checkpoint", str(runs / "run"), "--out",
                    str(tmp_path / "outside.csv"), "--part-size", "32"], cwd=REPO, env=clean_env(), check=True,
                   capture_output=True, timeout=limit("long"))
    for path in runs.rglob("*"):
        os.chown(path, UID, UID)
    podman("run", "--rm", "-v", f"{runs}:/runs", "-e", "OMP_NUM_THREADS=1", image, "torchrun", "--nproc-per-node",
           "2", "-m", "trainer", "predict", "--checkpoint", "/runs/run", "--out", "/runs/labels.csv", "--part-size",
           "32")
    assert (runs / "labels.csv").read_text() == (tmp_path / "outside.csv").read_text()
    assert (runs / "labels.csv").stat().st_uid == UID


def test_a_run_directory_the_container_user_cannot_write_is_a_clear_error(image, tmp_path):
    locked = tmp_path / "root-only"
    locked.mkdir(mode=0o755)
    proc = podman("run", "--rm", "-v", f"{locked}:/runs", image, "python", "-m", "trainer", *HAR, "--epochs", "1",
                  "--run-dir", "/runs/x", check=False)
    assert proc.returncode == 4 and "Traceback" not in proc.stderr, proc.stderr[-2000:]    # resource
    assert "run directory /runs/x is not writable by this user (uid 1000): /runs belongs to uid 0, mode 755" \
        in proc.stderr and "chown 1000" in proc.stderr


def test_a_missing_base_image_is_a_clear_error():
    proc = subprocess.run(["bash", str(REPO / "docker" / "standin" / "build.sh")], capture_output=True, text=True,
                          env=dict(os.environ, BASE_IMAGE="localhost/no-such-base:1"), timeout=limit("minute"))
    assert proc.returncode == 2 and "base image localhost/no-such-base:1 is not in podman's image store" in proc.stderr


def test_a_lock_hash_mismatch_stops_the_build(image, tmp_path):
    """A tampered docker/requirements.lock: pip's --require-hashes refuses the package, the build fails."""
    ctx = tmp_path / "ctx"
    shutil.copytree(REPO, ctx, ignore=shutil.ignore_patterns(".git", ".venv", "runs", "logs", "__pycache__",
                                                             "*.egg-info", "bench", "tests"))
    lock = ctx / "docker" / "requirements.lock"
    text = lock.read_text()
    block = re.match(r"\S[^\n]*\n(?:[ #][^\n]*\n)+", text).group(0)     # the first package and its hashes
    lock.write_text(text.replace(block, re.sub(r"sha256:[0-9a-f]{64}", "sha256:" + "0" * 64, block), 1))
    base = json.loads(podman("image", "inspect", "--format", "{{json .Labels}}", image).stdout)[
        "org.opencontainers.image.base.name"]
    proc = podman("build", "--network", "host", "--build-arg", f"BASE_IMAGE={base}", "-t",
                  "localhost/hpc-trainer:tampered", str(ctx), check=False, timeout=limit("jobs"))
    assert proc.returncode != 0
    assert "THESE PACKAGES DO NOT MATCH THE HASHES" in proc.stdout + proc.stderr


@pytest.mark.slurm
def test_sbatch_runs_its_tasks_in_the_image_on_two_nodes(image, slurm_cluster, tmp_path):
    """slurm/har_1node.sbatch with CONTAINER_ENGINE=podman IMAGE=...: 2 nodes x 1 task, each `srun`
    task a `podman run` of the image (the stand-in here for apptainer/pyxis on a real cluster)."""
    work = writable_dir(tmp_path / "work")
    run_dir = writable_dir(work / "run")
    env = slurm_env(slurm_cluster, PYTHON=PY, TRAINER_HOME=str(REPO), CONTAINER_ENGINE="podman", IMAGE=image,
                    CONTAINERS_CONF=str(CONF), RUN_DIR=str(run_dir), EXTRA="data.path= data.synthetic=true "
                    "model.width=16 model.channel_width=16 model.head_width=32 log.tensorboard=false",
                    OMP_NUM_THREADS="1")
    out = subprocess.run(["sbatch", "--parsable", "-N2", "--ntasks-per-node=1", "--gpus-per-node=0",
                          "--cpus-per-task=1", "--time=10", str(REPO / "slurm" / "har_1node.sbatch"),
                          "--epochs", "1"], cwd=work, env=env, text=True, capture_output=True, check=True,
                         timeout=limit("minute"))
    job = out.stdout.strip().split(";")[0]
    info = wait_job(slurm_cluster, job, timeout=limit("long"))
    log = (work / f"har-{job}.out").read_text()
    assert info["JobState"] == "COMPLETED", log[-3000:]
    ckpt = torch.load(run_dir / "checkpoints" / "final.pt", weights_only=True)
    # two ranks, one per node, written by the image's user: the tasks ran inside the image
    assert ckpt["world_size"] == 2 and (run_dir / "checkpoints" / "final.pt").stat().st_uid == UID


def test_the_image_carries_a_portable_kernel_build_that_loads_without_a_compiler(image):
    """Issue 47: no run in the image waits on a compiler (it has none): the kernels were built in the builder stage
    for x86-64-v3 and load from TRAINER_EXTENSIONS_DIR on this (AVX2) CPU; a native build is never attempted."""
    from trainer.native import extensions as native
    if not native.runs_portable():
        pytest.skip(f"this CPU lacks {native.PORTABLE_ARCH}'s instructions: the image's portable build cannot load")
    code = ("from trainer.recipes import kernels; from trainer.distributed import shm\n"
            "from trainer.data import kernels as dk\n"
            "print(kernels.load() is not None, shm.EXT.load() is not None, dk.EXT.load() is not None)\n"
            "print(kernels.EXTENSION.cached()); print(shm.EXT.cached()); print(dk.EXT.cached())")
    proc = podman("run", "--rm", image, "python", "-c", code)
    lines = proc.stdout.strip().splitlines()
    assert lines[0] == "True True True", proc.stdout + proc.stderr[-2000:]
    assert all(line.startswith("/opt/hpc-trainer/extensions/") for line in lines[1:4]), lines
    assert "building" not in proc.stderr and "unavailable" not in proc.stderr, proc.stderr[-2000:]
    assert podman("run", "--rm", image, "sh", "-c", "command -v g++ || echo none").stdout.strip() == "none"


def test_the_pages_docker_commands_run_in_the_image(image, tmp_path):
    """Issue 86 point 4: every `docker run` of the README and the guides, as a user types it, with podman in the
    image this suite built: its `--gpus all` left out (no GPU runtime hook here), its tag this build's, `$(id -u)`,
    `$(id -g)` and `$PWD` as the shell fills them; `$PWD` is a folder with the repository's configs and the data the
    pages name (tests/pages.py), each training budgeted to 2 steps."""
    from tests.pages import budgeted, filled, page_commands, write_data
    commands = [c for c in page_commands() if c.program == "docker" and c.words()[1] == "run"]
    assert len(commands) >= 3
    work = tmp_path / "work"
    work.mkdir()
    shutil.copytree(REPO / "configs", work / "configs")
    write_data(work / "data")
    shell = {"$(id -u)": str(os.getuid()), "$(id -g)": str(os.getgid()), "$PWD": str(work)}
    failed = []
    for command in commands:
        argv = budgeted(filled(command.env_and_argv()[1]))[2:]            # after `docker run`
        if "--gpus" in argv:
            del argv[argv.index("--gpus"):argv.index("--gpus") + 2]
        for i, word in enumerate(argv):
            for name, value in shell.items():
                word = word.replace(name, value)
            argv[i] = IMAGE if re.fullmatch(r"hpc-trainer:[\w.]+", word) else word
        proc = podman("run", "--rm", *argv, timeout=limit("long"), check=False)
        if proc.returncode != 0 or ("-m trainer train" in command.text and "training completed" not in proc.stderr):
            failed.append(f"{command.where}: {command.text}\n  exit {proc.returncode}: {proc.stderr[-1500:]}")
    assert failed == [], "\n".join(failed)
