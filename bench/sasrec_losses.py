"""SASRec's losses side by side on MovieLens-100K (issue 71 point 4): bce, ce, softmax over 64 / 256 / 1,000
negatives shared by a sequence, popularity-sampled with and without logQ, in-batch, gbce; three seeds each, one
epochs budget, best.pt and early stopping on full_ndcg@10; test full HR@10 / NDCG@10 of best.pt, seconds per
epoch, peak memory (max RSS) and the validation curves. Then the full softmax's memory at catalogue sizes the
data does not reach (27k, 100k, 1M items), and `ce` trained one epoch through the trainer at a generated 100k-item
catalogue. Writes bench/results/sasrec_losses.json + .png.

    python -m bench.sasrec_losses --data ../shared/data/ml-100k                          # the table (about 45 min)
    python -m bench.sasrec_losses --data ../shared/data/ml-100k --epochs 2 --seeds 1 --losses bce,ce --sizes 27000
    python -m bench.sasrec_losses --losses gbce256 --sizes "" --trained "" --update   # one loss again, the rest kept
    python -m bench.sasrec_losses --losses "" --sizes "" --update            # only ce trained at 100k items
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench.common import REPO, machine, run_trainer, trainer_env

LOSSES = {
    "bce": [],
    "ce": ["loss.kind=ce"],
    "shared64": ["loss.kind=sampled_softmax", "loss.shared_negatives=sequence", "data.train_negatives=64"],
    "shared256": ["loss.kind=sampled_softmax", "loss.shared_negatives=sequence", "data.train_negatives=256"],
    "shared1000": ["loss.kind=sampled_softmax", "loss.shared_negatives=sequence", "data.train_negatives=1000"],
    "popular256_logq": ["loss.kind=sampled_softmax", "loss.shared_negatives=sequence", "data.train_negatives=256",
                        "loss.negative_distribution=popularity"],
    "popular256_raw": ["loss.kind=sampled_softmax", "loss.shared_negatives=sequence", "data.train_negatives=256",
                       "loss.negative_distribution=popularity", "loss.logq=false"],
    "in_batch": ["loss.kind=sampled_softmax", "loss.shared_negatives=in_batch"],
    "gbce256": ["loss.kind=gbce", "loss.shared_negatives=sequence", "data.train_negatives=256"],
}

# the full softmax at a catalogue of ITEMS: positions of batch 128 x maxlen 200, width 50, forward and backward
MEMORY_PROBE = """
import resource, sys, time, torch
from trainer.recipes.sasrec.losses import chunk_for, full_softmax_ce
items, n, d = int(sys.argv[1]), 128 * 200, 50
torch.manual_seed(0)
h = torch.randn(n, d, requires_grad=True); w = torch.randn(items, d, requires_grad=True)
target = torch.randint(0, items, (n,)); scale = torch.full((n,), 1.0 / n)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
t0 = time.perf_counter(); full_softmax_ce(h, w, target, scale).backward(); seconds = time.perf_counter() - t0
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(f"{items} {chunk_for(items)} {(peak - before) / 1024:.1f} {seconds:.2f}")
"""


def run_loss(name: str, data: str, epochs: int, seed: int, out: Path, threads: str) -> dict:
    run_dir = out / "runs" / f"loss-{name}-{seed}"
    args = ["--config", str(REPO / "configs" / "sasrec" / "ml-100k.yaml"), f"data.path={data}", "--epochs", str(epochs),
            "--seed", str(seed), "train.eval_every_epochs=5", "train.early_stop_patience=4",
            "train.select_metric=full_ndcg@10", "log.tensorboard=false", "log.every_steps=1000",
            *LOSSES[name]]
    measured: dict = {}
    rows, wall = run_trainer(args, run_dir, threads=threads, measure=measured)
    epoch_times = [r["epoch_time_s"] for r in rows if "epoch_time_s" in r]
    steady = epoch_times[1:] or epoch_times
    val = [r for r in rows if r.get("split") == "val"]
    best = next(r for r in rows if r.get("split") == "test" and r.get("checkpoint") == "best")
    return dict(loss=name, seed=seed, wall_s=round(wall, 1), epochs_run=len(epoch_times),
                epoch_time_s=round(statistics.median(steady), 3), peak_rss_mb=measured["peak_rss_mb"],
                val_curve=[(r["epoch"] + 1, r["full_ndcg@10"]) for r in val],
                test_full_hr10=best["full_hr@10"], test_full_ndcg10=best["full_ndcg@10"])


def memory_probe(items: int, threads: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", MEMORY_PROBE, str(items)], env=trainer_env(threads), cwd=REPO,
                          capture_output=True, text=True, check=True)
    n, chunk, extra_mb, seconds = proc.stdout.split()
    plain_gb = 128 * 200 * int(n) * 4 / 1e9
    return dict(items=int(n), chunk_positions=int(chunk), extra_peak_mb=float(extra_mb),
                forward_backward_s=float(seconds), plain_logits_float32_gb=round(plain_gb, 2),
                plain_logits_bf16_gb=round(plain_gb / 2, 2))


def trained_catalogue(items: int, out: Path, threads: str, users: int = 2000) -> dict:
    """`ce` trained through the trainer at a generated catalogue of ITEMS: one epoch of USERS sequences of about 100
    items (maxlen 200, width 50, batch 128, the CPU path), then the test's full ranking of every user over every item:
    the epoch's seconds, the evaluation's, and the trainer's peak resident memory."""
    args = ["--recipe", "sasrec", "--epochs", "1", "loss.kind=ce", f"data.synthetic_users={users}",
            f"data.synthetic_items={items}", "data.synthetic_mean_len=100", "data.maxlen=200", "train.batch_size=128",
            "model.width=50", "model.time=false", "model.mhc=false", "log.tensorboard=false",
            "log.every_steps=1000"]
    measured: dict = {}
    rows, wall = run_trainer(args, out / "runs" / f"ce-catalogue-{items}", threads=threads, measure=measured)
    epoch = next(r for r in rows if "epoch_time_s" in r)
    test = next(r for r in rows if r.get("split") == "test")
    return dict(items=items, users=users, steps=epoch["step"], epoch_time_s=round(epoch["epoch_time_s"], 2),
                test_eval_time_s=round(test["eval_time_s"], 2), peak_rss_mb=measured["peak_rss_mb"],
                wall_s=round(wall, 1), test_full_ndcg10=test["full_ndcg@10"])


