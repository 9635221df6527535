"""Bad input as a user meets it, through `python -m trainer`: an error naming the file, line, field, key
or variable, exit 2, no traceback, and nothing written. The time to that exit goes into the fault table."""
import time

import pytest
import torch

from tests.conftest import clean_env, record_fault
from tests.inprocess import cli


class Evil:
    def __reduce__(self):
        return (print, ("pwned",))


def _malicious_checkpoint(tmp_path):
    path = tmp_path / "evil.pt"
    torch.save(dict(recipe="toy", model={}, payload=Evil()), path)
    return ["--recipe", "toy", "--resume", str(path)], {}, "is truncated, corrupt or unsafe"


def _malformed_data_line(tmp_path):
    (tmp_path / "u.data").write_text("1\t2\t5\t100\n1\tx\t5\t101\n")
    return (["--recipe", "sasrec", f"data.path={tmp_path / 'u.data'}"], {},
            f"{tmp_path / 'u.data'}:2: field 'item': 'x' is not an integer")


def _out_of_range(tmp_path):
    return ["--recipe", "toy", "train.grad_accum_steps=-5"], {}, "train.grad_accum_steps = -5 is out of range"


def _bad_slurm_count(tmp_path):
    env = dict(SLURM_JOB_ID="5", SLURM_PROCID="0", SLURM_LOCALID="0", SLURM_NODEID="0", SLURM_STEP_ID="0",
               SLURM_NTASKS="two", SLURM_NNODES="1", SLURM_JOB_NODELIST="node1", SLURM_NTASKS_PER_NODE="2")
    return ["--recipe", "toy"], env, "SLURM_NTASKS='two' is not an integer"


CASES = {"malicious pickle as --resume": _malicious_checkpoint,
         "malformed data line (sasrec u.data)": _malformed_data_line,
         "out-of-range config value": _out_of_range,
         "non-integer SLURM_* count": _bad_slurm_count}


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input_stops_at_once_naming_it(tmp_path, name):
    argv, env, message = CASES[name](tmp_path)
    run_dir = tmp_path / "run"
    t0 = time.monotonic()
    proc = cli("train", *argv, "--run-dir", str(run_dir), env=clean_env(**env), check=False)
    took = time.monotonic() - t0
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert message in proc.stderr and "Traceback" not in proc.stderr and "pwned" not in proc.stdout
    assert not (run_dir / "checkpoints").exists()
    record_fault(name, exit_s=round(took, 2), steps_lost=0, outcome="exit 2, the error names it; no checkpoint written")
