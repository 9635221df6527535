"""The sbatch scripts' environment knobs (CONFIG, EXTRA, RUN_DIR, IMAGE, DATA, PYTHON) with hostile values:
used literally, never evaluated; control characters refused before srun. The real scripts run in bash
with a stand-in `srun` that records its argument vector (no cluster needed for what the shell does)."""
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO, record_fault
from tests.timeouts import limit

MARK = "$(touch PWNED)"


def run_script(tmp_path, script="sasrec_1node.sbatch", **knobs):
    """(exit code, stderr, srun's argv or None) of `bash slurm/SCRIPT` under a fake job environment."""
    fake = tmp_path / "bin"
    fake.mkdir(exist_ok=True)
    if not (fake / "srun").exists():          # a test may bring its own
        (fake / "srun").write_text('#!/bin/bash\nprintf "%s\\0" "$@" > "$ARGV_OUT"\n')
        (fake / "srun").chmod(0o755)
    out = tmp_path / "argv"
    out.unlink(missing_ok=True)
    env = dict(PATH=f"{fake}:/usr/bin:/bin", HOME=str(tmp_path), SLURM_SUBMIT_DIR=str(tmp_path),
               TRAINER_HOME=str(REPO), SLURM_JOB_ID="77", SLURM_JOB_NODELIST="node1", ARGV_OUT=str(out),
               TERM_HOLD_S="0")
    env.update(knobs)
    proc = subprocess.run(["bash", str(REPO / "slurm" / script)], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=limit("minute"))
    argv = out.read_text().split("\0")[:-1] if out.exists() else None
    return proc.returncode, proc.stderr, argv


def after(argv, flag):
    return argv[argv.index(flag) + 1]


@pytest.mark.parametrize("knob", ["CONFIG", "EXTRA", "RUN_DIR", "IMAGE", "PYTHON", "DATA"])
@pytest.mark.parametrize("value", ["a\n#SBATCH --nodes=64", "x\ntouch PWNED", "a\tb", "a\rb", "a\x1bb"])
def test_control_characters_in_a_knob_stop_the_job_before_srun(tmp_path, knob, value):
    script = "video_1node.sbatch" if knob == "DATA" else "sasrec_1node.sbatch"
    code, err, argv = run_script(tmp_path, script, **{knob: value})
    assert code == 2 and f"common.sh: {knob} holds a control character" in err, err
    assert argv is None and not (tmp_path / "PWNED").exists()
    record_fault("control character in an sbatch knob (CONFIG, EXTRA, RUN_DIR, IMAGE, PYTHON, DATA)", steps_lost=0,
                 outcome="job stops before srun naming the knob (exit 2)")


def test_hostile_values_are_passed_literally_and_never_evaluated(tmp_path):
    image = tmp_path / f"img {MARK}.sif"
    image.write_bytes(b"SIF")
    run_dir = tmp_path / f"runs/a b;{MARK}"
    code, err, argv = run_script(tmp_path, CONFIG=f"/cfg/{MARK}`touch PWNED`.yaml", RUN_DIR=str(run_dir),
                                 EXTRA=f"optim.lr=0.1 {MARK} `touch PWNED` * ;touch PWNED", IMAGE=str(image))
    assert code == 0, err
    assert not (tmp_path / "PWNED").exists()
    assert argv[argv.index("exec"):argv.index("exec") + 6] == ["exec", "--nv", "--bind", str(tmp_path), str(image),
                                                              "python"]
    assert after(argv, "--config") == f"/cfg/{MARK}`touch PWNED`.yaml"
    assert after(argv, "--run-dir") == str(run_dir) and run_dir.is_dir()
    assert argv[-8:] == ["optim.lr=0.1", "$(touch", "PWNED)", "`touch", "PWNED`", "*", ";touch", "PWNED"]


def test_data_and_python_knobs_are_literal(tmp_path):
    python = tmp_path / f"py {MARK}"                       # a wrapper: a symlink would leave the venv behind
    python.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    python.chmod(0o755)
    code, err, argv = run_script(tmp_path, "video_1node.sbatch", DATA=f"/d/{MARK} x", PYTHON=str(python))
    assert code == 0, err
    assert f"data.path=/d/{MARK} x" in argv and argv[1] == str(python)
    assert not (tmp_path / "PWNED").exists() and not os.path.exists(os.path.join(REPO, "PWNED"))


def test_without_python_the_repository_venv_is_used(tmp_path):
    """PYTHON unset and no venv active (PATH's python3 has no torch): the repository's own .venv."""
    venv_python = REPO / ".venv" / "bin" / "python"
    if not venv_python.exists():
        pytest.skip(f"{venv_python} does not exist (make setup creates it)")
    code, err, argv = run_script(tmp_path)
    assert code == 0, err
    assert argv[1] == str(venv_python)


