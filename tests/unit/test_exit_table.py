"""Issue 67.2: exceptions map to exit codes in one table (trainer/engine/exits.py), which the command line, each
rank's exit record and the submitit task read; nothing else in trainer/ maps an exception to a code."""
from __future__ import annotations

import errno
import re

import pytest

from tests.conftest import REPO
from trainer.config.settings import ConfigError
from trainer.data.download import DownloadError
from trainer.distributed.environment import LaunchError
from trainer.engine.ckpt_io import CheckpointError
from trainer.engine.exits import CRASH, exit_of
from trainer.engine.window import NonFiniteLossError
from trainer.launch.exitcodes import NON_FINITE, RESOURCE, UNFIT_HOST, USAGE, DiskError, StragglerError, UnfitHostError
from trainer.native.extras import MissingExtraError


@pytest.mark.parametrize("err,code", [
    (ConfigError("train.lrr"), USAGE), (LaunchError("ranks"), USAGE), (CheckpointError("damaged"), USAGE),
    (DownloadError("sha256"), USAGE), (FileNotFoundError(2, "No such file", "x.csv"), USAGE),
    (MissingExtraError("av"), USAGE), (ValueError("a bad value"), USAGE),
    (NonFiniteLossError("nan at step 3"), NON_FINITE),
    (DiskError("could not write"), RESOURCE), (OSError(errno.ENOSPC, "No space left on device", "ckpt.pt"), RESOURCE),
    (UnfitHostError({"node2": "slow"}), UNFIT_HOST), (StragglerError("node2", "3x"), UNFIT_HOST),
    (RuntimeError("index 3 is out of bounds: a bug"), CRASH), (ArithmeticError("a bug"), CRASH),
    (OSError(errno.EIO, "I/O error"), CRASH), (KeyboardInterrupt(), CRASH),
])
def test_each_error_has_one_code(err, code):
    assert exit_of(err).code == code
    assert (exit_of(err).message == "") is (code == CRASH)      # a crash keeps its traceback instead


def test_messages_name_the_way_on():
    assert "ckpt.pt: No space left on device" in exit_of(OSError(errno.ENOSPC, "No space", "ckpt.pt")).message
    assert "HINT: the restart loop" in exit_of(UnfitHostError({"node2": "slow"})).message
    assert "--exclude=node2 ... --resume auto" in exit_of(StragglerError("node2", "3x")).message
    det = RuntimeError("scatter_add_cuda_kernel does not have a deterministic implementation, but you set ...")
    assert exit_of(det).code == USAGE and "train.deterministic=false" in exit_of(det).message


def test_no_other_module_maps_errors_to_codes():
    """The codes are imported only by the table and by doctor's pre-flight (a check's verdict, not an error)."""
    imports = re.compile(r"from trainer\.launch\.exitcodes import \(?[^)]*?\b(USAGE|NON_FINITE|RESOURCE|UNFIT_HOST)\b",
                         re.S)
    users = [str(p.relative_to(REPO)) for p in (REPO / "trainer").rglob("*.py") if imports.search(p.read_text())]
    assert sorted(users) == ["trainer/cli/doctor.py", "trainer/engine/exits.py"]
    assert "import UNFIT_HOST\n" in (REPO / "trainer/cli/doctor.py").read_text()
    for entry in ("trainer/cli/commands.py", "trainer/engine/session.py", "hpc/task.py", "trainer/cli/doctor.py"):
        assert "exit_of" in (REPO / entry).read_text() or "exit_code_of" in (REPO / entry).read_text(), entry
