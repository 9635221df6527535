"""Issue 57: a checkpoint write that fails for want of disk (rank 0 writes) stops every rank with the same one-line
error and exit 4 (resource), which the restart loop never relaunches; before, the other ranks only learnt of it
when their next collective failed."""
import json
import os
import re
import subprocess

import pytest

from tests.conftest import PY, REPO, clean_env, free_port, trainer, wait_all
from tests.timeouts import limit

RUN = ("train", "--recipe", "toy", "--seed", "3", "log.tensorboard=false", "ckpt.every_epochs=1",
       "ckpt.every_steps=0", "model.hidden=2048")
LIMITED = ("import resource, runpy, signal, sys\n"
           "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
           "resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, 100_000))   # a checkpoint no longer fits\n"
           "sys.argv = ['trainer', *sys.argv[1:]]\n"
           "runpy.run_module('trainer', run_name='__main__')\n")


def test_every_rank_stops_with_the_disk_error_and_exit_4(tmp_path):
    run_dir = tmp_path / "run"
    trainer(*RUN, "--epochs", "1", "--run-dir", str(run_dir))
    port = free_port()
    procs = [subprocess.Popen([PY, "-c", LIMITED, *RUN, "--epochs", "3", "--run-dir", str(run_dir), "--resume",
                               "auto"], cwd=REPO, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              env=clean_env(RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                                            MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)))
             for r in range(2)]
    results = wait_all(procs, timeout=limit("runs"))
    for rank, (code, err) in enumerate(results):
        assert code == 4 and "Traceback" not in err, f"rank {rank}: {code}\n{err[-3000:]}"
        assert re.search(r"error: could not write checkpoint .*checkpoints/\w+\.pt: File too large \(errno EFBIG\); "
                         r"[\d.]+ [GM]iB free there", err), err[-2000:]


FULL = ("train", "--recipe", "toy", "--seed", "3", "log.tensorboard=false", "ckpt.every_steps=0",
        "log.every_steps=1", "--epochs", "8")


@pytest.fixture
def small_fs(tmp_path):
    """A tmpfs with one page (4 KiB) left: mounted here, since a test cannot fill the machine's own disk."""
    where = tmp_path / "fs"
    where.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(where)]).returncode:
        pytest.skip("mounting a tmpfs needs root (CI runs as root)")
    (where / "fill").write_bytes(b"\0" * (60 << 10))
    yield where
    subprocess.run(["umount", "-l", str(where)])


@pytest.mark.parametrize("target", ["metrics.jsonl", "train.log"])
def test_a_full_disk_under_a_log_stops_every_rank_with_exit_4_naming_the_file(tmp_path, small_fs, target):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / target).symlink_to(small_fs / target)         # only that file lives on the full file system
    port = free_port()
    procs = [subprocess.Popen([PY, "-m", "trainer", *FULL, "--run-dir", str(run_dir)], cwd=REPO, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              env=clean_env(RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                                            MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)))
             for r in range(2)]
    said = []
    for rank, (code, err) in enumerate(wait_all(procs, timeout=limit("runs"))):
        assert code == 4 and "Traceback" not in err, f"rank {rank}: {code}\n{err[-3000:]}"
        said.append(re.search(r"error: (could not write \w+ .*)", err).group(1))
    assert said[0] == said[1] and f"{target}: No space left on device (errno ENOSPC); " in said[0]
    assert re.search(r"; \d+ KiB free there", said[0]) and "0.0 MiB" not in said[0]
    records = [json.loads((run_dir / "exits" / f"rank-{r}.json").read_text()) for r in (0, 1)]
    assert [(r["code"], r["kind"]) for r in records] == [(4, "resource"), (4, "resource")]
    assert records[0]["cause"] == records[1]["cause"]
    if target == "metrics.jsonl":       # space again: the resume sets a cut-off record aside and goes on
        cut = (small_fs / target).read_bytes()
        (run_dir / target).unlink()
        (run_dir / target).write_bytes(cut)
        trainer(*FULL, "--run-dir", str(run_dir), "--resume", "auto")
        assert not (run_dir / target).read_bytes()[len(cut):].startswith(b"{") or cut.endswith(b"\n")
        report = trainer("doctor", "--run", str(run_dir)).stdout
        assert "damaged" not in report and "metrics: " in report
        if not cut.endswith(b"\n"):
            assert (run_dir / "metrics.jsonl.damaged").read_bytes().rstrip(b"\n") == cut[cut.rfind(b"\n") + 1:]
