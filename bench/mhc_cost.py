"""What mHC costs its base model per training epoch, epochs interleaved in one process so that the machine's
drift (a third within minutes on these VMs) hits every variant alike. Writes bench/results/mhc_cost.{json,png}.

    python -m bench.mhc_cost --data ../shared/data/ml-100k          # the README's figures (15 rounds)
    python -m bench.mhc_cost --data "" --rounds 1                    # generated data (no ../shared)

Variants: SASRec, SASRec+mHC, TiSASRec, TiSASRec+mHC with the fused CPU kernels (model.mhc_fused, the
default), and both mHC variants on the PyTorch path (model.mhc_fused=false) for comparison; bench/sasrec.py's
settings (maxlen 200, hidden 50, 2 blocks, 1 head, dropout 0.2, batch 128, fused Adam). One round is one epoch
of every variant, in an order rotated each round; a variant's cost is the median over rounds of its epoch
divided by its base model's epoch in the same round.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from bench.sasrec_profile import epoch, machine
from bench.sasrec_stock import SETTINGS, bench_data
from trainer.native import memory
from trainer.recipes import kernels as cpu_kernels
from trainer.recipes.sasrec.config import SeqRecConfig
from trainer.recipes.sasrec.model import SeqRec

REPO = Path(__file__).resolve().parents[1]

# variant: (time-aware attention, mHC, fused kernels, its base variant)
VARIANTS = {
    "sasrec": (False, False, True, None),
    "sasrec_mhc": (False, True, True, "sasrec"),
    "sasrec_mhc_pytorch": (False, True, False, "sasrec"),
    "tisasrec": (True, False, True, None),
    "tisasrec_mhc": (True, True, True, "tisasrec"),
    "tisasrec_mhc_pytorch": (True, True, False, "tisasrec"),
}


def build(name: str, num_items: int, seed: int):
    time_aware, mhc, kernels, _ = VARIANTS[name]
    torch.manual_seed(seed)
    s = SETTINGS
    model = SeqRec(SeqRecConfig(time=time_aware, mhc=mhc, mhc_fused=kernels, width=s["width"], depth=s["depth"],
                                heads=s["heads"], dropout=s["dropout"]), num_items, s["maxlen"]).train()
    return model, torch.optim.Adam(model.parameters(), lr=s["lr"], betas=s["betas"], fused=True)


def measure(args) -> dict:
    s = SETTINGS
    data, _, loader, source = bench_data(args.data, args.seed)
    names = args.variants.split(",")
    models = {name: build(name, data.num_items, args.seed) for name in names}
    kernels = cpu_kernels.load() is not None                      # built before any timing
    for model, opt in models.values():                          # warm-up
        epoch(model, opt, loader)
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(args.rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            times[name].append(epoch(*models[name], loader)["total"])
    ratios = {}
    for name in names:
        base = VARIANTS[name][3]
        if base in times:
            per_round = [a / b for a, b in zip(times[name], times[base])]
            ratios[name] = dict(vs=base, median=round(statistics.median(per_round), 3),
                                range=[round(min(per_round), 3), round(max(per_round), 3)],
                                rounds=[round(v, 3) for v in per_round])
    return dict(source=source, settings={**s, "betas": list(s["betas"])}, rounds=args.rounds,
                fused_kernels_built=kernels, kernels_unavailable=cpu_kernels.unavailable_reason(),
                epoch_s={k: [round(t, 3) for t in v] for k, v in times.items()},
                epoch_median_s={k: round(statistics.median(v), 3) for k, v in times.items()},
                ratios=ratios, machine=machine(), date=time.strftime("%Y-%m-%d %H:%M"))


def plot(report: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for name, ts in report["epoch_s"].items():
        ax1.plot(range(1, len(ts) + 1), ts, marker="o", ms=3, label=name)
    ax1.set_xlabel("round"), ax1.set_ylabel("seconds per training epoch (CPU)"), ax1.set_ylim(bottom=0)
    ax1.legend(fontsize=7)
    names = list(report["ratios"])
    med = [report["ratios"][n]["median"] for n in names]
    err = [[m - report["ratios"][n]["range"][0] for n, m in zip(names, med)],
           [report["ratios"][n]["range"][1] - m for n, m in zip(names, med)]]
    ax2.bar(names, med, yerr=err, capsize=4, color=[f"C{i}" for i in range(len(names))])
    ax2.axhline(1.3, ls="--", c="gray", label="target 1.3x")
    for i, m in enumerate(med):
        ax2.text(i, m, f"{m:.2f}x", ha="center", va="bottom")
    ax2.set_ylabel("epoch / base model's epoch (median, range)"), ax2.tick_params(axis="x", labelrotation=15)
    ax2.legend(fontsize=8)
    fig.suptitle("mHC's cost per epoch, interleaved in one process (ml-100k settings, maxlen 200)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    p.add_argument("--data", default=str(REPO.parent / "shared" / "data" / "ml-100k"),
                   help="MovieLens-100K folder; empty or missing: generated data of its size")
    p.add_argument("--rounds", type=int, default=15, help="interleaved epochs of every variant (after a warm-up)")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(REPO / "bench" / "results"))
    args = p.parse_args(argv)
    unknown = set(args.variants.split(",")) - set(VARIANTS)
    if unknown:
        p.error(f"--variants: unknown {sorted(unknown)}; choose from {', '.join(VARIANTS)}")
    memory.reuse_freed_memory()          # as the engine does for every recipe before it builds anything
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = measure(args)
    (out / "mhc_cost.json").write_text(json.dumps(report, indent=1))
    plot(report, out / "mhc_cost.png")
    print(f"data: {report['source']}; {args.rounds} rounds; fused kernels built: {report['fused_kernels_built']}")
    for name, med in report["epoch_median_s"].items():
        r = report["ratios"].get(name)
        cost = f"  {r['median']:.3f}x {r['vs']} (range {r['range'][0]}-{r['range'][1]})" if r else ""
        print(f"{name:<22}{med:>7.3f} s/epoch{cost}")
    print(f"wrote {out / 'mhc_cost.json'} and {out / 'mhc_cost.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
