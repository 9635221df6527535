"""Video benchmark: training throughput of the 3D CNNs on 17-frame clips read from the frame cache, FLOPs
per training sample, the share of step time spent waiting for the loader, and (on a GPU) MFU.
Writes JSON + PNG.

    python -m bench.video                                  # CPU: 17 x 128 x 128 grayscale clips
    python -m bench.video --size 256 --amp bf16 --peak-tflops 989 --batch 16   # a GPU (H100 bf16 dense peak)
    python -m bench.video --steps 3 --archs light --size 32 # smoke run
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

from bench.common import run_trainer

REPO = Path(__file__).resolve().parents[1]


def flops_per_sample(arch: str, clip: int, size: int) -> float:
    from trainer.recipes.video.model import VideoModelConfig, build, train_flops_per_clip
    return train_flops_per_clip(build(VideoModelConfig(arch=arch), 1, 8), (1, clip, size, size))


def run(arch: str, data: Path, args, out: Path) -> dict:
    run_dir = out / "runs" / f"video-{arch}-{args.size}"
    argv = ["--recipe", "video", f"data.path={data}", f"data.size={args.size}", f"data.clip_len={args.clip}",
            f"model.arch={arch}", "--batch-size", str(args.batch), "--epochs", "1", f"train.max_steps={args.steps}",
            f"log.every_steps={max(1, args.steps // 6)}", f"train.num_workers={args.workers}",
            "--amp", args.amp, "log.tensorboard=false", "ckpt.every_epochs=0", "data.val_fraction=0.2",
            "data.test_fraction=0"]
    rows, wall = run_trainer(argv, run_dir)
    windows = [r for r in rows if r["split"] == "train" and "samples_per_s" in r]
    steady = windows[1:] or windows                         # the first window includes start-up
    rate = statistics.median(r["samples_per_s"] for r in steady)
    wait = statistics.median(r["data_wait_frac"] for r in steady)
    flops = flops_per_sample(arch, args.clip, args.size)
    rec = dict(recipe="video", arch=arch, clip=[args.clip, args.size, args.size], batch=args.batch, steps=args.steps,
               amp=args.amp, workers=args.workers, samples_per_s=round(rate, 3),
               step_time_s=round(statistics.median(r["step_time_s"] for r in steady), 4),
               data_wait_frac=wait, train_gflop_per_sample=round(flops / 1e9, 2),
               achieved_tflops=round(rate * flops / 1e12, 4), wall_s=round(wall, 1),
               peak_gpu_mem_mb=max((r.get("gpu_mem_mb", 0) for r in windows), default=0))
    if args.peak_tflops:
        rec["mfu"] = round(rec["achieved_tflops"] / args.peak_tflops, 4)
    print(f"{arch:<8} {args.clip}x{args.size}x{args.size}: {rate:.2f} clips/s, data wait {wait:.1%}, "
          f"{flops / 1e9:.1f} GFLOP/sample, {rec['achieved_tflops'] * 1e3:.1f} GFLOP/s"
          + (f", MFU {rec['mfu']:.1%}" if "mfu" in rec else ""), flush=True)
    return rec


def plot(report: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    res = report["results"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    names = [r["arch"] for r in res]
    ax1.bar(names, [r["samples_per_s"] for r in res], color="C0")
    for i, r in enumerate(res):
        ax1.text(i, r["samples_per_s"], f"{r['samples_per_s']:.2f}", ha="center", va="bottom")
    ax1.set_ylabel("training clips / s"), ax1.set_title(f"{report['device']}, clips {res[0]['clip']}")
    ax2.bar(names, [100 * r["data_wait_frac"] for r in res], color="C1")
    ax2.set_ylabel("% of step time waiting for the loader"), ax2.set_ylim(0, 100)
    ax2.set_title(f"{res[0]['workers']} loader workers per rank")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    p.add_argument("--archs", default="mouse3d,light")
    p.add_argument("--size", type=int, default=128)
    p.add_argument("--clip", type=int, default=17)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--amp", default="auto", choices=["off", "bf16", "fp16", "auto"])
    p.add_argument("--peak-tflops", type=float, default=0.0, help="device peak for MFU (GPU runs)")
    p.add_argument("--out", default=str(REPO / "bench" / "results"))
    args = p.parse_args(argv)
    out = Path(args.out)
    data = out / "data" / f"video-synth-{args.size}"
    if not (data / "labels.csv").exists():
        from trainer.recipes.video.data import synth_videos
        synth_videos(data, videos=6, frames=120, size=max(args.size, 32), classes=4)
    import torch
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU ({os.cpu_count()} cores)"
    results = [run(a, data, args, out) for a in args.archs.split(",")]
    report = dict(recipe="video", device=device, results=results, date=time.strftime("%Y-%m-%d %H:%M"),
                  machine=dict(python=platform.python_version(), torch=str(torch.__version__),
                               cuda=torch.version.cuda, threads=os.environ.get("OMP_NUM_THREADS", "2")))
    name = f"video-{'gpu' if torch.cuda.is_available() else 'cpu'}"
    (out / f"{name}.json").write_text(json.dumps(report, indent=1))
    plot(report, out / f"{name}.png")
    print(f"wrote {out / (name + '.json')} and {out / (name + '.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
