"""Issue 57: a checkpoint write that fails for want of disk (rank 0 writes) stops every rank with the same one-line
error and exit 4 (resource), which the restart loop never relaunches; before, the other ranks only learnt of it
when their next collective failed."""
import re
import subprocess

from tests.conftest import PY, REPO, clean_env, free_port, trainer, wait_all

RUN = ("train", "--recipe", "toy", "--seed", "3", "train.tensorboard=false", "ckpt.every_epochs=1",
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
    results = wait_all(procs, timeout=180)
    for rank, (code, err) in enumerate(results):
        assert code == 4 and "Traceback" not in err, f"rank {rank}: {code}\n{err[-3000:]}"
        assert re.search(r"error: could not write checkpoint .*checkpoints/\w+\.pt: File too large \(errno EFBIG\); "
                         r"[\d.]+ [GM]iB free there", err), err[-2000:]