def test_an_interpreter_without_torch_stops_once_before_srun(tmp_path):
    """On main every rank printed `ModuleNotFoundError: No module named 'torch'`."""
    home = tmp_path / "home"
    (home / "slurm").mkdir(parents=True)
    for script in ("common.sh", "sasrec_1node.sbatch"):
        (home / "slurm" / script).write_text((REPO / "slurm" / script).read_text())
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "python3").write_text("#!/bin/sh\nexit 1\n")        # an interpreter without torch
    (bare / "python3").chmod(0o755)
    code, err, argv = run_script(tmp_path, TRAINER_HOME=str(home), PATH=f"{tmp_path}/bin:{bare}:/usr/bin:/bin")
    assert code == 2 and argv is None
    assert "common.sh: python3 cannot import torch and trainer" in err and "PYTHON=/path/to/venv/bin/python" in err


FLAKY_SRUN = ('#!/bin/bash\necho "attempt=$TRAINER_ATTEMPT" >> "$ARGV_OUT.calls"\n'
              'printf "%s\\0" "$@" > "$ARGV_OUT"\n[ "$TRAINER_ATTEMPT" -ge "${FAILS:-1}" ] || exit "${FAIL_CODE:-1}"\n')


@pytest.mark.parametrize("knobs, calls, code, says", [
    ({}, 2, 0, "restart loop: relaunch: retryable failure (relaunch 1 of 2)"),
    ({"FAILS": "9"}, 3, 1, "not relaunched: 2 of MAX_RESTARTS=2 relaunches used in this allocation"),
    ({"MAX_RESTARTS": "0"}, 1, 1, "restart loop: stop: MAX_RESTARTS=0: relaunching is off"),
    ({"FAIL_CODE": "2"}, 1, 2, "restart loop: stop: usage error (exit 2): it would fail the same way again"),
    ({"MAX_RESTARTS": "two"}, 0, 2, "common.sh: MAX_RESTARTS=two: expected a whole number"),
])
def test_the_restart_loop_relaunches_the_step_in_the_shell(tmp_path, knobs, calls, code, says):
    """slurm/common.sh's run_training with a stand-in srun that fails its first FAILS launches (no cluster: what
    the shell does; the cluster tests run real crashes)."""
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "srun").write_text(FLAKY_SRUN)
    (fake / "srun").chmod(0o755)
    rc, err, argv = run_script(tmp_path, RUN_DIR=str(tmp_path / "run"), **knobs)
    launched = (tmp_path / "argv.calls").read_text().split() if calls else []
    assert (rc, launched) == (code, [f"attempt={n}" for n in range(calls)]), err[-3000:]
    assert says in err
    if calls:         # the last launch: the training command into the same run directory, resuming
        assert argv[-2:] == ["--resume", "auto"] and after(argv, "--run-dir") == str(tmp_path / "run")


# a stand-in srun whose first launch dies of a signal (exit 138), writing the agreed checkpoint's marker only where
# that launch checkpointed (MARKS=1): a job requeued after a preemption starts with the earlier marker in RUN_DIR
SIGNALLED_SRUN = ('#!/bin/bash\necho "attempt=$TRAINER_ATTEMPT" >> "$ARGV_OUT.calls"\n'
                  '[ "$TRAINER_ATTEMPT" -ge 1 ] && exit 0\n'
                  '[ "${MARKS:-0}" = 1 ] && echo "SIGUSR1 epoch 0 step 3" > "$RUN_DIR/.preempted"\nexit 138\n')


@pytest.mark.parametrize("marks, calls, says", [
    ("0", 2, "restart loop: relaunch"),
    ("1", 1, "preempted after an agreed checkpoint: Slurm requeues the job, not this loop"),
])
def test_only_this_attempts_signal_checkpoint_stops_the_restart_loop(tmp_path, marks, calls, says):
    """A USR1 that kills a relaunched step before its handlers exist leaves no checkpoint: the marker an earlier
    allocation left (a preemption, then the requeue) must not make the loop stop as if this one had been agreed."""
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "srun").write_text(SIGNALLED_SRUN)
    (fake / "srun").chmod(0o755)
    run = tmp_path / "run"
    run.mkdir()
    (run / ".preempted").write_text("SIGUSR1 epoch 0 step 2\n")         # the earlier allocation's
    rc, err, _ = run_script(tmp_path, RUN_DIR=str(run), MARKS=marks, SLURM_RESTART_COUNT="1")
    launched = (tmp_path / "argv.calls").read_text().split()
    assert launched == [f"attempt={n}" for n in range(calls)], err[-3000:]
    assert says in err, err[-3000:]
