"""What a newcomer meets in the first minutes (issue 73 points 5 and 6), each from the user's side: --config from
another directory, `doctor --run` saying what to run next, a single-process doctor printing no bandwidth, a
download whose host does not resolve saying so, the sbatch scripts finding their repository from any directory."""
from __future__ import annotations

import socket
import subprocess
import urllib.error
from pathlib import Path

import pytest

from tests.conftest import PY, REPO, clean_env
from tests.inprocess import cli
from tests.timeouts import limit
from trainer.data import download as dl


def test_a_repository_config_is_found_from_another_directory(tmp_path):
    proc = subprocess.run([PY, "-m", "trainer", "train", "--config", "configs/sasrec/ml-100k.yaml", "--print-config"],
                          cwd=tmp_path, env=clean_env(), capture_output=True, text=True, timeout=limit("run"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "recipe: sasrec" in proc.stdout
    typo = subprocess.run([PY, "-m", "trainer", "train", "--config", "configs/sasrec/ml-100kk.yaml", "--print-config"],
                          cwd=tmp_path, env=clean_env(), capture_output=True, text=True, timeout=limit("run"))
    assert typo.returncode == 2
    assert f"looked in {tmp_path} and in the repository, {REPO}" in typo.stderr
    assert f"did you mean {REPO / 'configs/sasrec/ml-100k.yaml'}?" in typo.stderr
    (tmp_path / "configs" / "sasrec").mkdir(parents=True)            # the working directory's own comes first
    (tmp_path / "configs" / "sasrec" / "ml-100k.yaml").write_text("recipe: sasrec\ntrain:\n  epochs: 7\n")
    own = subprocess.run([PY, "-m", "trainer", "train", "--config", "configs/sasrec/ml-100k.yaml", "--print-config"],
                         cwd=tmp_path, env=clean_env(), capture_output=True, text=True, timeout=limit("run"))
    assert "epochs: 7" in own.stdout


def test_doctor_run_says_what_to_run_next(tmp_path):
    run = tmp_path / "run"
    cli("train", "--recipe", "toy", "--epochs", "1", "--run-dir", str(run), "log.tensorboard=false",
            "ckpt.every_steps=2")
    done = cli("doctor", "--run", str(run)).stdout
    assert f"next: python -m trainer eval --checkpoint {run}" in done
    (run / "checkpoints" / "final.pt").unlink()                        # as a run cut off before its end
    cut = cli("doctor", "--run", str(run)).stdout
    assert "next: continue it (from step" in cut and f"--run-dir {run} --resume auto" in cut
    assert f"--config {run / 'config.yaml'}" in cut
    for periodic in (run / "checkpoints").glob("step-*.pt"):
        periodic.unlink()                                              # best.pt alone does not resume
    again = cli("doctor", "--run", str(run)).stdout
    assert "next: continue it (from the start: no checkpoint was written)" in again


def test_a_single_process_doctor_prints_no_bandwidth():
    out = cli("doctor", timeout=limit("run")).stdout
    assert "GB/s" not in out.split("all_reduce via", 1)[1].splitlines()[0]
    assert "no bandwidth: one process copies nothing" in out


@pytest.mark.parametrize("reason, expected", [
    (socket.gaierror(-2, "Name or service not known"), "cannot resolve example.invalid"),
    (ConnectionRefusedError(111, "Connection refused"), "example.invalid refused the connection"),
])
def test_no_network_is_named_and_not_called_resumable(tmp_path, reason, expected):
    msg = dl.download_failure("https://example.invalid/ml-100k.zip", tmp_path / "x.part", tmp_path / "x.zip",
                              urllib.error.URLError(reason))
    assert expected in msg and "no network here?" in msg and f"copy it to {tmp_path / 'x.zip'}" in msg
    assert "resume" not in msg


def test_a_cut_transfer_still_resumes(tmp_path):
    part = tmp_path / "x.part"
    part.write_bytes(b"half")
    msg = dl.download_failure("https://example.invalid/x.zip", part, tmp_path / "x.zip", OSError("reset"))
    assert msg.endswith(f"run the same command again to resume from {part}") and "after 4 bytes" in msg


def test_every_sbatch_script_finds_its_repository_from_the_command_slurm_recorded(tmp_path):
    """The line each script runs before sourcing common.sh, with `scontrol show job`'s output as Slurm prints it
    for a script submitted by its absolute path with arguments (a stand-in scontrol: the real one is exercised by
    the jobs in tests/slurm/)."""
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "scontrol").write_text("#!/bin/sh\necho '   Command=/srv/repo/slurm/kgat_2node.sbatch --epochs 1'\n"
                                   "echo '   WorkDir=/home/u/elsewhere'\n")
    (fake / "scontrol").chmod(0o755)
    for script in sorted((REPO / "slurm").glob("*.sbatch")):
        line = next(x for x in script.read_text().splitlines() if x.startswith("TRAINER_HOME=${TRAINER_HOME:-"))
        out = subprocess.run(["bash", "-c", f"set -euo pipefail; unset TRAINER_HOME; {line}; echo $TRAINER_HOME"],
                             env=dict(PATH=f"{fake}:/usr/bin:/bin", SLURM_JOB_ID="7"), capture_output=True,
                             text=True, timeout=limit("short"))
        assert out.stdout.strip() == "/srv/repo", (script.name, out.stderr)
        kept = subprocess.run(["bash", "-c", f"set -euo pipefail; {line}; echo $TRAINER_HOME"],
                              env=dict(PATH=f"{fake}:/usr/bin:/bin", SLURM_JOB_ID="7", TRAINER_HOME="/mine"),
                              capture_output=True, text=True, timeout=limit("short"))
        assert kept.stdout.strip() == "/mine"
    assert Path(REPO / "slurm" / "common.sh").read_text().count("DATA=DIR") == 1      # documented once, in its header


def test_a_long_evaluation_says_how_far_it_is(caplog):
    from trainer.engine.evaluation import EvalProgress
    now = [0.0]
    progress = EvalProgress(100, shown=True, clock=lambda: now[0])
    lines = []
    for _ in range(99):
        now[0] += 1.0                                       # one batch a second: a line every 30 s
        lines.append(progress.step())
    shown = [x for x in lines if x]
    assert shown == [f"evaluating: {k} of 100 batches of this rank's shard ({k}%), {k} s" for k in (30, 60, 90)]
    quiet = EvalProgress(100, shown=False, clock=lambda: now[0])
    now[0] += 100
    assert quiet.step() is None                             # off rank 0: nothing


def test_a_refusal_before_the_run_starts_is_recorded_for_the_restart_loop_which_stops(tmp_path):
    """Under the sbatch scripts (RUN_DIR and TRAINER_ATTEMPT exported by slurm/common.sh) a settings or data refusal
    comes before the run writes its own exit record: the loop read srun's 143 (the TERM sent to the other ranks) as
    a crash and relaunched the refusal twice (seen on the local cluster). Now each rank records it."""
    import json
    import time

    from tests.unit.test_generated_data import ONE_SRUN_TASK
    run = tmp_path / "run"
    run.mkdir()                                                       # common.sh's mkdir -p "$RUN_DIR"
    env = clean_env(**ONE_SRUN_TASK, RUN_DIR=str(run), TRAINER_ATTEMPT="0")
    start = time.time()
    proc = cli("train", "--recipe", "sasrec", "--run-dir", str(run), "data.path=", env=env, check=False)
    assert proc.returncode == 2 and "data.path is empty" in proc.stderr
    record = json.loads((run / "exits" / "rank-0.json").read_text())
    assert record["code"] == 2 and record["kind"] == "usage" and "data.path is empty" in record["cause"]
    decided = subprocess.run([PY, "-m", "trainer.launch.restarts", "decide", "--run-dir", str(run), "--rc", "143",
                              "--attempt", "0", "--max", "2", "--tasks-per-node", "1", "--attempt-start", str(start),
                              "--job-start", str(start), "--job", "5"], cwd=REPO, env=clean_env(),
                             capture_output=True, text=True, timeout=limit("minute"))
    assert decided.stdout.strip() == "stop", decided.stdout + decided.stderr
    plain = tmp_path / "plain"                                        # outside the loop nothing is written
    cli("train", "--recipe", "sasrec", "--run-dir", str(plain), "data.path=",
            env=clean_env(**ONE_SRUN_TASK), check=False)
    assert not plain.exists()
