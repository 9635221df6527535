"""`trainer predict` on the CPU (issue 72 point 4): SASRec's top-10 for every user of MovieLens-100K (1 and 2 ranks),
the same at MovieLens-20M's shape (138,493 users, 26,744 items, 20M interactions, generated; a sample of users,
the rate per user), and the video recipe's frames per second on the real H.264 clip. Writes
bench/results/predict.json + .png.

    python -m bench.predict                                   # ml-100k, the 20M shape, video (about 10 min)
    python -m bench.predict --skip-20m --skip-video           # ml-100k alone
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from bench.common import REPO, run_trainer, trainer_cmd, trainer_env

ML20M = dict(users=138_493, items=26_744, mean_len=144)


def predict(run: Path, out: Path, *args: str, ranks: int = 1, threads: str = "2") -> dict:
    """One `trainer predict` (fresh output); its own count and seconds, from its log."""
    out.unlink(missing_ok=True)
    cmd = trainer_cmd("predict", "--checkpoint", str(run), "--out", str(out), *args, ranks=ranks)
    t0 = time.time()
    proc = subprocess.run(cmd, env=trainer_env(threads), cwd=REPO, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    found = re.search(r"predictions of (\d+) (\w+): .* \(([\d.]+) s\)", proc.stderr)
    count, what, seconds = int(found.group(1)), found.group(2), float(found.group(3))
    return dict(ranks=ranks, units=count, unit=what, predict_s=seconds, per_s=round(count / max(seconds, 1e-9), 1),
                wall_s=round(time.time() - t0, 1), rows=sum(1 for _ in open(out)) - 1)


def ml100k(data: str, out: Path, threads: str) -> dict:
    run = out / "runs" / "predict-ml100k"
    run_trainer(["--config", str(REPO / "configs" / "sasrec" / "ml-100k.yaml"), f"data.path={data}", "--epochs", "1",
                 "log.tensorboard=false", "eval.full_ranking=false"], run, threads=threads)
    return dict(one=predict(run, out / "runs" / "ml100k-top10.csv", "--top-k", "10", threads=threads),
                two=predict(run, out / "runs" / "ml100k-top10.csv", "--top-k", "10", "--part-size", "256", ranks=2,
                            threads="1"))


def ml20m_shape(out: Path, sample: int, threads: str) -> dict:
    """A model at the 20M shape trained one step (its speed is the point, not its quality); a sample of users."""
    from trainer.recipes.sasrec.sequences import synthesize, write_udata
    data = out / "data" / "ml20m-shape.data"
    if not data.exists():
        write_udata(synthesize(ML20M["users"], ML20M["items"], ML20M["mean_len"], seed=0, vectorized=True), data)
    run = out / "runs" / "predict-ml20m"
    run_trainer(["--recipe", "sasrec", f"data.path={data}", "data.maxlen=200", "model.time=false", "model.mhc=false",
                 "train.max_steps=1", "--epochs", "1", "log.tensorboard=false", "eval.max_users=10",
                 "eval.full_ranking=false"], run, threads=threads)
    users = out / "runs" / "ml20m-users.txt"
    users.write_text("".join(f"{u}\n" for u in range(1, ML20M["users"] + 1, ML20M["users"] // sample)))
    return predict(run, out / "runs" / "ml20m-top10.csv", "--top-k", "10", "--users", str(users), threads=threads)


def video(clip: Path, out: Path, threads: str) -> dict:
    run = out / "runs" / "predict-video"
    run_trainer(["--recipe", "video", "model.arch=light", "data.size=64", "data.synthetic_videos=4",
                 "data.synthetic_frames=30", "train.num_workers=0", "--epochs", "1", "log.tensorboard=false",
                 f"data.cache={out / 'runs' / 'predict-video-synth'}"], run, threads=threads)
    folder = out / "data" / "predict-video"
    folder.mkdir(parents=True, exist_ok=True)
    target = folder / clip.name
    if not target.exists():
        target.write_bytes(clip.read_bytes())
    labels = out / "runs" / "video-frames.csv"
    predict(run, labels, "--data", str(folder), threads=threads)              # extracts the frames first
    return predict(run, labels, "--data", str(folder), threads=threads)       # from the frame cache


def plot(report: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = [(f"ml-100k users, {r['ranks']} rank(s)", r["per_s"]) for r in report.get("ml100k", {}).values()]
    if "ml20m_shape" in report:
        rows.append(("20M-shape users, 1 rank", report["ml20m_shape"]["per_s"]))
    if "video" in report:
        rows.append(("video frames, 1 rank", report["video"]["per_s"]))
    fig, ax = plt.subplots(figsize=(8, 3.5))
    ax.barh([r[0] for r in rows], [r[1] for r in rows], color=[f"C{i}" for i in range(len(rows))])
    for i, (_, v) in enumerate(rows):
        ax.text(v, i, f" {v:,.0f}/s", va="center")
    ax.set_xlabel("predicted per second (CPU, 2 cores)")
    fig.suptitle("trainer predict: SASRec top-10 per user, video labels per frame")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    p.add_argument("--data", default=str(REPO.parent / "shared" / "data" / "ml-100k"))
    p.add_argument("--video", default=str(REPO.parent / "shared" / "data" / "videos" / "carphone_pristine.mp4"))
    p.add_argument("--sample", type=int, default=4000, help="users scored at the 20M shape")
    p.add_argument("--skip-20m", action="store_true")
    p.add_argument("--skip-video", action="store_true")
    p.add_argument("--threads", default=os.environ.get("OMP_NUM_THREADS", "2"))
    p.add_argument("--out", default=str(REPO / "bench" / "results"))
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report: dict = dict(date=time.strftime("%Y-%m-%d %H:%M"), threads=args.threads, cpus=os.cpu_count())
    if Path(args.data).exists():
        report["ml100k"] = ml100k(args.data, out, args.threads)
    else:
        print(f"bench/predict.py: {args.data} not found: the ml-100k rows are left out")
    if not args.skip_20m:
        report["ml20m_shape"] = ml20m_shape(out, args.sample, args.threads)
    if not args.skip_video and Path(args.video).exists():
        report["video"] = video(Path(args.video), out, args.threads)
    (out / "predict.json").write_text(json.dumps(report, indent=1) + "\n")
    plot(report, out / "predict.png")
    print(json.dumps(report, indent=1))
    print(f"wrote {out / 'predict.json'} and {out / 'predict.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
