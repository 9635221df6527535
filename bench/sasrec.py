"""SASRec / TiSASRec / TiSASRec+mHC on MovieLens-100K (CPU): time per epoch, sampled-evaluation time,
metric curves, and the reference port's figures beside ours. Writes JSON + PNG.

    python -m bench.sasrec --data ../shared/data/ml-100k                 # the full 200-epoch runs
    python -m bench.sasrec --data ../shared/data/ml-100k --epochs 3 --variants sasrec   # smoke run
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

from bench.common import machine, run_trainer, trainer_cmd, trainer_env

REPO = Path(__file__).resolve().parents[1]

# pmixer/SASRec.pytorch measured on this machine kind (issue 3): maxlen 200, hidden 50, 2 blocks, 1 head,
# dropout 0.2, batch 128, lr 1e-3, 200 epochs, CPU
REFERENCE = dict(name="pmixer/SASRec.pytorch", epoch_time_s=3.2, eval_time_s=3.0, test_ndcg10=0.416,
                 test_hr10=0.684, best_test_ndcg10=0.423, best_test_hr10=0.706)
VARIANTS = {
    "sasrec": ("configs/sasrec/ml-100k.yaml", []),
    "sasrec_mhc": ("configs/sasrec/ml-100k.yaml", ["model.mhc=true"]),
    "tisasrec": ("configs/tisasrec/ml-100k.yaml", []),
    "tisasrec_mhc": ("configs/tisasrec/ml-100k.yaml", ["model.mhc=true"]),
}
MHC_BASE = {"sasrec_mhc": "sasrec", "tisasrec_mhc": "tisasrec"}


def run_variant(name: str, data: str, epochs: int, out: Path, seed: int) -> dict:
    """Train one variant in a subprocess, then evaluate its best checkpoint with full ranking."""
    config, extra = VARIANTS[name]
    run_dir = out / "runs" / name
    args = ["--config", str(REPO / config), "--epochs", str(epochs), "--seed", str(seed), f"data.path={data}",
            "eval.full_ranking=false", f"train.eval_every_epochs={max(1, min(20, epochs))}",
            "log.tensorboard=false", "log.every_steps=1000", *extra]
    rows, wall = run_trainer(args, run_dir, show=True)
    epochs_t = [r["epoch_time_s"] for r in rows if "epoch_time_s" in r]
    sinkhorn = [r["mhc_sinkhorn_iters"] for r in rows if "mhc_sinkhorn_iters" in r]
    row_error = [r["mhc_row_error"] for r in rows if "mhc_row_error" in r]
    steady = epochs_t[1:] or epochs_t                        # the first epoch includes warm-up
    val = [r for r in rows if r["split"] == "val"]
    test = {r["checkpoint"]: r for r in rows if r["split"] == "test"}
    report = run_dir / "eval-full.json"
    subprocess.run(trainer_cmd("eval", "--checkpoint", str(run_dir / "checkpoints" / "best.pt"), "--splits", "test",
                               "--out", str(report), "eval.full_ranking=true"),
                   check=True, env=trainer_env(), cwd=REPO, capture_output=True, text=True)
    full_test = json.loads(report.read_text())["test"]
    return dict(recipe="sasrec", variant=name, epochs=epochs, wall_s=round(wall, 1),
                epoch_time_s=round(sum(steady) / len(steady), 3),
                epoch_time_median_s=round(statistics.median(steady), 3), epoch_times_s=epochs_t,
                eval_time_s=round(sum(r["eval_time_s"] for r in val) / max(len(val), 1), 3),
                users=val[-1]["users"] if val else 0,
                **(dict(mhc_sinkhorn_iters_mean=round(sum(sinkhorn) / len(sinkhorn), 2),
                        mhc_sinkhorn_iters_first_last=[sinkhorn[0], sinkhorn[-1]],
                        mhc_row_error_first_last_max=[row_error[0], row_error[-1], max(row_error)])
                   if sinkhorn else {}),
                val_curve=[(r["epoch"] + 1, r["ndcg@10"], r["hr@10"]) for r in val],
                test_final=dict(ndcg10=test["final"]["ndcg@10"], hr10=test["final"]["hr@10"]),
                test_best=dict(ndcg10=test["best"]["ndcg@10"], hr10=test["best"]["hr@10"]),
                test_best_full={k: v for k, v in full_test.items() if k.startswith("full_")})


def plot(results: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for r in results:
        ep, ndcg, _ = zip(*r["val_curve"]) if r["val_curve"] else ((), (), ())
        ax1.plot(ep, ndcg, marker="o", label=r["variant"])
    ax1.axhline(REFERENCE["test_ndcg10"], ls="--", c="gray", label="reference test NDCG@10 (200 ep)")
    ax1.set_xlabel("epoch"), ax1.set_ylabel("val NDCG@10 (sampled, 100 negatives)"), ax1.legend()
    names = [r["variant"] for r in results] + ["reference SASRec"]
    times = [r["epoch_time_s"] for r in results] + [REFERENCE["epoch_time_s"]]
    ax2.bar(names, times, color=[f"C{i}" for i in range(len(results))] + ["gray"])
    ax2.tick_params(axis="x", labelrotation=20)
    ax2.set_ylabel("seconds per training epoch (CPU)")
    for i, t in enumerate(times):
        ax2.text(i, t, f"{t:.2f}", ha="center", va="bottom")
    fig.suptitle("MovieLens-100K, maxlen 200, hidden 50, 2 blocks, batch 128")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    p.add_argument("--data", default=str(REPO.parent / "shared" / "data" / "ml-100k"))
    p.add_argument("--epochs", type=int, default=200)
    p.add_argument("--variants", default="sasrec,sasrec_mhc,tisasrec,tisasrec_mhc")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(REPO / "bench" / "results"))
    args = p.parse_args(argv)
    if not Path(args.data).exists():
        print(f"bench/sasrec.py: {args.data} not found (MovieLens-100K is not shipped; point --data at it)")
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = [run_variant(v, args.data, args.epochs, out, args.seed) for v in args.variants.split(",")]

    by = {r["variant"]: r for r in results}
    def ratios_of(field: str, suffix: str = "") -> dict[str, float]:
        out = {f"{v}_vs_{b}{suffix}": round(by[v][field] / by[b][field], 3)
               for v, b in MHC_BASE.items() if v in by and b in by}
        if "sasrec" in by:
            out[f"sasrec_vs_reference{suffix}"] = round(by["sasrec"][field] / REFERENCE["epoch_time_s"], 3)
        return out
    # medians too: a shared VM's stalls lengthen a few epochs by 50% or more, which the mean carries
    ratios = {**ratios_of("epoch_time_s"), **ratios_of("epoch_time_median_s", "_median")}
    report = dict(recipe="sasrec", dataset="ml-100k", reference=REFERENCE, results=results, epoch_time_ratios=ratios,
                  machine=machine(threads=os.environ.get("OMP_NUM_THREADS", "2")),
                  date=time.strftime("%Y-%m-%d %H:%M"))
    (out / "sasrec.json").write_text(json.dumps(report, indent=1))
    plot(results, out / "sasrec.png")
    print(f"{'variant':<14}{'s/epoch':>9}{'eval s':>8}{'test NDCG@10':>14}{'test HR@10':>12}  (best checkpoint)")
    for r in results:
        print(f"{r['variant']:<14}{r['epoch_time_s']:>9.2f}{r['eval_time_s']:>8.2f}"
              f"{r['test_best']['ndcg10']:>14.4f}{r['test_best']['hr10']:>12.4f}")
    print(f"{'reference':<14}{REFERENCE['epoch_time_s']:>9.2f}{REFERENCE['eval_time_s']:>8.2f}"
          f"{REFERENCE['test_ndcg10']:>14.4f}{REFERENCE['test_hr10']:>12.4f}  (after 200 epochs)")
    print("epoch-time ratios:", ratios)
    print(f"wrote {out / 'sasrec.json'} and {out / 'sasrec.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
