"""Where a SASRec training epoch goes on this CPU, and how far it is from the machine's limit. Writes
bench/results/sasrec_profile.{json,png}.

    python -m bench.sasrec_profile --data ../shared/data/ml-100k          # the README's settings
    python -m bench.sasrec_profile --epochs 2                              # generated data (no ../shared)

One epoch of the engine's work (data loading, forward, loss, backward, Adam) is timed as a whole; each part
is then replayed alone on the tensors the epoch really saw (captured by forward hooks: the packed real
positions, or the trimmed length buckets with model.attention_fused=false; the same dropout): the embedding
layer, every attention and every feed-forward sub-layer (forward + backward), the loss, the optimizer step
and the data loader. What the replays do not cover (LayerNorms, residual adds, packing and bucket
bookkeeping, autograd's own overhead) is the "other" row.

The limit: the multiply-adds the epoch cannot avoid (linear layers and attention over the real positions
only, forward and backward = 3x forward) at the matmul throughput this machine reaches at these shapes.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from trainer.native import memory
from trainer.recipes.sasrec import data as D
from trainer.recipes.sasrec.config import SeqDataConfig, SeqRecConfig
from trainer.recipes.sasrec.model import FeedForward, Packing, SelfAttention, SeqRec
from trainer.recipes.sasrec.recipe import sequence_loss

REPO = Path(__file__).resolve().parents[1]

PARTS = ("data", "embedding", "attention", "ffn", "loss", "optimizer", "other")


class Capture:
    """Forward hooks that keep (module, args, kwargs) of every call of the given module types."""

    def __init__(self, model, types):
        self.calls: list[tuple] = []
        self.handles = [m.register_forward_hook(self._hook, with_kwargs=True)
                        for m in model.modules() if isinstance(m, types)]

    def _hook(self, module, args, kwargs, out):
        detach = lambda v: v.detach() if torch.is_tensor(v) else v            # noqa: E731
        self.calls.append((module, tuple(detach(a) for a in args), {k: detach(v) for k, v in kwargs.items()}))

    def remove(self):
        for h in self.handles:
            h.remove()


def replay(calls, reps: int = 1) -> float:
    """Seconds for forward + backward of every captured call, inputs requiring grad as in training."""
    t0 = time.perf_counter()
    for _ in range(reps):
        for module, args, kwargs in calls:
            args = tuple(a.clone().requires_grad_() if torch.is_tensor(a) and a.is_floating_point() else a
                         for a in args)
            out = module(*args, **kwargs)
            out.backward(torch.ones_like(out))
    return (time.perf_counter() - t0) / reps


def embedding_pass(model, batches) -> float:
    """Forward + backward of the input embedding (items, positions, dropout) and the logits' item lookups, of
    the real positions where the model trains packed (SeqRec.packs), else of every position."""
    d = model.cfg.width
    t0 = time.perf_counter()
    for b in batches:
        seq, pos, neg = b["seq"], b["pos"], b["neg"]
        pack = Packing(seq).pack if model.packs(seq) else (lambda t: t)
        positions = torch.arange(1, seq.shape[1] + 1) * (seq != 0)
        x = model.drop(model.item_emb(pack(seq)) * math.sqrt(d) + model.pos_emb(pack(positions)))
        y = x.sum() + model.item_emb(pack(pos)).sum() + model.item_emb(pack(neg)).sum()
        y.backward()
    return time.perf_counter() - t0


def matmul_rate(d: int) -> float:
    """Multiply-adds per second of this machine on (6400 x d) @ (d x d), the linear layers' shape."""
    a, w = torch.randn(6400, d), torch.randn(d, d)
    for _ in range(3):
        a @ w
    t0, n = time.perf_counter(), 50
    for _ in range(n):
        a @ w
    return n * 6400 * d * d / (time.perf_counter() - t0)


def machine() -> dict:
    """The machine an in-process timing ran on (this process's torch threads)."""
    return dict(cpus=os.cpu_count(), threads=torch.get_num_threads(), torch=str(torch.__version__),
                python=platform.python_version())


def epoch(model, opt, loader, batches_out=None) -> dict[str, float]:
    t = dict(data=0.0, forward=0.0, loss=0.0, backward=0.0, optimizer=0.0)
    t0 = time.perf_counter()
    for b in loader:
        t1 = time.perf_counter()
        t["data"] += t1 - t0
        if batches_out is not None:
            batches_out.append(b)
        pos_logits, neg_logits = model(b["seq"], b["time"], b["pos"], b["neg"])
        t2 = time.perf_counter()
        loss = sequence_loss(pos_logits, neg_logits, b["pos"])
        t3 = time.perf_counter()
        loss.backward()
        t4 = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        t.update(forward=t["forward"] + t2 - t1, loss=t["loss"] + t3 - t2, backward=t["backward"] + t4 - t3,
                 optimizer=t["optimizer"] + t0 - t4)
    t["total"] = sum(t.values())
    return t


