"""Every command of docs/coming-from-the-seed-scripts.md runs (tiny generated data, one
epoch, at most 2 processes), so the tables cannot rot. A launcher's row runs as its process group; a row that is one
`python -m trainer` process runs through the command line's entry in this process (tests/inprocess.py)."""
import re
import shlex
import subprocess

import pytest

from tests.conftest import PY, REPO, clean_env, free_port, run_group, wait_all
from tests.inprocess import cli

pytestmark = pytest.mark.long     # the guides' launcher rows as processes: make test-fast leaves them out

TINY = {   # per recipe: tiny model settings, put before the row's own arguments (the row's values win)
    "kgat": ["model.width=8", "model.relation_width=8", "model.layer_widths=[8]", "train.eval_batch_size=64"],
    "sasrec": ["data.maxlen=16", "model.width=8", "model.depth=1", "model.heads=1", "data.kcore=0"],
    "har": ["model.width=8", "model.channel_width=8", "model.head_width=16", "model.depth=2"],
    "video": ["data.merge={}", "data.size=32", "data.clip_len=5", "model.arch=light", "train.batch_size=8"],
}
RECIPE = {"kgat": "kgat", "sasrec": "sasrec", "tisasrec": "sasrec", "har": "har", "video": "video"}


def readme_commands() -> list[str]:
    """The right-hand column of docs/coming-from-the-seed-scripts.md: `- **seed command**: here: `command` ...`
    items (an item's lines joined: a long command wraps)."""
    text = (REPO / "docs" / "coming-from-the-seed-scripts.md").read_text()
    items = re.split(r"\n(?=- |\n)", text)
    cmds = [re.sub(r"\s*\n\s*", " ", m.group(1)) for item in items
            if (m := re.match(r"- \*\*.*?\*\*:\s*here:\s*`([^`]*)`", item, re.S))]
    assert len(cmds) >= 15, "the page's command lists"
    return [c for c in cmds if not c.startswith("sbatch")]


@pytest.fixture(scope="module")
def datasets(tmp_path_factory):
    root = tmp_path_factory.mktemp("seed-data")
    make = {"kgat": ["kgat", "--preset", "tiny"], "sasrec": ["sasrec", "--users", "60", "--items", "40"],
            "har": ["har", "--preset", "tiny"], "video": ["video", "--videos", "4", "--frames", "30", "--classes", "2"]}
    for name, args in make.items():             # in this process: the data is what the rows read, not a process
        cli("data", "synth", *args[:1], "--out", str(root / name), *args[1:])
    return {"kgat": root / "kgat", "sasrec": root / "sasrec", "har": root / "har" / "UCI HAR Dataset",
            "video": root / "video"}


def runnable(command: str, run_dir, data: dict, port: int | None = None) -> tuple[list[str], dict]:
    """The README command, made tiny: 2 processes at most (1 per node for two-node rows), 1 epoch, free
    ports, this machine as the master, the run dir in tmp."""
    words, env = shlex.split(command), clean_env()
    per_node = "1" if "--nnodes=2" in command else "2"
    port = port or free_port()
    while "=" in words[0] and not words[0].startswith("-"):            # VAR=value prefixes
        key, value = words.pop(0).split("=", 1)
        env[key] = str(port) if key == "MASTER_PORT" else value
    out = [PY, "-m", "torch.distributed.run"] if words[0] == "torchrun" else [PY]
    words = words[1:]
    recipe = RECIPE[re.search(r"configs/(\w+)/", command).group(1)]
    config_at = words.index("--config")
    words[config_at + 1] = str(REPO / words[config_at + 1])
    i = 0
    while i < len(words):
        word = words[i]
        if re.fullmatch(r"--nproc[_-]per[_-]node=\d+", word):
            word = word.split("=")[0] + "=" + per_node
        elif re.fullmatch(r"--nproc[_-]per[_-]node", word):
            words[i + 1] = per_node
        elif re.fullmatch(r"--master[_-]port=\d+", word):
            word = word.split("=")[0] + f"={port}"
        elif re.fullmatch(r"--master[_-]addr=\S+", word):
            word = word.split("=")[0] + "=127.0.0.1"
        elif word == "--epochs":
            words[i + 1] = "1"
        elif word == "--run-dir":
            words[i + 1] = str(run_dir / words[i + 1])
        out.append(word)
        if word == "train":
            out += [*TINY[recipe], f"data.path={data[recipe]}"]
        i += 1
    if "--epochs" not in out:
        out += ["--epochs", "1"]
    if "--run-dir" not in out:
        out += ["--run-dir", str(run_dir / "run")]
    return out, env


COMMANDS = readme_commands()


def run_row(argv: list[str], env: dict) -> tuple[int, str]:
    """(exit code, stderr) of a row: `python -m trainer ...` in this process, anything else (torchrun,
    torch.distributed.launch) as a process group."""
    if argv[:3] == [PY, "-m", "trainer"]:
        ran = cli(*argv[3:], env=env, check=False)
        return ran.returncode, ran.stderr
    return run_group(argv, env)


def test_the_tables_are_there():
    assert len(COMMANDS) >= 25 and all("-m trainer train --config configs/" in c for c in COMMANDS)


@pytest.mark.parametrize("command", COMMANDS, ids=[f"row{i}" for i in range(len(COMMANDS))])
def test_readme_seed_command_runs(command, tmp_path, datasets):
    if "--init-from" in command:             # the checkpoint it names: a tiny run of the same recipe
        source = command.split("--init-from ")[1].split()[0]
        first = command.split(" --init-from")[0].replace("--run-dir runs/tisasrec_resume", "--run-dir source")
        argv, env = runnable(first, tmp_path, datasets)
        code, err = run_row(argv, env)
        assert code == 0, f"{shlex.join(argv)}\n{err[-3000:]}"
        command = command.replace(source, str(tmp_path / "source" / "checkpoints" / "final.pt"))
    if "--nnodes=2" in command:              # both "nodes" on this machine, as two torchrun agents
        port = free_port()
        procs = []
        for node in (0, 1):
            argv, env = runnable(command.replace("--node_rank=0", f"--node_rank={node}"), tmp_path, datasets, port)
            procs.append(subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                          text=True))
        outs = wait_all(procs, 300)
        assert [code for code, _ in outs] == [0, 0], outs[0][1][-3000:] + outs[1][1][-3000:]
    else:
        argv, env = runnable(command, tmp_path, datasets)
        code, err = run_row(argv, env)
        assert code == 0, f"{shlex.join(argv)}\n{err[-3000:]}"
    finals = [p for p in tmp_path.rglob("checkpoints/final.pt") if "source" not in p.parts]
    assert len(finals) == 1, f"{command}: {finals}"
