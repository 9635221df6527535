"""SASRec on Amazon Beauty with the protocol of Klenitskiy & Vasilev (RecSys 2023), against their table (issue 71
points 0 and 5): leave-one-out, every item ranked with the user's history excluded, width 64, 2 blocks, maxlen 50,
batch 128, Adam 1e-3, up to 100 epochs, best.pt and early stopping (patience 10) on validation full NDCG@10
(configs/sasrec/beauty.yaml). One run per loss, one after the other; test full HR@10 / NDCG@10 of best.pt, seconds
per epoch, the validation curve. Writes bench/results/sasrec_beauty.json + .png. Not in CI: a run takes 10-40
minutes on 2 cores (the data is not shipped: ../shared/data/beauty/beauty.txt, or --data).

    python -m bench.sasrec_beauty                                   # bce, shared3000, ce (about 2 hours on 2 cores)
    python -m bench.sasrec_beauty --runs bce,bce_before --update    # these again, the other runs kept
    python -m bench.sasrec_beauty --runs bce --epochs 3 --out /tmp/beauty      # a smoke run
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

from bench.common import REPO, machine, run_trainer

CONFIG = REPO / "configs" / "sasrec" / "beauty.yaml"
RUNS = {
    "bce": [],                                            # the paper's BCE, one negative per position
    # the same with the ml-1m config's model and optimiser (the settings of the first Beauty run)
    "bce_before": ["model.init=xavier", "model.norm=pre", "model.positions=from_end", "optim.betas=[0.9,0.98]",
                   "optim.clip_grad_norm=1.0"],
    "shared3000": ["loss.kind=sampled_softmax", "loss.shared_negatives=sequence", "data.train_negatives=3000"],
    "ce": ["loss.kind=ce"],
}
# the paper's table (test full HR@10, NDCG@10, training seconds on their GPU, best epoch); ../shared/data/beauty
PAPER = {"bce": (0.0246, 0.0126, 521, 26), "shared3000": (0.0490, 0.0295, 296, 8), "ce": (0.0533, 0.0327, 332, 6)}


def run_one(name: str, data: str, epochs: int, out: Path, threads: str, seed: int = 0) -> dict:
    args = ["--config", str(CONFIG), f"data.path={data}", "--epochs", str(epochs), "log.tensorboard=false",
            "log.every_steps=1000", f"seed={seed}", *RUNS[name]]
    measured: dict = {}
    rows, wall = run_trainer(args, out / "runs" / f"beauty-{name}-seed{seed}", threads=threads, measure=measured)
    epoch_times = [r["epoch_time_s"] for r in rows if "epoch_time_s" in r]
    val = [r for r in rows if r.get("split") == "val"]
    best = next(r for r in rows if r.get("split") == "test" and r.get("checkpoint") == "best")
    best_epoch = max(val, key=lambda r: r["full_ndcg@10"])["epoch"] + 1
    paper = PAPER.get(name.split("_")[0])
    return dict(run=name, seed=seed, device=device_name(), overrides=RUNS[name], wall_s=round(wall, 1),
                epochs_budget=epochs, epochs_run=len(epoch_times), best_epoch=best_epoch,
                epoch_time_s=round(statistics.median(epoch_times[1:] or epoch_times), 2),
                val_time_s=round(statistics.median(r["eval_time_s"] for r in val), 2),
                peak_rss_mb=measured["peak_rss_mb"], val_curve=[(r["epoch"] + 1, r["full_ndcg@10"]) for r in val],
                test_full_hr10=best["full_hr@10"], test_full_ndcg10=best["full_ndcg@10"],
                paper_full_hr10=paper and paper[0], paper_full_ndcg10=paper and paper[1])


def label(row: dict) -> str:
    """A run's name, its seed when not 0 and its device when not the CPU."""
    seed = f" seed {row['seed']}" if row.get("seed") else ""
    device = f" ({row['device']})" if row.get("device", "cpu") != "cpu" else ""
    return f"{row['run']}{seed}{device}"


