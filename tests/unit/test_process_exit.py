"""A command's process ends without the interpreter's teardown (trainer/native/process_exit.py): its exit code, its
atexit work and its buffered output are kept; a working thread is waited for."""
import subprocess

from tests.conftest import PY, REPO, clean_env
from tests.timeouts import limit

ENDING = """
import atexit, sys, threading, time
from trainer.native.process_exit import end_process

class Teardown:                      # a module global's finaliser: runs only in the interpreter's teardown
    def __init__(self, path):
        self.path = path

    def __del__(self, open=open):    # (the teardown may have cleared the builtins by then)
        open(self.path, "w").write("ran")

kept = Teardown(sys.argv[1] + "/teardown")
atexit.register(lambda: open(sys.argv[1] + "/atexit", "w").write("ran"))
if sys.argv[2] == "thread":          # a thread that is not a daemon, still at work when the command ends
    threading.Thread(target=lambda: (time.sleep(0.5), open(sys.argv[1] + "/thread", "w").write("done"))).start()
sys.stdout.write("buffered, no newline")
end_process(3)
"""


def ended(tmp_path, case: str) -> tuple[subprocess.CompletedProcess, set[str]]:
    proc = subprocess.run([PY, "-c", ENDING, str(tmp_path), case], cwd=REPO,     # stdout buffered: a pipe
                          env=clean_env(PYTHONUNBUFFERED=""), capture_output=True, text=True, timeout=limit("minute"))
    return proc, {p.name for p in tmp_path.iterdir()}


def test_the_code_atexit_and_buffered_output_are_kept_and_the_teardown_skipped(tmp_path):
    proc, written = ended(tmp_path, "plain")
    assert proc.returncode == 3 and proc.stdout == "buffered, no newline", proc.stderr
    assert written == {"atexit"}             # the module global's finaliser never ran: no teardown


def test_a_working_thread_is_waited_for_through_pythons_own_shutdown(tmp_path):
    proc, written = ended(tmp_path, "thread")
    assert proc.returncode == 3 and proc.stdout == "buffered, no newline", proc.stderr
    assert {"atexit", "thread"} <= written


def test_python_m_trainer_ends_through_it_with_the_commands_code(tmp_path):
    """A refusal's code (2) and its message come through `python -m trainer`, as before."""
    proc = subprocess.run([PY, "-m", "trainer", "train", "--recipe", "toy", "train.no_such_key=1", "--run-dir",
                           str(tmp_path / "run")], cwd=REPO, env=clean_env(), capture_output=True,
                          text=True, timeout=limit("run"))
    assert proc.returncode == 2 and "no_such_key" in proc.stderr, proc.stderr[-2000:]
