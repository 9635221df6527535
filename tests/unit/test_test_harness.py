"""The test harness itself: a hung launcher fails its test with the stacks of everything it started."""
import textwrap

from tests.conftest import PY, clean_env, run_group

# A launcher that starts its worker in a session of its own (as torchrun's agent does), then both wait.
LAUNCHER = textwrap.dedent("""
    import subprocess, sys, time
    worker = "import time\\ndef stuck_in_worker():\\n    time.sleep(600)\\nstuck_in_worker()"
    subprocess.Popen([sys.executable, "-c", worker], start_new_session=True)
    def stuck_in_launcher():
        time.sleep(600)
    stuck_in_launcher()
""")


def test_a_hung_launcher_names_where_it_and_its_workers_hung():
    try:
        run_group([PY, "-c", LAUNCHER], clean_env(), timeout=3)
    except AssertionError as err:
        report = str(err)
    else:
        raise AssertionError("a launcher sleeping 600 s was not stopped after 3 s")
    assert "still running after 3 s" in report
    assert "stuck_in_worker" in report and "stuck_in_launcher" in report, report[-3000:]
