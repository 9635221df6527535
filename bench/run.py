"""One benchmark entry point for every recipe: a fixed number of training steps after a warm-up, at world
size 1 and 2 (gloo, one thread per rank, the same per-rank batch), then the test evaluation. Writes one JSON
per run, and summary.{json,md,png} with samples/s, step time (median, p90), loader-wait share, peak RSS /
GPU memory, evaluation time, the metrics reached and the scaling efficiency.

    python bench/run.py                              # every recipe, worlds 1 and 2 -> bench/results/harness/
    python bench/run.py har video --steps 20 --warmup 3
    python -m bench har --world 1                    # the same through bench/__main__.py
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.harness import scaling_efficiency, step_stats  # noqa: E402

# small CPU-sized settings on each recipe's synthetic data (data.path empty), the same for every world size
PRESETS = {
    "sasrec": ["--batch-size", "64", "data.maxlen=50", "model.hidden=32", "eval.max_users=200"],
    "kgat": ["--batch-size", "256", "model.embed_dim=32", "model.relation_dim=32", "model.layers=[32,16]"],
    "har": ["--batch-size", "64"],
    "video": ["--batch-size", "8", "model.arch=light", "data.size=64", "data.clip_len=9", "train.num_workers=1"],
}
COMMON = ["--epochs", "100000", "train.log_every_steps=1", "train.eval_every_epochs=100000", "ckpt.every_epochs=0",
          "train.tensorboard=false", "train.progress=off", "ckpt.save_best=false"]


def run_one(recipe: str, world: int, steps: int, warmup: int, out: Path) -> dict:
    """Train `recipe` for warmup + steps optimizer steps with `world` ranks; the run's record."""
    run_dir = out / "runs" / f"{recipe}-w{world}"
    shutil.rmtree(run_dir, ignore_errors=True)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}"] \
        if world > 1 else [sys.executable]
    extra = [f"data.cache={out / 'data' / 'video'}"] if recipe == "video" else []
    cmd = [*launch, "-m", "trainer", "train", "--recipe", recipe, "--run-dir", str(run_dir), *PRESETS[recipe],
           *COMMON, f"train.max_steps={warmup + steps}", *extra]
    t0 = time.time()
    proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True)
    wall = time.time() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["split"] == "train" and "step_time_s" in r]
    test = next((r for r in reversed(rows) if r["split"] == "test"), {})
    stats = step_stats(train, warmup)
    metrics = {k: v for k, v in test.items() if isinstance(v, (int, float)) and k not in ("epoch", "step", "time")}
    record = dict(recipe=recipe, world=world, threads_per_rank=1, steps=stats["steps"], warmup=warmup,
                  **{k: round(v, 6) for k, v in stats.items() if k != "steps"},
                  eval_time_s=test.get("eval_time_s"), metrics=metrics, wall_s=round(wall, 2),
                  startup_s=round(wall - sum(r["step_time_s"] for r in train), 2))
    print(f"{recipe:<7} world {world}: {stats['samples_per_s']:9.1f} samples/s, step {stats['step_time_median_s']:.4f} s "
          f"(p90 {stats['step_time_p90_s']:.4f}), loader wait {stats['data_wait_frac']:.1%}", flush=True)
    return record


def summarize(records: list[dict]) -> list[dict]:
    """One row per recipe: the world-1 figures, and each larger world's throughput with its efficiency."""
    rows = []
    for recipe in dict.fromkeys(r["recipe"] for r in records):
        runs = {r["world"]: r for r in records if r["recipe"] == recipe}
        base = runs.get(1)
        row = dict(recipe=recipe, **{f"samples_per_s_w{w}": round(r["samples_per_s"], 2) for w, r in runs.items()})
        if base:
            row.update(step_time_median_s=base["step_time_median_s"], step_time_p90_s=base["step_time_p90_s"],
                       data_wait_frac=base["data_wait_frac"], peak_rss_mb=base["peak_rss_mb"],
                       eval_time_s=base["eval_time_s"])
            for w, r in runs.items():
                if w > 1:
                    r["scaling_efficiency"] = round(scaling_efficiency(r["samples_per_s"], w, base["samples_per_s"]), 4)
                    row[f"scaling_efficiency_w{w}"] = r["scaling_efficiency"]
        rows.append(row)
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| recipe | samples/s (1 rank) | samples/s (2 ranks) | scaling efficiency | step median / p90 s | "
             "loader wait | peak RSS MB | eval s |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['recipe']} | {r.get('samples_per_s_w1', '')} | {r.get('samples_per_s_w2', '')} | "
                     f"{r.get('scaling_efficiency_w2', '')} | {r.get('step_time_median_s', 0):.4f} / "
                     f"{r.get('step_time_p90_s', 0):.4f} | {r.get('data_wait_frac', 0):.1%} | "
                     f"{r.get('peak_rss_mb', 0):.0f} | {r.get('eval_time_s') or 0:.3f} |")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8, 4))
    names = [r["recipe"] for r in rows]
    effs = [r.get("scaling_efficiency_w2", 0.0) for r in rows]
    ax.bar(names, effs, color="C0")
    ax.axhline(0.9, ls="--", c="gray", label="target 0.9")
    for i, e in enumerate(effs):
        ax.text(i, e, f"{e:.2f}", ha="center", va="bottom")
    ax.set_ylim(0, 1.15), ax.set_ylabel("throughput(2) / (2 x throughput(1))"), ax.legend()
    ax.set_title("DDP scaling on CPU, gloo, 1 thread per rank")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("recipes", nargs="*", default=list(PRESETS), help=f"any of {', '.join(PRESETS)} (default all)")
    p.add_argument("--world", type=int, nargs="+", default=[1, 2], help="world sizes (default 1 2)")
    p.add_argument("--steps", type=int, default=30, help="timed optimizer steps")
    p.add_argument("--warmup", type=int, default=5, help="untimed optimizer steps first")
    p.add_argument("--out", default=str(REPO / "bench" / "results" / "harness"))
    args = p.parse_args(argv)
    unknown = [r for r in args.recipes if r not in PRESETS]
    if unknown:
        p.error(f"unknown recipe(s) {unknown}; choose from {', '.join(PRESETS)}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    records = [run_one(r, w, args.steps, args.warmup, out) for r in args.recipes for w in sorted(args.world)]
    rows = summarize(records)
    for r in records:                              # written once summarize() added the efficiencies
        (out / f"{r['recipe']}-w{r['world']}.json").write_text(json.dumps(r, indent=1))
    import torch
    summary = dict(rows=rows, runs=records, date=time.strftime("%Y-%m-%d %H:%M"),
                   machine=dict(cpus=os.cpu_count(), python=platform.python_version(), torch=str(torch.__version__),
                                device="cpu (gloo)"))
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    (out / "summary.md").write_text(table(rows) + "\n")
    plot(rows, out / "summary.png")
    print(table(rows))
    print(f"wrote {out}/summary.{{json,md,png}} and one JSON per run")
    return 0


if __name__ == "__main__":
    sys.exit(main())
