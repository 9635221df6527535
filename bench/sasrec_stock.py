"""Our SASRec epoch against a stock-PyTorch SASRec in the reference's form, epochs interleaved in one process,
so that the machine's drift (a third within minutes on these VMs) hits both alike. Writes
bench/results/sasrec_stock.{json,png}.

    python -m bench.sasrec_stock --data ../shared/data/ml-100k          # the README's figures (20 epochs each)
    python -m bench.sasrec_stock --data "" --epochs 1                    # generated data (no ../shared)
    python -m bench.sasrec_stock --width 256 --maxlen 200 --batch 1024     # another shape (both models)

The stock model is the architecture and training step of pmixer/SASRec.pytorch (the reference of issue 3,
whose epoch was measured once at 3.2 s on this machine kind), written here with stock modules: item and
position embeddings, per block a pre-LayerNorm nn.MultiheadAttention with a boolean causal mask and a
pre-LayerNorm point-wise FFN of two 1x1 nn.Conv1d, nn.Dropout everywhere, BCE with logits over the non-padded
positions, torch.optim.Adam (its default, unfused), 943 // 128 batches of 128 users drawn at random per epoch,
every sequence padded to maxlen 200. Its batches (users, one negative per position by rejection) are drawn
before the epoch and not timed (the reference draws them in 3 background processes): the baseline is if
anything faster than the reference, so our ratio against it is, if anything, too high.

Ours: the trainer's model (SeqRec, time=False, mhc=False), its DataLoader of per-user samples, its loss and its
fused Adam, one epoch of every user (bench/sasrec_profile.py's epoch: data loading included).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn

from bench.sasrec_profile import epoch as our_epoch
from bench.sasrec_profile import machine
from trainer.recipes.sasrec import data as D
from trainer.recipes.sasrec.config import SeqDataConfig, SeqRecConfig
from trainer.recipes.sasrec.model import SeqRec

REPO = Path(__file__).resolve().parents[1]

SETTINGS = dict(maxlen=200, width=50, depth=2, heads=1, dropout=0.2, batch_size=128, lr=1e-3, betas=(0.9, 0.98))


class StockFFN(nn.Module):
    """Two 1x1 convolutions over (B, D, T), dropout after each, the residual added inside (as the reference)."""

    def __init__(self, d: int, p: float):
        super().__init__()
        self.conv1, self.conv2 = nn.Conv1d(d, d, 1), nn.Conv1d(d, d, 1)
        self.drop1, self.drop2, self.relu = nn.Dropout(p), nn.Dropout(p), nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.drop2(self.conv2(self.relu(self.drop1(self.conv1(x.transpose(-1, -2))))))
        return y.transpose(-1, -2) + x


class StockSASRec(nn.Module):
    """SASRec with stock modules, every sequence at full length (no padding trimmed)."""

    def __init__(self, num_items: int, maxlen: int, d: int, depth: int, heads: int, p: float):
        super().__init__()
        self.item_emb = nn.Embedding(num_items + 1, d, padding_idx=0)
        self.pos_emb = nn.Embedding(maxlen + 1, d, padding_idx=0)
        self.drop = nn.Dropout(p)
        self.attn_norms = nn.ModuleList(nn.LayerNorm(d, eps=1e-8) for _ in range(depth))
        self.attns = nn.ModuleList(nn.MultiheadAttention(d, heads, p) for _ in range(depth))
        self.ffn_norms = nn.ModuleList(nn.LayerNorm(d, eps=1e-8) for _ in range(depth))
        self.ffns = nn.ModuleList(StockFFN(d, p) for _ in range(depth))
        self.last_norm = nn.LayerNorm(d, eps=1e-8)
        for param in self.parameters():
            if param.dim() >= 2:
                nn.init.xavier_normal_(param)

    def features(self, seq: torch.Tensor) -> torch.Tensor:
        x = self.item_emb(seq) * self.item_emb.embedding_dim ** 0.5
        positions = torch.arange(1, seq.shape[1] + 1, device=seq.device).expand_as(seq) * (seq != 0)
        x = self.drop(x + self.pos_emb(positions))
        t = seq.shape[1]
        causal = ~torch.tril(torch.ones(t, t, dtype=torch.bool, device=seq.device))
        for norm, attn, ffn_norm, ffn in zip(self.attn_norms, self.attns, self.ffn_norms, self.ffns):
            x = x.transpose(0, 1)                                   # (T, B, D): nn.MultiheadAttention's layout
            q = norm(x)
            x = x + attn(q, q, q, attn_mask=causal, need_weights=False)[0]
            x = ffn(ffn_norm(x.transpose(0, 1)))
        return self.last_norm(x)

    def forward(self, seq, pos, neg):
        h = self.features(seq)
        return (h * self.item_emb(pos)).sum(-1), (h * self.item_emb(neg)).sum(-1)


def stock_batches(split: D.Split, rng: np.random.Generator, maxlen: int, batch_size: int) -> list[tuple]:
    """One epoch of the reference's sampler: len(users) // batch_size batches of random users; seq/pos/neg
    filled from the end of each user's training items, one negative per position outside the user's items."""
    users = [u for u in range(split.data.num_users) if len(split.train(u)) >= 2]
    n_items = split.data.num_items
    out = []
    for _ in range(len(users) // batch_size):
        seqs, poss, negs = (np.zeros((batch_size, maxlen), dtype=np.int64) for _ in range(3))
        for row, u in enumerate(rng.choice(users, batch_size)):
            items = split.train(u)
            seqs[row] = D.left_pad(items[:-1], maxlen)
            poss[row] = D.left_pad(items[1:], maxlen)
            negs[row] = D.sample_negatives(rng, maxlen, n_items, items) * (poss[row] != 0)
        out.append(tuple(torch.from_numpy(a) for a in (seqs, poss, negs)))
    return out


def stock_epoch(model: StockSASRec, opt, batches, amp: torch.dtype | None = None) -> float:
    """Seconds of the reference's training step over the batches (BCE over non-padded positions, Adam), on the
    batches' device (CUDA: until the last kernel is done), under autocast to `amp` where given."""
    bce = nn.BCEWithLogitsLoss()
    device = batches[0][0].device if batches else torch.device("cpu")
    t0 = time.perf_counter()
    for seq, pos, neg in batches:
        opt.zero_grad()
        with torch.autocast(device.type, dtype=amp or torch.float32, enabled=amp is not None):
            pos_logits, neg_logits = model(seq, pos, neg)
        real = pos != 0
        loss = bce(pos_logits[real].float(), torch.ones_like(pos_logits[real], dtype=torch.float32)) + \
            bce(neg_logits[real].float(), torch.zeros_like(neg_logits[real], dtype=torch.float32))
        loss.backward()
        opt.step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - t0


