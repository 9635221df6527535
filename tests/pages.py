"""The commands of the pages a user reads (issue 86 point 4): every line of every ```bash block of README.md and
docs/*.md, as a user would type it, with what it needs to run. tests/unit/test_page_commands.py runs the ones this
machine can, tests/slurm/test_page_commands_on_cluster.py the ones that need Slurm, and
tests/gpu/test_page_commands_cuda.py the ones that need a GPU.

    from tests.pages import page_commands
    for command in page_commands():
        print(command.where, command.needs, command.text)      # e.g. README.md:13 {'network'} python -m trainer ...

What a command needs is read from the command itself (sbatch, srun, salloc, hpc/submit.py: `cluster`; docker,
apptainer: `container`; `data download`: `network`) and from its block's info string (```bash gpu: `gpu`), so a
command cannot be left unchecked by forgetting a mark. A page's other blocks say what they hold (```text, ```yaml,
```python): an opening fence without a word is refused (tests/unit/test_page_commands.py), so no command hides in one.
"""
from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

from tests.procs import REPO

MARKS = ("gpu", "cluster", "container", "network")
FENCE = re.compile(r"^(\s*)```(.*)$")
ENV_WORD = re.compile(r"^[A-Z_][A-Z0-9_]*=")


def pages() -> list[Path]:
    """The pages a user reads: the README and the guides."""
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


@dataclass(frozen=True)
class PageCommand:
    """One command of a page: where it is, its text (continuation lines joined, its comment left out), what it
    needs beyond this machine."""

    page: str
    line: int
    text: str
    needs: frozenset[str]

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"

    def words(self) -> list[str]:
        """The command's words as the shell splits them (quotes removed, `$(...)` and `$VAR` left as written)."""
        return shlex.split(self.text)

    def env_and_argv(self) -> tuple[dict[str, str], list[str]]:
        """Its leading VAR=value words (the environment it sets for itself) and the rest."""
        words, env = self.words(), {}
        while words and ENV_WORD.match(words[0]):
            key, value = words.pop(0).split("=", 1)
            env[key] = value
        return env, words

    @property
    def program(self) -> str:
        """What runs: `trainer` (python -m trainer), `submit` (python hpc/submit.py), `bench` (python -m bench), or
        the first word (sbatch, srun, torchrun, make, ...)."""
        argv = self.env_and_argv()[1]
        if argv[0] in ("python", "python3", ".venv/bin/python"):
            if argv[1:3] == ["-m", "trainer"]:
                return "trainer"
            if argv[1:3] == ["-m", "bench"]:
                return "bench"
            if argv[1] == "hpc/submit.py":
                return "submit"
        return argv[0]


def needs_of(text: str, marks: set[str]) -> frozenset[str]:
    """What a command needs: its block's marks, and what its words say."""
    needs = set(marks)
    words = shlex.split(text)
    first = next((w for w in words if not ENV_WORD.match(w)), "")
    if (first in ("sbatch", "srun", "salloc") or (first == "eval" and "slurm-env" in text)
            or re.match(r"make (slurm-up|slurm-down)\b", text)):
        needs.add("cluster")
    if "hpc/submit.py" in words[:3] and not re.search(r"--cluster (local|debug)|--dry-run", text):
        needs.add("cluster")
    if (first in ("docker", "apptainer") or re.match(r"make (image|sif)\b", text) or "IMAGE=" in text
            or "--container" in words):
        needs.add("container")
    if re.search(r"-m trainer data download\b", text) or first == "pip" or re.search(r"https?://", text):
        needs.add("network")
    return frozenset(needs)


def commands_of(page: Path) -> list[PageCommand]:
    """Every command of one page's ```bash blocks, in page order."""
    name = page.relative_to(REPO).as_posix()
    out: list[PageCommand] = []
    lines = page.read_text().splitlines()
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        info = m.group(2).split()
        end = next(j for j in range(i + 1, len(lines)) if lines[j].strip().startswith("```"))
        if info and info[0] == "bash":
            out.extend(_block_commands(name, i + 2, lines[i + 1:end], set(info[1:])))
        i = end + 1
    return out


def _block_commands(page: str, first_line: int, body: list[str], marks: set[str]) -> list[PageCommand]:
    unknown = marks - set(MARKS)
    if unknown:
        raise ValueError(f"{page}:{first_line - 1}: unknown mark(s) {sorted(unknown)} (known: {', '.join(MARKS)})")
    out, pending, start = [], "", 0
    for n, raw in enumerate(body):
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if not pending:
            start = first_line + n
        if line.endswith("\\"):
            pending += line[:-1].rstrip() + " "
            continue
        text = _without_comment(pending + line)
        pending = ""
        out.append(PageCommand(page, start, text, needs_of(text, marks)))
    return out


