"""HAR benchmark (CPU): BasicMotions accuracy over seeds and fusion modes, and training throughput on
UCI-HAR-sized windows for one process, 2-rank DDP (gloo) and --strategy dp. Writes JSON + PNG.

    python -m bench.har                                   # BasicMotions from ../shared/data, synthetic UCI HAR size
    python -m bench.har --uci "data/UCI HAR Dataset"      # also the full uci-har.yaml run on the real data
    python -m bench.har --seeds 0 --modes first --steps 6 --basic-epochs 3 --synth-preset tiny   # smoke run
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench.common import machine, run_trainer

REPO = Path(__file__).resolve().parents[1]

BASIC = REPO.parent / "shared" / "data" / "BasicMotions"


def run(args: list[str], run_dir: Path, threads: int = 2, ranks: int = 1) -> tuple[list[dict], float]:
    """Train in a fresh run directory; (metrics.jsonl rows, wall seconds)."""
    return run_trainer(["log.tensorboard=false", *args], run_dir, threads=threads, ranks=ranks)


def test_of(rows: list[dict]) -> dict:
    """The test record of the best checkpoint (or the final one when they coincide)."""
    tests = {r.get("checkpoint", "final"): r for r in rows if r["split"] == "test"}
    return tests.get("best", tests.get("final"))


def basicmotions(data: Path, seeds: list[int], modes: list[str], out: Path, epochs: int = 0) -> list[dict]:
    """configs/har/basicmotions.yaml per (mode, seed): test accuracy/macro-F1 and training time."""
    results = []
    for mode in modes:
        for seed in seeds:
            rows, wall = run(["--config", str(REPO / "configs/har/basicmotions.yaml"), f"data.path={data}",
                              "--seed", str(seed), "--mode", mode, "ckpt.every_epochs=0",
                              *(["--epochs", str(epochs)] if epochs else [])],
                             out / "runs" / f"basic-{mode}-{seed}")
            test = test_of(rows)
            train_s = sum(r["epoch_time_s"] for r in rows if "epoch_time_s" in r)
            results.append(dict(mode=mode, seed=seed, test_accuracy=test["accuracy"], test_macro_f1=test["macro_f1"],
                                train_time_s=round(train_s, 2), wall_s=round(wall, 1),
                                val_curve=[(r["epoch"] + 1, r["macro_f1"]) for r in rows if r["split"] == "val"]))
            print(f"BasicMotions mode={mode} seed={seed}: test accuracy {test['accuracy']:.4f}, "
                  f"macro-F1 {test['macro_f1']:.4f}, training {train_s:.1f} s", flush=True)
    return results


def throughput(data: Path, steps: int, out: Path) -> list[dict]:
    """Samples/s (windows, not channel series) of uci-har.yaml for a fixed number of optimizer steps."""
    setups = [("single", 1, 2, []), ("ddp", 2, 1, []), ("dp", 1, 2, ["--strategy", "dp", "--gpu-ids", "0,1"])]
    results = []
    for name, ranks, threads, extra in setups:
        rows, wall = run(["--config", str(REPO / "configs/har/uci-har.yaml"), f"data.path={data}", "--epochs", "1",
                          f"train.max_steps={steps}", f"log.every_steps={max(2, steps // 12)}",
                          "ckpt.every_epochs=0", *extra],
                         out / "runs" / f"throughput-{name}", threads=threads, ranks=ranks)
        windows = [r["samples_per_s"] for r in rows if r["split"] == "train" and "samples_per_s" in r]
        rate = statistics.median(windows[1:] or windows)          # the first window includes warm-up
        results.append(dict(setup=name, ranks=ranks, threads_per_rank=threads, steps=steps, batch_per_rank=64,
                            samples_per_s=round(rate, 1), wall_s=round(wall, 1)))
        print(f"throughput {name:<6} ranks={ranks} threads/rank={threads}: {rate:.0f} windows/s", flush=True)
    return results


def uci_accuracy(data: Path, out: Path) -> dict:
    rows, wall = run(["--config", str(REPO / "configs/har/uci-har.yaml"), f"data.path={data}"], out / "runs" / "uci")
    test = test_of(rows)
    return dict(test_accuracy=test["accuracy"], test_macro_f1=test["macro_f1"], wall_s=round(wall, 1),
                epochs=1 + max(r["epoch"] for r in rows if r["split"] == "val"))


def plot(report: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    modes = sorted({r["mode"] for r in report["basicmotions"]}, key=["flatten", "average", "first"].index)
    accs = [[r["test_accuracy"] for r in report["basicmotions"] if r["mode"] == m] for m in modes]
    ax1.bar(modes, [statistics.mean(a) for a in accs], color="C0")
    for i, a in enumerate(accs):
        ax1.scatter([i] * len(a), a, c="k", s=12, zorder=3)
        ax1.text(i, statistics.mean(a), f"{statistics.mean(a):.3f}", ha="center", va="bottom")
    ax1.axhline(0.97, ls="--", c="gray", label="target 0.97")
    ax1.set_ylim(0, 1.05), ax1.set_ylabel("test accuracy (best checkpoint)"), ax1.legend(loc="lower right")
    ax1.set_title(f"BasicMotions, seeds {report['seeds']}")
    names = [f"{r['setup']}{' (1 device)' if r['setup'] == 'dp' else ''}\n{r['ranks']} rank x "
             f"{r['threads_per_rank']} thr" for r in report["throughput"]]
    rates = [r["samples_per_s"] for r in report["throughput"]]
    ax2.bar(names, rates, color=["C0", "C1", "C2"][: len(rates)])
    for i, v in enumerate(rates):
        ax2.text(i, v, f"{v:.0f}", ha="center", va="bottom")
    ax2.set_ylabel("training windows / s (CPU)")
    ax2.set_title("9 x 128 windows, " + ("UCI HAR" if report["throughput_data"] == "real UCI HAR" else "synthetic"))
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    p.add_argument("--basic", default=str(BASIC), help="BasicMotions folder (a synthetic stand-in if missing)")
    p.add_argument("--uci", help="real 'UCI HAR Dataset' folder: also train configs/har/uci-har.yaml on it")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--modes", default="flatten,average,first")
    p.add_argument("--steps", type=int, default=60, help="optimizer steps per throughput run")
    p.add_argument("--basic-epochs", type=int, default=0, help="BasicMotions epochs (0: the config's 30)")
    p.add_argument("--synth-preset", choices=["uci-har", "tiny"], default="uci-har",
                   help="size of the synthetic throughput data when --uci is not given (tiny: smoke runs)")
    p.add_argument("--out", default=str(REPO / "bench" / "results"))
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    basic = Path(args.basic)
    if not basic.exists():
        print(f"{basic} missing: BasicMotions figures come from a synthetic stand-in")
        basic = out / "data" / "basic-synth"
        subprocess.run([sys.executable, "-m", "trainer", "data", "synth", "har", "--out", str(basic)], check=True,
                       cwd=REPO, capture_output=True)
    synth = out / "data" / f"{args.synth_preset}-synth"
    if args.uci is None and not (synth / "UCI HAR Dataset" / "train" / "y_train.txt").exists():
        subprocess.run([sys.executable, "-m", "trainer", "data", "synth", "har", "--preset", args.synth_preset, "--out",
                        str(synth)], check=True, cwd=REPO, capture_output=True)
    report = dict(recipe="har", seeds=args.seeds, basicmotions_data=str(basic),
                  basicmotions=basicmotions(basic, args.seeds, args.modes.split(","), out, args.basic_epochs),
                  throughput_data="real UCI HAR" if args.uci
                  else f"synthetic, UCI HAR layout, {args.synth_preset} size",
                  throughput=throughput(Path(args.uci) if args.uci else synth, args.steps, out),
                  uci_har=uci_accuracy(Path(args.uci), out) if args.uci else
                  dict(skipped="no --uci folder (archive.ics.uci.edu is not reachable from the build machines)"),
                  machine=machine(device="cpu"),
                  date=time.strftime("%Y-%m-%d %H:%M"))
    by_mode: dict[str, list[float]] = {}
    for r in report["basicmotions"]:
        by_mode.setdefault(r["mode"], []).append(r["test_accuracy"])
    report["basicmotions_mean_accuracy"] = {m: round(statistics.mean(v), 4) for m, v in by_mode.items()}
    single = next(r["samples_per_s"] for r in report["throughput"] if r["setup"] == "single")
    for r in report["throughput"]:
        r["vs_single"] = round(r["samples_per_s"] / single, 3)
    (out / "har.json").write_text(json.dumps(report, indent=1))
    plot(report, out / "har.png")
    print("mean BasicMotions test accuracy by mode:", report["basicmotions_mean_accuracy"])
    print(f"wrote {out / 'har.json'} and {out / 'har.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
