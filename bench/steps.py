"""ATen ops and host syncs per optimizer step of every recipe, on the CPU-shaped and the GPU-shaped path, counted
with a dispatch mode on this CPU (bench/opcount.py): what a GPU step would launch and wait for, which
times on a shared CPU cannot show. Writes bench/results/steps.json and prints the table.

    python -m bench.steps                 # every row (about a minute; the C++ kernels built first)
    python -m bench.steps --rows sasrec   # rows whose recipe starts so

The GPU-shaped path is forced here with train.gpu_path=on (on a CUDA device it is the default). "CUDA before" is
the CPU-shaped step without the C++ kernels (they do not run on GPUs): what a CUDA device ran before the GPU
path (length buckets, packing, host-read Sinkhorn stops). The CPU path's counts are its own: it packs the real
positions and runs the C++ kernels, so fewer, larger ops; its syncs are the length buckets' and the kernels' host
reads, cheap on a CPU, fatal to a GPU's queue.
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

from bench.opcount import step_counts

REPO = Path(__file__).resolve().parents[1]

SAS, BIG = ["model.time=false", "model.mhc=false"], ["data.maxlen=200", "train.batch_size=128"]
VIDEO = ["model.arch=light", "data.size=32", "data.clip_len=9", "data.synthetic_videos=4", "data.synthetic_frames=30",
         "train.num_workers=0", "train.batch_size=4"]
ROWS = [  # (name, recipe, overrides)
    ("SASRec maxlen 200 b128", "sasrec", SAS + BIG),
    ("TiSASRec maxlen 200 b128", "sasrec", ["model.time=true", "model.mhc=false"] + BIG),
    ("SASRec+mHC maxlen 200 b128", "sasrec", ["model.time=false", "model.mhc=true"] + BIG),
    ("TiSASRec+mHC maxlen 200 b128", "sasrec", BIG),
    ("HAR cnn b32", "har", []),
    ("HAR transformer b32", "har", ["model.encoder=transformer"]),
    ("KGAT b1024", "kgat", ["train.batch_size=1024"]),
    ("video light 9x32x32 b4", "video", VIDEO),
]
# before: the CPU-shaped step without the C++ kernels, which is what a CUDA device ran before the GPU path
PATHS = (("before", "train.gpu_path=off model.attention_fused=false model.mhc_fused=false"),
         ("cpu", "train.gpu_path=off"), ("gpu", "train.gpu_path=on"))


def measure(rows) -> list[dict]:
    out = []
    for name, recipe, overrides in rows:
        row = dict(name=name, recipe=recipe, overrides=overrides)
        for path, key in PATHS:
            t0 = time.perf_counter()
            keys = [k for k in key.split() if recipe == "sasrec" or not k.startswith("model.")]
            c = step_counts(recipe, [*keys, *overrides])
            row[path] = dict(ops=c.ops, data_ops=c.data_ops, syncs=c.syncs, sync_names=c.sync_names,
                             seconds=round(time.perf_counter() - t0, 1))
        out.append(row)
        print(table([row], header=not out[:-1]), flush=True)
    return out


def table(rows: list[dict], header: bool = True) -> str:
    lines = [f"{'step':30s} {'CUDA before':>11s} {'syncs':>5s} {'CPU path':>9s} {'syncs':>5s} {'GPU path':>9s} "
             f"{'syncs':>5s} {'batch (GPU)':>11s}"] if header else []
    for r in rows:
        b, c, g = r["before"], r["cpu"], r["gpu"]
        lines.append(f"{r['name']:30s} {b['ops']:11d} {b['syncs']:5d} {c['ops']:9d} {c['syncs']:5d} {g['ops']:9d} "
                     f"{g['syncs']:5d} {g['data_ops']:11d}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="", help="only the rows whose recipe starts so (e.g. sasrec)")
    ap.add_argument("--out", default="", help="default bench/results/steps.json (steps-ROWS.json with --rows)")
    args = ap.parse_args(argv)
    args.out = args.out or str(REPO / "bench" / "results" / f"steps{'-' + args.rows if args.rows else ''}.json")
    torch.set_num_threads(1)
    rows = measure([r for r in ROWS if r[1].startswith(args.rows)])
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(dict(
        what="ATen ops and host syncs per optimizer step (median of 2 after 2 warm-up steps), counted with a "
             "TorchDispatchMode; data_ops: the ops that made the step's batches",
        torch=torch.__version__, machine=platform.machine(), date=time.strftime("%Y-%m-%d"), rows=rows),
        indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