def profile(args) -> dict:
    torch.manual_seed(args.seed)
    if args.data and Path(args.data).exists():
        cfg = SeqDataConfig(path=args.data, maxlen=200, kcore=5)
        source = args.data
    else:
        cfg = SeqDataConfig(maxlen=200, synthetic_users=943, synthetic_items=1349, synthetic_mean_len=104)
        source = "synthetic (943 users, mean length 104)"
    data = D.load(cfg)
    split = D.Split(data)
    train = D.TrainSequences(split, cfg.maxlen, 1, args.seed)
    loader = torch.utils.data.DataLoader(train, batch_size=128, shuffle=True, collate_fn=D.collate)
    model = SeqRec(SeqRecConfig(time=False, mhc=False, width=50, depth=2, heads=1, dropout=0.2),
                   data.num_items, cfg.maxlen).train()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, betas=(0.9, 0.98), fused=True)   # as the trainer
    epoch(model, opt, loader)                                          # warm-up
    whole = [epoch(model, opt, loader) for _ in range(args.epochs)]
    total = statistics.median(w["total"] for w in whole)

    batches: list = []
    attn, ffn = Capture(model, SelfAttention), Capture(model, FeedForward)
    logits: list = []
    handle = model.register_forward_hook(lambda m, a, out: logits.append((out[0].detach(), out[1].detach())))
    epoch(model, opt, loader, batches)
    attn.remove(), ffn.remove(), handle.remove()

    def loss_pass():
        t0 = time.perf_counter()
        for (p, n), b in zip(logits, batches):
            sequence_loss(p.clone().requires_grad_(), n.clone().requires_grad_(), b["pos"]).backward()
        return time.perf_counter() - t0

    def optimizer_pass():
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        t0 = time.perf_counter()
        for _ in batches:
            opt.step()
        return time.perf_counter() - t0

    def data_pass():
        t0 = time.perf_counter()
        for _ in loader:
            pass
        return time.perf_counter() - t0

    med = lambda f: statistics.median(f() for _ in range(args.epochs))   # noqa: E731
    parts = dict(data=med(data_pass), embedding=med(lambda: embedding_pass(model, batches)),
                 attention=med(lambda: replay(attn.calls)), ffn=med(lambda: replay(ffn.calls)),
                 loss=med(loss_pass), optimizer=med(optimizer_pass))
    parts["other"] = max(total - sum(parts.values()), 0.0)

    # the unavoidable work: real (unpadded) positions vs the positions the length buckets compute
    d, depth = 50, 2
    lengths = [int((b["seq"] != 0).sum(1).max()) for b in batches]
    real = sum(int((b["seq"] != 0).sum()) for b in batches)
    real_sq = sum(int(((b["seq"] != 0).sum(1) ** 2).sum()) for b in batches)
    linear_macs = real * depth * 6 * d * d                 # q, k, v, out, two FFN layers
    attention_macs = real_sq * depth * d                   # causal: ~T^2/2 scores and T^2/2 weighted sums
    rate = matmul_rate(d)
    limit = 3 * (linear_macs + attention_macs) / rate
    return dict(
        source=source, epochs_measured=args.epochs, steps=len(batches), max_bucket_length=max(lengths),
        epoch_s=round(total, 3), phases_s={k: round(statistics.median(w[k] for w in whole), 3)
                                           for k in ("data", "forward", "loss", "backward", "optimizer")},
        parts_s={k: round(v, 3) for k, v in parts.items()},
        parts_share={k: round(v / total, 3) for k, v in parts.items()},
        real_positions=real, matmul_gmacs_per_s=round(rate / 1e9, 1),
        limit_s=round(limit, 3), limit_note="3 x (linear + attention multiply-adds over real positions) / "
                                           "matmul rate at (6400 x 50) @ (50 x 50); no data, loss or optimizer",
        vs_limit=round(total / limit, 2),
        machine=machine(), date=time.strftime("%Y-%m-%d %H:%M"))


def plot(report: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8, 3))
    left = 0.0
    for i, name in enumerate(PARTS):
        v = report["parts_s"][name]
        ax.barh(0, v, left=left, color=f"C{i}", label=f"{name} {v:.2f} s")
        left += v
    ax.axvline(report["limit_s"], c="k", ls="--", label=f"estimated limit {report['limit_s']:.2f} s")
    ax.set_yticks([]), ax.set_xlabel("seconds per training epoch (CPU)")
    ax.legend(ncol=4, fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.35))
    ax.set_title(f"SASRec epoch on {report['source'][:40]}: {report['epoch_s']:.2f} s")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    p.add_argument("--data", default=str(REPO.parent / "shared" / "data" / "ml-100k"))
    p.add_argument("--epochs", type=int, default=5, help="epochs timed (the median is reported)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(REPO / "bench" / "results"))
    args = p.parse_args(argv)
    memory.reuse_freed_memory()          # as the engine does for every recipe before it builds anything
    report = profile(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "sasrec_profile.json").write_text(json.dumps(report, indent=1))
    plot(report, out / "sasrec_profile.png")
    print(f"epoch {report['epoch_s']:.3f} s, estimated limit {report['limit_s']:.3f} s ({report['vs_limit']}x)")
    for name in PARTS:
        print(f"  {name:<10}{report['parts_s'][name]:>8.3f} s {100 * report['parts_share'][name]:>6.1f}%")
    print(f"wrote {out / 'sasrec_profile.json'} and {out / 'sasrec_profile.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
