"""doctor checks the rendezvous port under every launcher (on main only under Slurm and submitit)."""
import socket
import subprocess

from tests.conftest import PY, REPO, clean_env, free_port, trainer
from tests.timeouts import limit
from trainer.cli.doctor import port_check
from trainer.distributed.environment import LocalEnvironment, TorchrunEnvironment


def test_under_torchrun_every_rank_reaches_the_agent_store():
    proc = subprocess.run([PY, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                           str(free_port()), "-m", "trainer", "doctor"], cwd=REPO, env=clean_env(),
                          capture_output=True, text=True, timeout=limit("runs"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "[OK] rendezvous store 127.0.0.1:" in proc.stdout and "reachable" in proc.stdout
    assert "all_reduce via shared memory: sum=3.0 (expected 3.0)" in proc.stdout


def test_an_unreachable_store_under_torchrun_is_named():
    port = free_port()                                   # nothing listens there
    env = TorchrunEnvironment(dict(RANK="1", LOCAL_RANK="1", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                                   MASTER_PORT=str(port), TORCHELASTIC_RUN_ID="x"))
    what, problem = port_check(env)
    assert what == f"rendezvous store 127.0.0.1:{port} reachable"
    assert problem and "cannot be reached" in problem and "HINT" in problem


def test_a_local_run_warns_when_its_port_is_taken():
    with socket.socket() as holder:
        holder.bind(("", 0))
        holder.listen()
        port = holder.getsockname()[1]
        assert port_check(LocalEnvironment({"MASTER_PORT": str(port)}))[1].startswith(f"MASTER_PORT {port}")
        proc = trainer("doctor", env=clean_env(MASTER_PORT=str(port)), check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr          # a warning: one process needs no port
    assert f"[WARN] MASTER_PORT {port} free on" in proc.stdout and "is in use" in proc.stdout
