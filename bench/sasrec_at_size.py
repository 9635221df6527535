"""SASRec at MovieLens-20M's shape on one GPU, beside the stock PyTorch SASRec of bench/sasrec_stock.py on the
same device in the same process (issue 70, point 3): seconds per epoch, peak device memory and, for ours, the
full-ranking evaluation of every user (once: after the first batch size's eager epoch); joined to the GPU report
at --out (key `sasrec_at_size`).

    python -m bench.sasrec_at_size --out bench/results/gpu-NVIDIA-H200.json     # on a GPU: batch 128 and 1024
    python -m bench.sasrec_at_size --device cpu --rows 30000 --width 16 --maxlen 20 --batches 32 --warmup 2 \
        --out /tmp/at-size.json                                                  # a plumbing check on a CPU

The data: a generated u.data of --rows interactions with ML-20M's users and items per row (bench/data_scale.py's
generator, 138,493 users and 26,744 items at 20M rows), parsed once into the data cache (the first parse is timed,
the later runs map it). The model: Klenitskiy & Vasilev's ML-20M SASRec (width 256, 2 blocks, 1 head, dropout 0.1,
maxlen 200, Adam 1e-3), trained with BCE and one negative per position (the stock model's loss: the losses issue's
`ce` is a row of its own, `--loss ce`). Ours: the trainer's GPU-shaped step, bf16, eager and (on a GPU) compiled
with CUDA graphs; the stock model: bf16 autocast, torch's unfused Adam, the reference's batches (made before its
epoch, not timed; their making is stated). Each is warmed up for --warmup steps (a compile's included), then one
whole epoch is timed.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

from bench import sasrec_stock as stock
from bench.data_scale import generate
from bench.gpu import our_epoch, save, sync
from bench.opcount import endless, epoch_loop_for

ML20M_ROWS = 20_000_263


def peak_mb(device: str) -> float | None:
    return round(torch.cuda.max_memory_allocated(device) / 2**20, 1) if device.startswith("cuda") else None


def reset_peak(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def ours(args, path: Path, batch: int, compile_mode: str, evaluate: bool) -> tuple[dict, object]:
    """Our epoch at this shape, and where `evaluate`, the test split's evaluation of every user with full ranking
    after it (the same eager model and evaluation batch at any training batch: measured once): (figures, the run's
    split for the stock model)."""
    from trainer.engine.evaluation import evaluate_split
    overrides = [f"data.path={path}", f"data.cache={args.work / 'cache'}", f"data.maxlen={args.maxlen}", "data.kcore=0",
                 "model.time=false", "model.mhc=false", f"model.width={args.width}", f"model.depth={args.depth}",
                 f"model.heads={args.heads}", f"model.dropout={args.dropout}", f"train.batch_size={batch}",
                 f"optim.lr={args.lr}", f"loss.kind={args.loss}", "train.gpu_path=on", f"compile.mode={compile_mode}",
                 f"train.amp={'bf16' if args.device.startswith('cuda') else 'off'}", "eval.max_users=0"]
    reset_peak(args.device)
    t0 = time.perf_counter()
    tr, _ = epoch_loop_for("sasrec", overrides, args.device)
    built_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    for n, (b, micro) in enumerate(endless(tr)):       # the warm-up: a compile, CUDA graphs' capture, the caches
        if n >= args.warmup:
            break
        tr.step(b, micro)
    tr.losses.read()
    sync(args.device)
    warm_s = time.perf_counter() - t0
    epoch_s = our_epoch(tr, 1, args.device)
    steps = tr.run.micro_per_epoch
    row = dict(compile=compile_mode, steps=steps, built_s=round(built_s, 2), warmup_s=round(warm_s, 2),
               epoch_s=round(epoch_s, 3), step_ms=round(1e3 * epoch_s / steps, 3), peak_mb=peak_mb(args.device))
    if evaluate:
        t0 = time.perf_counter()
        metrics = evaluate_split(tr.run, "test")
        sync(args.device)
        eval_s, users = time.perf_counter() - t0, len(tr.run.eval_sets["test"])
        row.update(eval_users=users, eval_s=round(eval_s, 2), eval_users_per_s=round(users / eval_s, 1),
                   eval_peak_mb=peak_mb(args.device), test_full_ndcg10=round(metrics["full_ndcg@10"], 4))
    return row, tr.run.recipe.split


def stock_row(args, split, batch: int) -> dict:
    """The stock SASRec's epoch at this shape on the same device: the reference's batches (len(users) // batch)."""
    reset_peak(args.device)
    torch.manual_seed(0)
    model = stock.StockSASRec(split.data.num_items, args.maxlen, args.width, args.depth, args.heads, args.dropout)
    model = model.to(args.device).train()
    opt = torch.optim.Adam(model.parameters(), lr=args.lr, betas=(0.9, 0.98))     # the reference's, unfused
    amp = torch.bfloat16 if args.device.startswith("cuda") else None
    rng = np.random.default_rng(0)
    t0 = time.perf_counter()
    batches = [tuple(t.to(args.device) for t in b) for b in stock.stock_batches(split, rng, args.maxlen, batch)]
    made_s = time.perf_counter() - t0
    stock.stock_epoch(model, opt, batches[:args.warmup], amp)
    epoch_s = stock.stock_epoch(model, opt, batches, amp)
    return dict(steps=len(batches), batches_made_s=round(made_s, 2), epoch_s=round(epoch_s, 3),
                step_ms=round(1e3 * epoch_s / max(len(batches), 1), 3), peak_mb=peak_mb(args.device))


def measured(args):
    """The report after each batch size (ours in each mode, then the stock model), for saving as it grows."""
    args.work.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    path = generate(args.rows, args.work)
    generated_s = time.perf_counter() - t0
    modes = ["off", "reduce-overhead"] if args.device.startswith("cuda") and not args.no_compile else ["off"]
    out = dict(device=args.device, rows=args.rows, generated_s=round(generated_s, 1), data=str(path),
               settings=dict(width=args.width, depth=args.depth, heads=args.heads, dropout=args.dropout,
                             maxlen=args.maxlen, lr=args.lr, loss=args.loss, warmup_steps=args.warmup),
               batches={}, date=time.strftime("%Y-%m-%d %H:%M"))
    for batch in args.batches:
        rows, split = {}, None
        for mode in modes:
            rows[f"ours compile={mode}"], split = ours(args, path, batch, mode, evaluate=not out["batches"]
                                                      and mode == "off")
            print(f"batch {batch} ours compile={mode}: {json.dumps(rows[f'ours compile={mode}'])}", flush=True)
        rows["stock"] = stock_row(args, split, batch)
        print(f"batch {batch} stock: {json.dumps(rows['stock'])}", flush=True)
        rows["ratio_ours_over_stock"] = {m: round(rows[f"ours compile={m}"]["epoch_s"] / rows["stock"]["epoch_s"], 3)
                                         for m in modes}
        out["batches"][str(batch)] = rows
        # the first run's build holds the data's first parse into the cache; the later ones map it
        out.setdefault("first_build_s", rows["ours compile=off"]["built_s"])
        yield out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--rows", type=int, default=ML20M_ROWS, help="interactions generated (ML-20M: 20,000,263)")
    p.add_argument("--batches", type=lambda s: [int(b) for b in s.split(",")], default=[128, 1024],
                   help="batch sizes, comma-separated (each a row: ours beside the stock model)")
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--depth", type=int, default=2)
    p.add_argument("--heads", type=int, default=1)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--maxlen", type=int, default=200)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--loss", default="bce", help="ours' loss.kind (the stock model trains with bce)")
    p.add_argument("--warmup", type=int, default=30, help="steps before each timed epoch")
    p.add_argument("--no-compile", action="store_true", help="ours eager only (no inductor compile on a GPU)")
    p.add_argument("--work", type=Path, default=Path("/tmp/sasrec-at-size"), help="the generated data and its cache")
    p.add_argument("--out", type=Path, required=True, help="the report to join (key sasrec_at_size; created if absent)")
    args = p.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("bench.sasrec_at_size: no CUDA device here (torch.cuda.is_available() is False); nothing measured.\n"
              "Run it on a GPU node, or with --device cpu and small --rows to check the script.")
        return 2
    report = json.loads(args.out.read_text()) if args.out.exists() else {}
    for row in measured(args):                       # batch by batch: a step stopped at its cap keeps what it measured
        report["sasrec_at_size"] = row
        save(report, args.out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
