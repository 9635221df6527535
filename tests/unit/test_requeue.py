"""`scontrol requeue` from the trainer (trainer/engine/preemption.py requeue_slurm_job), with a stand-in scontrol on
PATH: Slurm's requeue SIGTERMs every process of the job, the scontrol that asked for it too. Seen in CI: scontrol
killed so before it exited 0, the trainer logged "scontrol requeue JOB failed: " with no reason, though the job was
requeued. A real cluster's requeue is tests/slurm/test_sbatch.py's."""
from __future__ import annotations

import logging
import sys

import pytest

from trainer.engine.preemption import requeue_slurm_job

# scontrol as Slurm's requeue leaves it: the job's processes, this one too, get SIGTERM while it runs
FAKE = """#!{python}
import os, signal, sys, time
{body}
"""


def fake_scontrol(tmp_path, monkeypatch, body: str):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    exe = bin_dir / "scontrol"
    exe.write_text(FAKE.format(python=sys.executable, body=body))
    exe.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
    return tmp_path / "asked"


def test_scontrol_signalled_by_the_requeue_it_asked_for_still_answers(tmp_path, monkeypatch, caplog):
    asked = fake_scontrol(tmp_path, monkeypatch, f"""
os.kill(os.getpid(), signal.SIGTERM)          # what Slurm does to the job's processes
time.sleep(0.2)
open({str(tmp_path / 'asked')!r}, 'w').write(' '.join(sys.argv[1:]))
""")
    with caplog.at_level(logging.INFO):
        assert requeue_slurm_job("4242") is True
    assert asked.read_text() == "requeue 4242"
    assert "requeued Slurm job 4242" in caplog.text
    # the trainer's own SIGTERM handling is untouched: the mask was the child's alone
    import signal
    assert signal.SIGTERM not in signal.pthread_sigmask(signal.SIG_BLOCK, set())


@pytest.mark.parametrize("body, says", [
    ("print('slurm_requeue error: Job is not requeueable', file=sys.stderr); sys.exit(1)",
     "scontrol requeue 4242 failed (exit 1): slurm_requeue error: Job is not requeueable"),
    ("os.kill(os.getpid(), signal.SIGKILL)",
     "scontrol requeue 4242 was stopped by SIGKILL before it answered: whether the job is requeued, "
     "`squeue -j 4242` says"),
])
def test_a_failed_requeue_says_why(tmp_path, monkeypatch, caplog, body, says):
    fake_scontrol(tmp_path, monkeypatch, body)
    assert requeue_slurm_job("4242") is False
    assert says in caplog.text