def bench_data(path: str, seed: int, s: dict = SETTINGS):
    """(data, split, the trainer's loader, source): MovieLens-100K at `path`, or generated data of its size."""
    if path and Path(path).exists():
        cfg, source = SeqDataConfig(path=path, maxlen=s["maxlen"], kcore=5), path
    else:
        cfg = SeqDataConfig(maxlen=s["maxlen"], synthetic_users=943, synthetic_items=1349, synthetic_mean_len=104)
        source = "synthetic (943 users, mean length 104)"
    data = D.load(cfg)
    split = D.Split(data)
    loader = torch.utils.data.DataLoader(D.TrainSequences(split, s["maxlen"], 1, seed), batch_size=s["batch_size"],
                                         shuffle=True, collate_fn=D.collate)
    return data, split, loader, source


def settings(args) -> dict:
    """SETTINGS with the shape flags given (--width, --depth, --heads, --maxlen, --batch, --dropout)."""
    given = dict(width=args.width, depth=args.depth, heads=args.heads, maxlen=args.maxlen, batch_size=args.batch,
                 dropout=args.dropout)
    return {**SETTINGS, **{k: v for k, v in given.items() if v is not None}}


def measure(args) -> dict:
    s = settings(args)
    data, split, loader, source = bench_data(args.data, args.seed, s)
    torch.manual_seed(args.seed)
    ours = SeqRec(SeqRecConfig(time=False, mhc=False, width=s["width"], depth=s["depth"], heads=s["heads"],
                               dropout=s["dropout"]), data.num_items, s["maxlen"]).train()
    our_opt = torch.optim.Adam(ours.parameters(), lr=s["lr"], betas=s["betas"], fused=True)     # as the trainer
    stock = StockSASRec(data.num_items, s["maxlen"], s["width"], s["depth"], s["heads"], s["dropout"]).train()
    stock_opt = torch.optim.Adam(stock.parameters(), lr=s["lr"], betas=s["betas"])
    rng = np.random.default_rng(args.seed)
    our_epoch(ours, our_opt, loader)                                   # warm-up of both
    warm = stock_batches(split, rng, s["maxlen"], s["batch_size"])
    stock_epoch(stock, stock_opt, warm)
    ours_s, stock_s = [], []
    for _ in range(args.epochs):                                       # interleaved: drift hits both
        ours_s.append(our_epoch(ours, our_opt, loader)["total"])
        stock_s.append(stock_epoch(stock, stock_opt, stock_batches(split, rng, s["maxlen"], s["batch_size"])))
    ratios = [a / b for a, b in zip(ours_s, stock_s)]
    return dict(source=source, settings={**s, "betas": list(s["betas"])}, epochs=args.epochs,
                ours_epoch_s=[round(t, 3) for t in ours_s], stock_epoch_s=[round(t, 3) for t in stock_s],
                ours_median_s=round(statistics.median(ours_s), 3), stock_median_s=round(statistics.median(stock_s), 3),
                ratio_median=round(statistics.median(ratios), 3), ratio_range=[round(min(ratios), 3),
                                                                             round(max(ratios), 3)],
                stock_batches=len(warm), our_batches=len(loader),
                reference_once=dict(name="pmixer/SASRec.pytorch", epoch_s=3.2),
                machine=machine(), date=time.strftime("%Y-%m-%d %H:%M"))


