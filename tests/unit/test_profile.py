"""log.profile=START:STOP: a torch.profiler trace of those optimizer steps in the run directory, with a top-10
table in the log; a bad range stops before training with the key named."""
import json

import pytest

from tests.inprocess import cli
from trainer.engine.components.profiler import parse_steps

TOY = ("train", "--recipe", "toy", "--epochs", "2", "log.tensorboard=false")


def test_a_trace_of_the_steps_and_a_table(tmp_path):
    proc = cli(*TOY, "--run-dir", str(tmp_path / "run"), "log.profile=3:5")
    trace = tmp_path / "run" / "profile" / "rank0.pt.trace.json"
    events = json.loads(trace.read_text())["traceEvents"]
    steps = [e for e in events if e.get("name", "").startswith("Optimizer.step")]
    assert len(steps) == 3, [e["name"] for e in steps]            # steps 3, 4 and 5, not the run's 16
    assert any(e.get("args", {}).get("Input Dims") for e in events)   # shapes recorded
    assert "profiling optimizer steps 3-5" in proc.stderr
    assert "top ops by CPU time" in proc.stderr and "Self CPU" in proc.stderr


@pytest.mark.parametrize("spec", ["5", "0:3", "4:2", "a:b"])
def test_a_bad_range_is_refused_with_an_example(spec):
    with pytest.raises(ValueError, match="log.profile=10:15"):
        parse_steps(spec)


def test_a_bad_range_stops_the_run_before_it_trains(tmp_path):
    proc = cli(*TOY, "--run-dir", str(tmp_path / "run"), "log.profile=7", check=False)
    assert proc.returncode != 0 and "START:STOP" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "run" / "checkpoints").exists() or not any((tmp_path / "run" / "checkpoints").iterdir())
