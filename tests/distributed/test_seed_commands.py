"""Every command of the README's "Coming from the seed scripts" tables runs (tiny generated data, one
epoch, at most 2 processes), so the tables cannot rot."""
import re
import shlex
import subprocess

import pytest

from tests.conftest import PY, REPO, clean_env, free_port

TINY = {   # per recipe: tiny model settings, put before the row's own arguments (the row's values win)
    "kgat": ["model.embed_dim=8", "model.relation_dim=8", "model.layers=[8]", "train.eval_batch_size=64"],
    "sasrec": ["data.maxlen=16", "model.hidden=8", "model.blocks=1", "model.heads=1", "data.kcore=0"],
    "har": ["model.width=8", "model.embed_dim=8", "model.hidden=16", "model.depth=2"],
    "video": ["data.merge={}", "data.size=32", "data.clip_len=5", "model.arch=light", "train.batch_size=8"],
}
RECIPE = {"kgat": "kgat", "sasrec": "sasrec", "tisasrec": "sasrec", "har": "har", "video": "video"}


def readme_commands() -> list[str]:
    text = (REPO / "README.md").read_text()
    section = text.split("## Coming from the seed scripts", 1)[1].split("\n## ", 1)[0]
    rows = [line.split(" | ")[1] for line in section.splitlines() if line.startswith("| `")]
    cmds = [re.fullmatch(r"`([^`]*)`.*", cell).group(1) for cell in rows if cell.startswith("`")]
    return [c for c in cmds if not c.startswith("sbatch")]


@pytest.fixture(scope="module")
def datasets(tmp_path_factory):
    root = tmp_path_factory.mktemp("seed-data")
    make = {"kgat": ["kgat", "--preset", "tiny"], "sasrec": ["sasrec", "--users", "60", "--items", "40"],
            "har": ["har", "--preset", "tiny"], "video": ["video", "--videos", "4", "--frames", "30", "--classes", "2"]}
    for name, args in make.items():
        subprocess.run([PY, "-m", "trainer", "data", "synth", *args[:1], "--out", str(root / name), *args[1:]],
                       cwd=REPO, env=clean_env(), check=True, capture_output=True, timeout=300)
    return {"kgat": root / "kgat", "sasrec": root / "sasrec", "har": root / "har" / "UCI HAR Dataset",
            "video": root / "video"}


def runnable(command: str, run_dir, data: dict) -> tuple[list[str], dict]:
    """The README command, made tiny: 2 processes at most, 1 epoch, free ports, the run dir in tmp."""
    words, env = shlex.split(command), clean_env()
    while "=" in words[0] and not words[0].startswith("-"):            # VAR=value prefixes
        key, _ = words.pop(0).split("=", 1)
        env[key] = str(free_port()) if key == "MASTER_PORT" else _
    out = [PY, "-m", "torch.distributed.run"] if words[0] == "torchrun" else [PY]
    words = words[1:]
    recipe = RECIPE[re.search(r"configs/(\w+)/", command).group(1)]
    config_at = words.index("--config")
    words[config_at + 1] = str(REPO / words[config_at + 1])
    i = 0
    while i < len(words):
        word = words[i]
        if re.fullmatch(r"--nproc[_-]per[_-]node=\d+", word):
            word = word.split("=")[0] + "=2"
        elif re.fullmatch(r"--nproc[_-]per[_-]node", word):
            words[i + 1] = "2"
        elif re.fullmatch(r"--master[_-]port=\d+", word):
            word = word.split("=")[0] + f"={free_port()}"
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


def test_the_tables_are_there():
    assert len(COMMANDS) >= 12 and all("-m trainer train --config configs/" in c for c in COMMANDS)


@pytest.mark.parametrize("command", COMMANDS, ids=[f"row{i}" for i in range(len(COMMANDS))])
def test_readme_seed_command_runs(command, tmp_path, datasets):
    argv, env = runnable(command, tmp_path, datasets)
    proc = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{shlex.join(argv)}\n{proc.stderr[-3000:]}"
    finals = list(tmp_path.rglob("checkpoints/final.pt"))
    assert len(finals) == 1, f"{shlex.join(argv)}: {finals}"