def plot(report: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8, 3.5))
    x = range(1, report["epochs"] + 1)
    ax.plot(x, report["stock_epoch_s"], marker="o", label="stock SASRec (the reference's form)")
    ax.plot(x, report["ours_epoch_s"], marker="o", label="ours (trainer's SASRec)")
    ax.axhline(report["reference_once"]["epoch_s"], ls="--", c="gray", label="pmixer, measured once (issue 3)")
    ax.set_xlabel("interleaved epoch"), ax.set_ylabel("seconds per training epoch (CPU)")
    ax.set_ylim(bottom=0)
    ax.set_title(f"ours / stock: median {report['ratio_median']}x (range {report['ratio_range'][0]}-"
                 f"{report['ratio_range'][1]})")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    p.add_argument("--data", default=str(REPO.parent / "shared" / "data" / "ml-100k"),
                   help="MovieLens-100K folder; empty or missing: generated data of its size")
    p.add_argument("--epochs", type=int, default=20, help="interleaved epochs of each (after one warm-up each)")
    p.add_argument("--seed", type=int, default=0)
    for flag, kind in (("width", int), ("depth", int), ("heads", int), ("maxlen", int), ("batch", int),
                       ("dropout", float)):             # both models' shape; unset: SETTINGS (the README's figures)
        key = "batch_size" if flag == "batch" else flag
        p.add_argument(f"--{flag}", type=kind, default=None, help=f"default {SETTINGS[key]}")
    p.add_argument("--out", default=str(REPO / "bench" / "results"))
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = measure(args)
    (out / "sasrec_stock.json").write_text(json.dumps(report, indent=1))
    plot(report, out / "sasrec_stock.png")
    print(f"data: {report['source']}; {args.epochs} interleaved epochs each")
    print(f"stock SASRec {report['stock_median_s']:.3f} s/epoch (median), ours {report['ours_median_s']:.3f}: "
          f"ours / stock {report['ratio_median']} (range {report['ratio_range'][0]}-{report['ratio_range'][1]})")
    print(f"wrote {out / 'sasrec_stock.json'} and {out / 'sasrec_stock.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
