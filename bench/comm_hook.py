"""What the straggler watch costs a GPU step (issue 69 point 1): DDP's Python comm hook (gradsync's timed all-reduce,
which the watch put on every NCCL run before the device clock) and the device clock's two events a step
(trainer/engine/device_clock.py, what a GPU run uses now), each against plain DDP, on SASRec and video steps under
NCCL in a world of one (the trainer wraps no world of one: here the model is wrapped by hand, so DDP's reducer,
buckets and all-reduces run as in a multi-GPU job, less the network). Rounds interleave the variants (plain, hook,
clock, plain, ...) so that a drift of the GPU's clock falls on all of them; the median round counts.

    python -m bench.comm_hook --out bench/results/comm-hook-H200.json     # on a GPU: about a minute
    python -m bench.comm_hook --device cpu --tiny --out /tmp/hook.json    # a plumbing check (gloo), no figures
    python -m bench.comm_hook --plot bench/results/comm-hook-H200.json    # its PNG, where matplotlib is

The rule (issue 69): a watch that costs more than 1% of a step changes its default or goes.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from bench.gpu import timed_rates
from bench.opcount import endless, epoch_loop_for

VARIANTS = ("plain", "hook", "clock")
LIMIT_PCT = 1.0


def rows(tiny: bool, ml100k: Path) -> list[tuple[str, str, list[str]]]:
    sas_data = [f"data.path={ml100k}"] if (ml100k / "u.data").exists() else []
    seq = ["data.maxlen=30", "train.batch_size=16"] if tiny else ["data.maxlen=200", "train.batch_size=128"]
    video = ["model.arch=light", "data.size=32", "data.clip_len=9", "data.synthetic_videos=4",
             "data.synthetic_frames=30", "train.batch_size=4"] if tiny else \
        ["model.arch=mouse3d", "data.size=128", "data.clip_len=17", "data.synthetic_videos=4",
         "data.synthetic_frames=120", "train.batch_size=16"]
    return [("sasrec", "sasrec", sas_data + seq + ["model.time=false", "model.mhc=false", "train.amp=bf16"]),
            ("video", "video", video + ["train.amp=bf16"])]


class ClockedStep:
    """The run's step strategy with the device clock told where each step starts and ends (what the epoch loop's
    step_start and step_end tell the clock as a component; these loops are driven step by step)."""

    def __init__(self, inner, clock, accum: int):
        self.inner, self.clock, self.accum = inner, clock, accum
        self.measures_sync = inner.measures_sync

    def micro_batch(self, batch, micro: int, end: int):
        if micro % self.accum == 0:
            self.clock.step_start()
        done = self.inner.micro_batch(batch, micro, end)
        if done.stepped:
            self.clock.step_end()
        return done

    def epoch_summary(self):
        return self.inner.epoch_summary()


def wrapped_loop(recipe: str, overrides: list[str], device: str, variant: str):
    """An EpochLoop whose model is wrapped in DDP by hand, with gradsync's timed hook ("hook") or the device clock
    ("clock") as the trainer would add them for the straggler watch."""
    from trainer.distributed import gradsync
    from trainer.engine.device_clock import DeviceClock, HostEvent, cuda_event
    from trainer.engine.steps import EagerStep, GradSync
    tr, _ = epoch_loop_for(recipe, overrides, device)
    run, dev = tr.run, torch.device(device)
    ddp = torch.nn.parallel.DistributedDataParallel(run.model, device_ids=[dev.index or 0] if dev.type == "cuda"
                                                    else None)
    run.wrapped = ddp
    sync = GradSync(timer=gradsync.attach(ddp, None, timed=True) if variant == "hook" else None)
    run.step = EagerStep(run, functools.partial(run.recipe.training_step, ddp), sync)
    if variant == "clock":
        clock = DeviceClock(run.model.parameters(), cuda_event if dev.type == "cuda" else HostEvent)
        run.step = ClockedStep(run.step, clock, run.accum)
    return tr


def timed(tr, feed, steps: int, device: str) -> float:
    """Seconds per optimizer step over `steps` (CUDA events on a GPU: the engine's Throughput)."""
    return timed_rates(tr, feed, steps, device)["step_time_s"]


def measure(recipe: str, overrides: list[str], device: str, steps: int, rounds: int) -> dict:
    loops = {v: wrapped_loop(recipe, overrides, device, v) for v in VARIANTS}
    feeds = {v: endless(tr) for v, tr in loops.items()}
    for v, tr in loops.items():                  # warm-up: kernels chosen, buckets rebuilt, the clock's order learnt
        timed(tr, feeds[v], max(steps // 2, 3), device)
    per = {v: [] for v in VARIANTS}
    for _ in range(rounds):
        for v in VARIANTS:
            per[v].append(timed(loops[v], feeds[v], steps, device))
    med = {v: statistics.median(xs) for v, xs in per.items()}
    return dict(step_ms={v: round(med[v] * 1e3, 4) for v in VARIANTS},
                rounds_ms={v: [round(x * 1e3, 4) for x in xs] for v, xs in per.items()},
                overhead_pct={v: round((med[v] / med["plain"] - 1) * 100, 2) for v in ("hook", "clock")},
                steps=steps, rounds=rounds)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--tiny", action="store_true", help="small rows (a plumbing check)")
    p.add_argument("--steps", type=int, default=50, help="steps per round and variant")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--ml100k", default="../shared/data/ml-100k")
    p.add_argument("--out", type=Path)
    p.add_argument("--plot", type=Path, help="draw the PNG of a saved report and stop")
    args = p.parse_args(argv)
    if args.plot:
        plot(json.loads(args.plot.read_text()), args.plot.with_suffix(".png"))
        return 0
    if args.out is None:
        p.error("--out FILE is needed (or --plot FILE)")
    cuda = args.device.startswith("cuda")
    if cuda:
        torch.cuda.set_device(torch.device(args.device))
    store = dist.HashStore()
    dist.init_process_group("nccl" if cuda else "gloo", store=store, rank=0, world_size=1)
    report = dict(device=torch.cuda.get_device_name() if cuda else "cpu", backend=dist.get_backend(),
                  torch=torch.__version__, limit_pct=LIMIT_PCT, rows={})
    for name, recipe, overrides in rows(args.tiny, Path(args.ml100k)):
        report["rows"][name] = measure(recipe, overrides, args.device, args.steps if not args.tiny else 4,
                                       args.rounds if not args.tiny else 2)
        print(name, json.dumps(report["rows"][name]["step_ms"]), json.dumps(report["rows"][name]["overhead_pct"]),
              flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_name(f".{args.out.name}.{os.getpid()}")
    tmp.write_text(json.dumps(report, indent=1) + "\n")
    tmp.replace(args.out)
    dist.destroy_process_group()
    return 0


def plot(report: dict, png: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    names = list(report["rows"])
    fig, ax = plt.subplots(figsize=(6, 3.2))
    width = 0.25
    for k, v in enumerate(VARIANTS):
        ax.bar([i + (k - 1) * width for i in range(len(names))], [report["rows"][n]["step_ms"][v] for n in names],
               width, label=v)
    ax.set_xticks(range(len(names)), names)
    ax.set_ylabel("ms per step (median round)")
    ax.set_title(f"straggler watch's cost, {report['device']} ({report['backend']}, world of one)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
