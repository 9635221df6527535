"""A newcomer's first `make demo` (issue 73 point 1): a fresh clone of each ref, a fresh HOME (no extensions, no
data cache; pip's own cache kept warm, as on a machine that installed torch before), idle and loaded (busy loops,
one per core, at nice 0, standing in for a `make test` beside it). Per run, from `make demo`'s start: when pip
ended, when training began (the pre-flight line, just before the first step), the first step (the trainer's own
line, where the ref has it), the end, and the longest silence on the console. Writes
bench/results/first_run.json + .png.

    python -m bench.first_run --refs 68ae82c HEAD                      # before and after, idle and loaded (~25 min)
    python -m bench.first_run --refs HEAD --conditions idle
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import REPO

PIP_DONE = re.compile(r"installing hpc-trainer and its extras \(pip\): done|building .* once per CPU type|^touch ")
TRAINING = re.compile(r"\] pre-flight: ")
FIRST_STEP = re.compile(r"first step done ([\d.]+) s after the process started")


def timed_lines(cmd: list[str], cwd: Path, env: dict) -> list[tuple[float, str]]:
    """Every line the command prints (stdout and stderr together), with the seconds since it started."""
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            bufsize=1)
    lines = [(round(time.monotonic() - t0, 2), line.rstrip("\n")) for line in proc.stdout]
    lines.append((round(time.monotonic() - t0, 2), f"exit {proc.wait()}"))
    return lines


def builder_done(extensions: Path, demo_end: float, cap_s: float = 900) -> float | None:
    """Seconds from `make demo`'s start until the kernels' background builder (if the demo started one) finished, the
    busy loops stopped at the demo's end: it outlives the demo, and the next run must not share the cores with it.
    None: no builder ran."""
    lock = extensions / ".building"
    if not (extensions / "build.log").exists():
        return None
    t0 = time.monotonic()
    while lock.exists() and time.monotonic() - t0 < cap_s:
        time.sleep(1)
    return round(demo_end + time.monotonic() - t0, 1)


def first(lines: list[tuple[float, str]], pattern: re.Pattern) -> float | None:
    return next((t for t, line in lines if pattern.search(line)), None)


def one_run(ref: str, condition: str, work: Path) -> dict:
    clone = work / f"clone-{ref}-{condition}"
    subprocess.run(["git", "clone", "-q", str(REPO), str(clone)], check=True)
    subprocess.run(["git", "checkout", "-q", ref], cwd=clone, check=True)
    home = work / f"home-{ref}-{condition}"
    home.mkdir()
    pip_cache = os.environ.get("PIP_CACHE_DIR") or str(Path.home() / ".cache" / "pip")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TRAINER_", "VIRTUAL_ENV"))}
    env.update(HOME=str(home), PIP_CACHE_DIR=pip_cache)
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
            for _ in range(len(os.sched_getaffinity(0)) if condition == "loaded" else 0)]
    try:
        lines = timed_lines(["make", "demo"], clone, env)
    finally:
        for p in busy:
            p.kill()
    kernels = builder_done(home / ".cache" / "hpc-trainer" / "extensions", lines[-1][0])   # the load gone
    end = lines[-1][0]
    gaps = [b[0] - a[0] for a, b in zip(lines, lines[1:])]
    step = next((float(m.group(1)) for _, line in lines if (m := FIRST_STEP.search(line))), None)
    (work / f"make-demo-{ref}-{condition}.log").write_text("\n".join(f"{t:8.2f} {line}" for t, line in lines))
    return dict(ref=ref, commit=subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=clone, text=True,
                                               capture_output=True).stdout.strip(),
                condition=condition, exit=lines[-1][1], pip_done_s=first(lines, PIP_DONE),
                training_s=first(lines, TRAINING), first_step_line_s=first(lines, FIRST_STEP),
                first_step_in_process_s=step, end_s=end, longest_silence_s=round(max(gaps, default=0.0), 1),
                kernels_built_behind_s=kernels, lines=len(lines))


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8, 0.6 * len(rows) + 1.5))
    for i, r in enumerate(rows):
        pip, train, end = r["pip_done_s"] or 0, r["training_s"] or r["end_s"], r["end_s"]
        ax.barh(i, pip, color="#999", label="pip" if i == 0 else None)
        ax.barh(i, train - pip, left=pip, color="#d62728", label="to training" if i == 0 else None)
        ax.barh(i, end - train, left=train, color="#2ca02c", label="demo" if i == 0 else None)
    ax.set_yticks(range(len(rows)), [f"{r['commit']} {r['condition']}" for r in rows])
    ax.set_xlabel("seconds from `make demo` (fresh clone, empty HOME, pip's cache warm)")
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.first_run", allow_abbrev=False,
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--refs", nargs="+", default=["HEAD"], help="commits to compare (each a fresh clone)")
    parser.add_argument("--conditions", nargs="+", default=["idle", "loaded"], choices=["idle", "loaded"])
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "first_run.json")
    parser.add_argument("--update", action="store_true", help="keep --out's rows of other (ref, condition) pairs")
    args = parser.parse_args(argv)
    rows, logs = [], {}
    if args.update and args.out.exists():
        old = json.loads(args.out.read_text())
        rows = [r for r in old["rows"] if not (r["ref"] in args.refs and r["condition"] in args.conditions)]
        logs = old.get("log_tails", {})
    with tempfile.TemporaryDirectory(prefix="first-run-") as tmp:
        for condition in args.conditions:
            for ref in args.refs:
                rows.append(one_run(ref, condition, Path(tmp)))
                print(json.dumps(rows[-1]), flush=True)
        logs.update({p.name: p.read_text()[-6000:] for p in Path(tmp).glob("make-demo-*.log")})
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(dict(rows=rows, cores=len(os.sched_getaffinity(0)), log_tails=logs), indent=1))
    plot(rows, args.out.with_suffix(".png"))
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
