"""The per-step cost of the signal agreement, before and after it moved into the logging window's collective (issue
58 item 4), at 2 and 4 ranks under Slurm's srun on the local 2-node cluster, interleaved A/B; and the straggler
watch's figures of these healthy runs (the largest factor any judged window showed: the false-alarm margin).

    python -m bench.agreement                       # 5 repeats per arm and world -> bench/results/agreement.{json,png}
    python -m bench.agreement --repeats 3 --steps 500

A: ckpt.signal_latency_s=0 and faults.straggler_action=off: the agreement at every step, as before, and no
straggler timing. B: the defaults: the agreement rides in the window's read (log.every_steps=10) and, between
windows, every k steps for a signal latency of at most 5 s; the straggler watch on. The toy recipe's small step
(tests/toy_recipe.py; hidden 1024, batch 16 per rank) shows a per-step collective's cost at its largest. The figure
per run is the median step time over its windows after the first two (each window's wall time over its steps,
the window's own read included).
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench.run import clean_env, slurm_conf
from trainer.engine.logging import read_metrics

REPO = Path(__file__).resolve().parents[1]

ARMS = {"A: every step": ["ckpt.signal_latency_s=0", "faults.straggler_action=off"], "B: in the window": []}
WORLDS = {2: ("-N2", "--ntasks-per-node=1"), 4: ("-N2", "--ntasks-per-node=2")}


def one_run(conf: str, world: int, arm: list[str], steps: int, run_dir: Path) -> dict:
    shutil.rmtree(run_dir, ignore_errors=True)       # a fresh run each time
    args = ["--recipe", "toy", "--seed", "1", "--batch-size", "16", "--epochs", "1000", f"train.max_steps={steps}",
            "data.n_train=8192", "model.hidden=1024", "log.tensorboard=false", "train.eval_every_epochs=1000",
            "ckpt.every_epochs=0", "ckpt.save_best=false", "log.progress=off", "faults.preflight=off", *arm]
    cmd = ["srun", *WORLDS[world], "--cpus-per-task=1", "--gpus-per-node=0", "--time=10", sys.executable, "-m",
           "trainer", "train", "--run-dir", str(run_dir), *args]
    proc = subprocess.run(cmd, env=clean_env(SLURM_CONF=conf, TRAINER_PLUGINS="tests.toy_recipe"), cwd=REPO,
                          capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    windows = [r for r in read_metrics(run_dir, "train") if "step_time_s" in r][2:]
    factors = [r["slowest_factor"] for r in windows if "slowest_factor" in r]
    return dict(step_ms=1000 * statistics.median(r["step_time_s"] for r in windows), windows=len(windows),
                judged=len(factors), max_factor=max(factors, default=None),
                named=sum("straggler_rank" in r for r in windows))


def summarize(runs: list[dict]) -> list[dict]:
    rows = []
    for world in sorted({r["world"] for r in runs}):
        a = [r["step_ms"] for r in runs if r["world"] == world and r["arm"].startswith("A")]
        b = [r["step_ms"] for r in runs if r["world"] == world and r["arm"].startswith("B")]
        pairs = [y / x for x, y in zip(a, b)]
        rows.append(dict(world=world, a_median_ms=round(statistics.median(a), 3),
                         b_median_ms=round(statistics.median(b), 3),
                         b_over_a=round(statistics.median(b) / statistics.median(a), 3),
                         paired_ratio_range=[round(min(pairs), 3), round(max(pairs), 3)],
                         a_ms=[round(x, 3) for x in a], b_ms=[round(x, 3) for x in b]))
    return rows


def draw(rows: list[dict], png: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for i, row in enumerate(rows):
        for j, (key, label) in enumerate((("a_ms", "A: agree every step"), ("b_ms", "B: in the window"))):
            xs = [i * 3 + j] * len(row[key])
            ax.scatter(xs, row[key], color=f"C{j}", label=label if i == 0 else None, alpha=0.7)
    ax.set_xticks([i * 3 + 0.5 for i in range(len(rows))], [f"{r['world']} ranks" for r in rows])
    ax.set_ylabel("ms per step (median of a run)")
    ax.set_title("signal agreement per step vs in the logging window (srun, local cluster)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter,
                                 allow_abbrev=False)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "agreement.json"))
    ap.add_argument("--work", default="/tmp/bench-agreement")
    args = ap.parse_args(argv)
    conf, why = slurm_conf()
    if conf is None:
        print(f"bench.agreement: no local cluster: {why}", file=sys.stderr)
        return 2
    runs = []
    for rep in range(args.repeats):
        for world in WORLDS:
            for name, arm in ARMS.items():      # interleaved: A and B of a repeat run back to back
                t0 = time.time()
                run = one_run(conf, world, arm, args.steps, Path(args.work) / f"w{world}-{name[0]}-{rep}")
                runs.append(dict(world=world, arm=name, repeat=rep, wall_s=round(time.time() - t0, 1), **run))
                print(json.dumps(runs[-1]), flush=True)
    rows = summarize(runs)
    healthy = [r["max_factor"] for r in runs if r["max_factor"] is not None]
    out = Path(args.out)
    out.write_text(json.dumps(dict(date=time.strftime("%Y-%m-%d"), steps=args.steps, repeats=args.repeats,
                                   summary=rows, runs=runs, healthy_max_factor=max(healthy, default=None),
                                   stragglers_named=sum(r["named"] for r in runs)), indent=1) + "\n")
    draw(rows, out.with_suffix(".png"))
    for row in rows:
        print(f"{row['world']} ranks: A {row['a_median_ms']} ms, B {row['b_median_ms']} ms per step; B/A "
              f"{row['b_over_a']} (paired {row['paired_ratio_range'][0]}-{row['paired_ratio_range'][1]})")
    print(f"healthy runs: the largest straggler factor {max(healthy, default=None)}; named: "
          f"{sum(r['named'] for r in runs)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