def _without_comment(text: str) -> str:
    """The command without its trailing `# ...` (a # inside quotes or inside a word stays)."""
    quote = ""
    for i, ch in enumerate(text):
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or text[i - 1].isspace()):
            return text[:i].strip()
    return text.strip()


def page_commands() -> list[PageCommand]:
    """Every command of every page."""
    return [c for page in pages() for c in commands_of(page)]


def bare_fences(page: Path) -> list[int]:
    """Lines of a page whose opening fence names no kind of block."""
    lines, bare, inside = page.read_text().splitlines(), [], False
    for n, line in enumerate(lines, 1):
        m = FENCE.match(line)
        if not m:
            continue
        if not inside and not m.group(2).strip():
            bare.append(n)
        inside = not inside
    return bare


# ---- a sandbox that looks like the repository root with the data the pages' commands read -------------------------

# the files and folders of the repository a command names, linked into the sandbox (its runs/ and data/ are its own)
LINKED = ("configs", "slurm", "hpc", "bench", "scripts", "trainer", "tests", "Makefile", "pyproject.toml", ".venv",
          "main.py", "main_multi_gpu.py", "train.py", "train_distributed.sh", "train_multigpu.sh")
# each training a page shows runs as written plus this step budget (the command's meaning is its flags and data;
# a user's epochs are what the budget cuts short)
BUDGET = ("train.max_steps=2",)
SHARED = REPO.parent / "shared"


def sandbox(root: Path, data: Path | None = None) -> Path:
    """root/work: a folder laid out as the repository root (its entries linked), with root/shared beside it for the
    pages' ../shared paths and the data every page's command reads under data/ (its entries links to those of
    `data`, a folder write_data filled once, where given: what a command writes there stays its own). Returns
    root/work."""
    work = root / "work"
    work.mkdir(parents=True)
    for name in LINKED:
        if (REPO / name).exists():
            (work / name).symlink_to(REPO / name)
    (root / "shared").mkdir()
    (root / "shared" / "data").mkdir()
    if (SHARED / "data" / "BasicMotions").is_dir():
        (root / "shared" / "data" / "BasicMotions").symlink_to(SHARED / "data" / "BasicMotions")
    else:                                           # the synthetic fallback: UEA .ts files of that name
        write_ts(root / "shared" / "data" / "BasicMotions")
    if data is None:
        write_data(work / "data")
    else:
        (work / "data").mkdir()
        for entry in data.iterdir():
            (work / "data" / entry.name).symlink_to(entry)
    return work


def write_data(data: Path) -> None:
    """What the pages' commands read from data/, in each format they name: real ml-100k where ../shared has it, else
    generated files of the same layout; small generated sets for the rest."""
    import numpy as np

    from tests.inprocess import cli
    data.mkdir(parents=True)
    if (SHARED / "data" / "ml-100k" / "u.data").is_file():
        (data / "ml-100k").symlink_to(SHARED / "data" / "ml-100k")
    else:
        write_interactions(data / "ml-100k" / "u.data", "\t")
    write_interactions(data / "ml-1m" / "ratings.dat", "::")
    write_interactions(data / "interactions.csv", ",", header="user,item,timestamp")
    for name in ("my-kg", "amazon-book"):
        cli("data", "synth", "kgat", "--out", str(data / name))
    cli("data", "synth", "har", "--preset", "tiny", "--out", str(data))          # data/UCI HAR Dataset
    rng = np.random.default_rng(0)
    (data / "my-series").mkdir()
    for split, n in (("train", 96), ("test", 32)):
        labels = rng.integers(0, 3, n)
        samples = rng.normal(size=(n, 6, 50)).astype(np.float32) + labels[:, None, None]
        np.savez(data / "my-series" / f"{split}.npz", samples=samples, labels=labels)
    cli("data", "synth", "video", "--out", str(data / "my-videos"), "--videos", "6", "--frames", "24")
    write_upstream_videos(data / "mouse")


def write_interactions(path: Path, sep: str, header: str = "", users: int = 120, items: int = 80) -> None:
    """user, item, rating (u.data, .dat) or user, item, timestamp (CSV) rows: each user 12 interactions in time."""
    import numpy as np
    rng = np.random.default_rng(1)
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = [header] if header else []
    for u in range(1, users + 1):
        for k, i in enumerate(rng.choice(np.arange(1, items + 1), 12, replace=False)):
            rows.append(sep.join(map(str, (u, i, 1000 + k))) if header else sep.join(map(str, (u, i, 4, 1000 + k))))
    path.write_text("\n".join(rows) + "\n")