def device_name() -> str:
    """Where the trainer ran: its default device (the first GPU where torch sees one)."""
    import torch
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def plot(rows: list[dict], path: Path, device: str = "cpu") -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.5))
    for i, r in enumerate(rows):
        ep, nd = zip(*r["val_curve"])
        ax1.plot(ep, nd, c=f"C{i}", label=label(r))
        if r["paper_full_ndcg10"]:
            ax1.axhline(r["paper_full_ndcg10"], c=f"C{i}", ls=":", lw=1)
    ax1.set_xlabel("epoch"), ax1.set_ylabel("validation full NDCG@10 (dotted: the paper's test figure)")
    ax1.legend(fontsize=8)
    names = [label(r) for r in rows]
    x = range(len(rows))
    ax2.bar([i - 0.2 for i in x], [r["test_full_ndcg10"] for r in rows], 0.4, label="here (test, best.pt)")
    ax2.bar([i + 0.2 for i in x], [r["paper_full_ndcg10"] or 0 for r in rows], 0.4, label="the paper")
    ax2.set_xticks(list(x), names, rotation=30), ax2.set_ylabel("test full NDCG@10"), ax2.legend(fontsize=8)
    fig.suptitle(f"SASRec on Amazon Beauty (54,542 items; Klenitskiy & Vasilev's protocol), {device}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    p.add_argument("--data", default=str(REPO.parent / "shared" / "data" / "beauty" / "beauty.txt"))
    p.add_argument("--runs", default="bce,shared3000,ce", help=f"comma-separated, of: {', '.join(RUNS)}")
    p.add_argument("--epochs", type=int, default=100, help="the budget (early stopping may end sooner)")
    p.add_argument("--threads", default=os.environ.get("OMP_NUM_THREADS", "2"))
    p.add_argument("--out", default=str(REPO / "bench" / "results"))
    p.add_argument("--seed", type=int, default=0, help="the runs' seed (a report keeps one row per run and seed)")
    p.add_argument("--update", action="store_true", help="keep the other runs of the report this run updates")
    args = p.parse_args(argv)
    names = args.runs.split(",")
    unknown = set(names) - set(RUNS)
    if unknown:
        p.error(f"--runs: unknown {sorted(unknown)} (known: {', '.join(RUNS)})")
    if not Path(args.data).exists():
        print(f"bench/sasrec_beauty.py: {args.data} not found (Amazon Beauty is not shipped; point --data at "
              "its beauty.txt: one `user item` pair per line, each user's lines in time order)")
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report_path = out / "sasrec_beauty.json"
    rows = []
    for name in names:
        rows.append(run_one(name, args.data, args.epochs, out, args.threads, args.seed))
        r = rows[-1]
        print(f"{name}: test full HR@10 {r['test_full_hr10']:.4f} NDCG@10 {r['test_full_ndcg10']:.4f} (paper "
              f"{r['paper_full_hr10']} / {r['paper_full_ndcg10']}), best epoch {r['best_epoch']} of "
              f"{r['epochs_run']}, {r['epoch_time_s']:.1f} s/epoch", flush=True)
    if args.update and report_path.exists():
        old = json.loads(report_path.read_text())
        rows = [r for r in old["runs"] if r["run"] not in names or r.get("seed", 0) != args.seed] + rows
        rows.sort(key=lambda r: (list(RUNS).index(r["run"]), r.get("seed", 0)))

    report = dict(recipe="sasrec", dataset="beauty", config=str(CONFIG.relative_to(REPO)), runs=rows,
                  date=time.strftime("%Y-%m-%d %H:%M"),
                  machine=machine(threads=args.threads, device=device_name()))
    report_path.write_text(json.dumps(report, indent=1))
    try:
        plot(rows, out / "sasrec_beauty.png", report["machine"]["device"])
    except ImportError:             # a GPU machine without matplotlib: the PNG is drawn where the JSON goes
        print("no matplotlib here: the PNG is not drawn")
    print(f"{'run':<30}{'full HR@10':>11}{'paper':>8}{'full NDCG@10':>14}{'paper':>8}{'best':>6}{'s/epoch':>9}")
    for r in rows:
        print(f"{label(r):<30}{r['test_full_hr10']:>11.4f}{r['paper_full_hr10'] or '-':>8}"
              f"{r['test_full_ndcg10']:>14.4f}{r['paper_full_ndcg10'] or '-':>8}{r['best_epoch']:>6}"
              f"{r['epoch_time_s']:>9.1f}")
    print(f"wrote {report_path} and {out / 'sasrec_beauty.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
