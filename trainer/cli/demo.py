"""`make demo`: the suite's main job on an embedded default, with no data to fetch.

    python -m trainer.cli.demo [--epochs N] [--out runs]

Writes a synthetic sequential dataset, trains TiSASRec+mHC with 2-process DDP under torchrun (gloo on
CPUs; NCCL when there are two or more GPUs; one process on a single GPU), then prints the metrics table
and where the run directory and TensorBoard logs are.
"""
from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from trainer.engine.logging import read_metrics

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def processes() -> int:
    """2 ranks on CPUs or on >= 2 GPUs; 1 on a single GPU (NCCL cannot put two ranks on one device)."""
    import torch
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return 1 if gpus == 1 else 2


def table(run_dir: Path) -> str:
    """Validation rows and the final test row of metrics.jsonl as a text table."""
    rows = read_metrics(run_dir)
    cols = ["hr@10", "ndcg@10", "full_hr@10", "full_ndcg@10", "full_recall@20"]
    lines = [f"{'split':<13}{'epoch':>6} " + " ".join(f"{c:>15}" for c in cols)]
    for r in rows:
        if r["split"] in ("val", "test"):
            label = f"{r['split']} ({r['checkpoint']})" if "checkpoint" in r else r["split"]
            lines.append(f"{label:<13}{r['epoch']:>6} " + " ".join(f"{r.get(c, float('nan')):>15.4f}" for c in cols))
    epochs = [r["epoch_time_s"] for r in rows if "epoch_time_s" in r]
    if len(epochs) > 1:         # the first epoch carries the start-up (workers, allocator, caches): apart
        rest = epochs[1:]
        lines.append(f"time per epoch: {sum(rest) / len(rest):.2f} s (mean of epochs 2-{len(epochs)}; the first, "
                     f"with start-up, {epochs[0]:.2f} s)")
    elif epochs:
        lines.append(f"time per epoch: {epochs[0]:.2f} s (one epoch, start-up included)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=None, help="override the demo config's epochs")
    parser.add_argument("--out", default="runs", help="parent folder of the data and the run directory")
    args = parser.parse_args(argv)
    out = Path(args.out)
    data_dir, run_dir = out / "demo-data", out / f"demo-{time.strftime('%Y%m%d-%H%M%S')}"
    t0 = time.time()
    py = sys.executable
    subprocess.run([py, "-m", "trainer", "data", "synth", "sasrec", "--out", str(data_dir)], check=True)
    nproc = processes()
    cmd = [py, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-port", str(free_port()),
           "-m", "trainer", "train", "--config", str(REPO / "configs/sasrec/demo.yaml"),
           "--run-dir", str(run_dir), f"data.path={data_dir}"]
    if args.epochs:
        cmd += ["--epochs", str(args.epochs)]
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    print(f"training TiSASRec+mHC with {nproc}-process DDP: {' '.join(cmd[2:])}", flush=True)
    subprocess.run(cmd, check=True, env=env)
    print("\n" + table(run_dir))
    print(f"\nrun directory: {run_dir}\nTensorBoard:   tensorboard --logdir {run_dir / 'tb'}\n"
          f"evaluate:      python -m trainer eval --checkpoint {run_dir}   # its best.pt\n"
          f"demo wall time: {time.time() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