def write_ts(folder: Path) -> None:
    """UEA BasicMotions-shaped .ts files (6 dimensions, 4 classes) of generated series."""
    import numpy as np
    rng = np.random.default_rng(2)
    folder.mkdir(parents=True)
    classes = ("standing", "running", "walking", "badminton")
    for split, n in (("TRAIN", 40), ("TEST", 40)):
        lines = ["@problemName BasicMotions", "@timeStamps false", "@missing false", "@univariate false",
                 "@dimensions 6", "@equalLength true", "@seriesLength 100",
                 f"@classLabel true {' '.join(classes)}", "@data"]
        for case in range(n):
            label = case % 4
            dims = [",".join(f"{v:.4f}" for v in rng.normal(label, 1.0, 100)) for _ in range(6)]
            lines.append(":".join(dims) + ":" + classes[label])
        (folder / f"BasicMotions_{split}.ts").write_text("\n".join(lines) + "\n")


def write_upstream_videos(folder: Path) -> None:
    """Videos in the mouse guide's layout: .mp4 files and Annotations/prediction_<video>_<trial>.csv with action
    codes 0-7 (the generated videos' motion classes as codes 0, 1 and 6)."""
    import csv

    from tests.inprocess import cli
    cli("data", "synth", "video", "--out", str(folder), "--videos", "6", "--frames", "24", "--classes", "3")
    with open(folder / "labels.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    names = sorted({r["label"] for r in rows})
    (folder / "Annotations").mkdir()
    for video in sorted({r["video"] for r in rows}):
        with open(folder / "Annotations" / f"prediction_{video}_1.csv", "w", newline="") as fh:
            w = csv.writer(fh)
            w.writerow(["Frame", "Action"])
            for r in (r for r in rows if r["video"] == video):
                w.writerow([r["frame"], (0, 1, 6)[names.index(r["label"])]])
    (folder / "labels.csv").unlink()


# ---- running one command as a user would, here ---------------------------------------------------------------------

# a page's stand-ins for what the reader fills in, and the sandbox's value of each
PLACEHOLDERS = {"RUN_DIR": "runs/example", "SWEEP_DIR": "runs", "SPACE.yaml": "configs/search/sasrec.yaml"}
# hpc/submit.py's `...`: the config and the data of the block's first command, those the command does not name
# itself, as a reader takes them (docs/cluster.md: `python hpc/submit.py ... --dry-run`)
SUBMIT_DOTS = ("--config", "configs/sasrec/ml-100k.yaml", "data.path=data/ml-100k")


def filled(argv: list[str]) -> list[str]:
    """The words with the page's stand-ins filled in: `...` (the reader's other flags) left out, RUN_DIR a run."""
    out = []
    for word in argv:
        if word == "...":
            if argv[1:2] == ["hpc/submit.py"]:
                named = "--recipe" in argv or "--config" in argv
                out.extend(SUBMIT_DOTS[2 if named else 0:2])
                out.extend(SUBMIT_DOTS[2:] if not any(w.startswith("data.path=") for w in argv) else ())
            continue
        for stand_in, value in PLACEHOLDERS.items():
            word = word.replace(stand_in, value)
        out.append(word)
    return out


def budgeted(argv: list[str]) -> list[str]:
    """A training's words with the step budget after them (a train of the trainer, torchrun or an sbatch script)."""
    scripts = [w for w in argv if w.endswith(".sbatch")]
    trainer_train = any(argv[i:i + 3] == ["-m", "trainer", "train"] for i in range(len(argv)))
    trains = (trainer_train or (scripts and not scripts[0].endswith("predict.sbatch"))
              or (argv[1:2] == ["hpc/submit.py"] and "predict" not in argv[2:3]))
    return [*argv, *BUDGET] if trains else argv


def run_here(command: PageCommand, work: Path, env: dict[str, str]):
    """One command in the sandbox `work`, as the page has it (stand-ins filled, a training budgeted): the trainer's
    and hpc/submit.py's command lines in this process, the others as processes. Returns (exit code, output)."""
    import os
    import subprocess
    import sys

    from tests.inprocess import cli, entry
    from tests.timeouts import limit
    own_env, argv = command.env_and_argv()
    argv = budgeted(filled(argv))
    run_env = dict(env, **own_env)
    if command.program == "trainer":
        ran = cli(*argv[3:], env=run_env, cwd=work, check=False)
        return ran.returncode, ran.stdout + ran.stderr
    if command.program == "submit":
        from hpc.submit import main
        ran = entry(main, argv[2:], env=run_env, cwd=work, check=False)
        return ran.returncode, ran.stdout + ran.stderr
    path = f"{Path(sys.executable).parent}{os.pathsep}{run_env.get('PATH', os.environ['PATH'])}"
    proc = subprocess.run(argv, cwd=work, env=dict(run_env, PATH=path), capture_output=True, text=True,
                          timeout=limit("jobs"))
    return proc.returncode, proc.stdout + proc.stderr