def summarise(rows: list[dict]) -> list[dict]:
    out = []
    for name in dict.fromkeys(r["loss"] for r in rows):
        mine = [r for r in rows if r["loss"] == name]
        stat = lambda key: (round(statistics.mean(r[key] for r in mine), 4),  # noqa: E731
                            round(statistics.pstdev(r[key] for r in mine), 4))
        out.append(dict(loss=name, seeds=len(mine), full_hr10=stat("test_full_hr10"),
                        full_ndcg10=stat("test_full_ndcg10"), epoch_time_s=stat("epoch_time_s")[0],
                        epochs_run=[r["epochs_run"] for r in mine], peak_rss_mb=max(r["peak_rss_mb"] for r in mine)))
    return out


def plot(rows: list[dict], table: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(16, 4.5))
    for i, t in enumerate(table):
        for j, r in enumerate(x for x in rows if x["loss"] == t["loss"]):
            ep, nd = zip(*r["val_curve"])
            ax1.plot(ep, nd, c=f"C{i}", alpha=0.7, label=t["loss"] if j == 0 else None)
    ax1.set_xlabel("epoch"), ax1.set_ylabel("val full NDCG@10"), ax1.legend(fontsize=7)
    names = [t["loss"] for t in table]
    ax2.bar(names, [t["full_ndcg10"][0] for t in table], yerr=[t["full_ndcg10"][1] for t in table],
            color=[f"C{i}" for i in range(len(table))])
    ax2.set_ylabel("test full NDCG@10 (best.pt, mean of seeds)")
    ax3.bar(names, [t["epoch_time_s"] for t in table], color=[f"C{i}" for i in range(len(table))])
    ax3.set_ylabel("seconds per epoch (CPU)")
    for ax in (ax2, ax3):
        ax.tick_params(axis="x", labelrotation=45)
    fig.suptitle("SASRec on MovieLens-100K by loss (maxlen 200, width 50, 2 blocks, batch 128; full ranking)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    p.add_argument("--data", default=str(REPO.parent / "shared" / "data" / "ml-100k"))
    p.add_argument("--epochs", type=int, default=100, help="the budget of every loss (early stopping may end sooner)")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--losses", default=",".join(LOSSES))
    p.add_argument("--sizes", default="27000,100000,1000000", help="catalogues for the full softmax's memory probe")
    p.add_argument("--trained", default="100000", help="catalogues at which `ce` trains one epoch through the "
                   "trainer on generated data (comma-separated; empty: none)")
    p.add_argument("--trained-users", type=int, default=2000, help="the generated users of those runs")
    p.add_argument("--threads", default=os.environ.get("OMP_NUM_THREADS", "2"))
    p.add_argument("--out", default=str(REPO / "bench" / "results"))
    p.add_argument("--update", action="store_true", help="keep the runs of the other losses and catalogues of the "
                   "report this run updates")
    args = p.parse_args(argv)
    losses = [x for x in args.losses.split(",") if x]
    unknown = set(losses) - set(LOSSES)
    if unknown:
        p.error(f"--losses: unknown {sorted(unknown)} (known: {', '.join(LOSSES)})")
    if not Path(args.data).exists():
        print(f"bench/sasrec_losses.py: {args.data} not found (MovieLens-100K is not shipped; point --data at it)")
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for name in losses:
        for seed in range(args.seeds):
            rows.append(run_loss(name, args.data, args.epochs, seed, out, args.threads))
            r = rows[-1]
            print(f"{name} seed {seed}: test full NDCG@10 {r['test_full_ndcg10']:.4f} HR@10 {r['test_full_hr10']:.4f}"
                  f", {r['epochs_run']} epochs, {r['epoch_time_s']:.2f} s/epoch, {r['peak_rss_mb']:.0f} MB", flush=True)
    memory = [memory_probe(int(n), args.threads) for n in filter(None, args.sizes.split(","))]
    trained = [trained_catalogue(int(n), out, args.threads, args.trained_users)
               for n in filter(None, args.trained.split(","))]
    report_path = out / "sasrec_losses.json"
    if args.update and report_path.exists():
        old = json.loads(report_path.read_text())
        ran = {r["loss"] for r in rows}
        rows = [r for r in old["runs"] if r["loss"] not in ran] + rows
        rows.sort(key=lambda r: list(LOSSES).index(r["loss"]))
        # the catalogues measured now replace theirs; the others' rows stay
        memory = sorted([m for m in old.get("full_softmax_memory", [])
                         if m["items"] not in {x["items"] for x in memory}] + memory, key=lambda m: m["items"])
        trained = sorted([t for t in old.get("full_softmax_trained", [])
                          if t["items"] not in {x["items"] for x in trained}] + trained, key=lambda t: t["items"])
    table = summarise(rows)

    report = dict(recipe="sasrec", dataset="ml-100k", epochs_budget=args.epochs, table=table, runs=rows,
                  full_softmax_memory=memory, full_softmax_trained=trained, date=time.strftime("%Y-%m-%d %H:%M"),
                  machine=machine(threads=args.threads))
    report_path.write_text(json.dumps(report, indent=1))
    plot(rows, table, out / "sasrec_losses.png")
    print(f"{'loss':<18}{'full HR@10':>16}{'full NDCG@10':>18}{'s/epoch':>9}{'peak MB':>9}  epochs run")
    for t in table:
        print(f"{t['loss']:<18}{t['full_hr10'][0]:>9.4f}±{t['full_hr10'][1]:.4f}{t['full_ndcg10'][0]:>11.4f}±"
              f"{t['full_ndcg10'][1]:.4f}{t['epoch_time_s']:>9.2f}{t['peak_rss_mb']:>9.0f}  {t['epochs_run']}")
    for m in memory:
        print(f"full softmax at {m['items']:,} items: {m['extra_peak_mb']:.0f} MB above the inputs (chunks of "
              f"{m['chunk_positions']} positions; the plain logits: {m['plain_logits_float32_gb']} GB float32), "
              f"{m['forward_backward_s']:.1f} s forward + backward")
    for t in trained:
        print(f"ce trained at {t['items']:,} items ({t['users']:,} generated users, {t['steps']} steps): "
              f"{t['epoch_time_s']:.1f} s per epoch, the test's full ranking {t['test_eval_time_s']:.1f} s, peak "
              f"{t['peak_rss_mb']:.0f} MB")
    print(f"wrote {out / 'sasrec_losses.json'} and {out / 'sasrec_losses.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
