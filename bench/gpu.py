"""The GPU benchmark (`make bench-gpu`): every recipe's training step on one CUDA device, fp32 against bf16, on
the GPU-shaped path; writes bench/results/gpu-<device>.json and .png. About 5 minutes on an H100/H200, 2-3 with
--quick; a CPU runs it only for a plumbing check (--device cpu --tiny).

    python -m bench.gpu                               # the whole table (ml-100k from --ml100k if present)
    python -m bench.gpu --quick                       # fewer steps and rows: the validation run's first step
    python -m bench.gpu --device cpu --tiny --out /tmp/gpu-check.json   # checks the script, measures nothing
    python -m bench.gpu --stock-only --out bench/results/gpu-X.json    # add the stock-SASRec row to a report
    python -m bench.gpu --plot bench/results/gpu-X.json                # its PNG (the GPU machine has no matplotlib)

Per row: step time and samples/s from CUDA events (the engine's own Throughput: the GPU's time, not the host's
queueing), peak memory, the share of the step the GPU waited for data, ATen ops and host syncs per step (counted
with a dispatch mode on the device), and for compiled rows the warm-up. Video: clips/s and MFU against the
device's dense bf16 peak (--peak-tflops, else a table of known parts), the batch that maximises clips/s, and
the loop against the bare model step. SASRec on ml-100k: a GPU epoch beside this machine's CPU epoch, and our epoch
(bf16, compiled and not) beside the stock PyTorch SASRec of bench/sasrec_stock.py on the same device (ours / stock).
Targets (issue 45): SASRec ml-100k step <= 2 ms, HAR <= 1 ms, KGAT b1024 <= 3 ms, video >= 2,000 clips/s.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

from bench.opcount import endless, epoch_loop_for, step_counts
from trainer.engine.capabilities import Batching, of
from trainer.engine.meters import Throughput

REPO = Path(__file__).resolve().parents[1]

PEAK_BF16_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "B200": 2250.0, "L40S": 362.0}  # dense
# compiled: bf16 + compile.mode=reduce-overhead, a GPU's; graph: bf16 + compile.step_graph=on (the whole step one CUDA
# graph); graph-compiled: the same with compile.mode=default inside it
AMPS = ("fp32", "bf16", "compiled", "deterministic", "graph", "graph-compiled")
TARGETS = {"sasrec-ml100k": ("step_ms", 2.0, "<="), "har": ("step_ms", 1.0, "<="), "kgat": ("step_ms", 3.0, "<="),
           "video": ("samples_per_s", 2000.0, ">=")}


def nondeterministic_kernels() -> None:
    """Undo trainer.distributed.runtime.deterministic_kernels (train.deterministic=true) for the rows after it."""
    torch.use_deterministic_algorithms(False)
    torch.backends.cudnn.deterministic = False


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def advance(tr, feed, steps: int, device: str) -> int:
    """`steps` optimizer steps of feed's batches, until the device is done; returns the steps taken."""
    done = 0
    while done < steps:
        batch, micro = next(feed)
        done += tr.step(batch, micro)
    tr.losses.read()
    sync(device)
    return done


def timed_rates(tr, feed, steps: int, device: str) -> dict:
    """The engine's Throughput rates over `steps` optimizer steps of feed's batches (CUDA events on a GPU: its
    time, not the host's queueing; the wait for each batch: the GPU's idle time)."""
    meter, done = Throughput(torch.device(device)), 0
    batches = meter.timed(feed)
    while done < steps:
        batch, micro = next(batches)
        n = tr.step(batch, micro)
        meter.update(of(tr.run.recipe, Batching).batch_size_of(batch), steps=int(n))
        done += n
    tr.losses.read()
    return meter.rates()


def time_steps(recipe: str, overrides: list[str], device: str, steps: int, warmup: int,
               profile: bool = False) -> dict:
    """Optimizer steps of a fresh EpochLoop: warm-up (compile included) timed apart, then `steps` timed; with
    `profile`, then the top ops of a few more steps."""
    tr, _ = epoch_loop_for(recipe, overrides, device)
    feed, dev = endless(tr), torch.device(device)
    t0 = time.perf_counter()
    advance(tr, feed, warmup, device)
    warm = time.perf_counter() - t0
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    rates = timed_rates(tr, feed, steps, device)
    out = dict(step_ms=round(rates["step_time_s"] * 1e3, 3), samples_per_s=round(rates["samples_per_s"], 1),
               data_wait_frac=rates["data_wait_frac"], warmup_s=round(warm, 2), steps=steps)
    if dev.type == "cuda":
        out["peak_mem_mb"] = round(torch.cuda.max_memory_allocated(dev) / 2**20, 1)
    if profile:
        out["top_ops"] = top_ops(tr, feed, device)
    return out


def top_ops(tr, feed, device: str, steps: int = 5, keep: int = 8) -> dict:
    """What the step's time is made of, from torch.profiler over a few steps: on a GPU its kernels (device time;
    their sum per step against the step's time says whether the GPU or the host that feeds it sets the pace), on
    a CPU the host's ops. {busy_ms_per_step, top: [{op, ms_per_step, share of busy, calls_per_step}]}."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile
    cuda = device.startswith("cuda")
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:
        done = advance(tr, feed, steps, device)

    def self_us(e) -> float:
        if cuda:
            return float(getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0.0))
        return float(e.self_cpu_time_total)
    # a kernel's time is also an aten op's device time: count the kernels alone, once
    events = [e for e in prof.key_averages() if self_us(e) > 0 and (not cuda or e.device_type == DeviceType.CUDA)]
    total = sum(self_us(e) for e in events) or 1.0
    events.sort(key=self_us, reverse=True)
    return dict(busy_ms_per_step=round(total / 1e3 / done, 4),
                top=[dict(op=e.key[:80], ms_per_step=round(self_us(e) / 1e3 / done, 4),
                          share=round(self_us(e) / total, 3), calls_per_step=round(e.count / done, 1))
                     for e in events[:keep]])


def rows(args) -> list[tuple[str, str, list[str]]]:
    """(name, recipe, overrides) of every row of this run."""
    ml = Path(args.ml100k)
    sas_data = [f"data.path={ml}"] if (ml / "u.data").exists() else []
    seq = ["data.maxlen=30", "train.batch_size=16"] if args.tiny else ["data.maxlen=200", "train.batch_size=128"]
    video = ["model.arch=light", "data.size=32", "data.clip_len=9", "data.synthetic_videos=4",
             "data.synthetic_frames=30", "train.batch_size=4"] if args.tiny else \
        ["model.arch=mouse3d", "data.size=256", "data.clip_len=17", "data.synthetic_videos=8",
         "data.synthetic_frames=300", "train.batch_size=16", "train.num_workers=4"]   # epochs of ~100 batches
    out = [("sasrec-ml100k" if sas_data else "sasrec-synthetic", "sasrec",
            sas_data + seq + ["model.time=false", "model.mhc=false"]),
           ("tisasrec", "sasrec", sas_data + seq + ["model.time=true", "model.mhc=false"]),
           ("tisasrec+mhc", "sasrec", sas_data + seq),
           ("har", "har", ["train.batch_size=64"]),
           ("kgat", "kgat", ["train.batch_size=64" if args.tiny else "train.batch_size=1024"]),
           ("video", "video", video),
           ("video-frames", "video", video + ["model.layout=frames"])]   # issue 70: the same model as 2D convs
    return out[:1] + out[3:] if args.quick else out


def video_sweep(args, device: str, layout: str = "conv3d", compiled: bool = True, batches=None):
    """The bare model step (model + loss + optimizer on clips already on the device, channels-last, bf16,
    compiled unless told) at rising batch sizes: clips/s and MFU, one dict per batch as it is measured (with its 3
    warm-up steps' seconds: a new batch compiles again); the batch that maximises clips/s is the loop's batch.
    layout: the model's `model.layout` (issue 70: `frames` computes the same model as 2D convolutions)."""
    from trainer.recipes.video.model import VideoModelConfig, build, train_flops_per_clip
    arch, clip, size = ("light", 9, 32) if args.tiny else ("mouse3d", 17, 256)
    model = build(VideoModelConfig(arch=arch, layout=layout), 1, 8).to(device, memory_format=torch.channels_last_3d)
    flops = train_flops_per_clip(build(VideoModelConfig(arch=arch), 1, 8), (1, clip, size, size))
    opt = torch.optim.AdamW(model.parameters(), fused=True)
    compiled = compiled and device.startswith("cuda")
    step = torch.compile(lambda x, y: torch.nn.functional.cross_entropy(model(x).float(), y)) if compiled \
        else (lambda x, y: torch.nn.functional.cross_entropy(model(x).float(), y))
    peak = args.peak_tflops or next((v for k, v in PEAK_BF16_TFLOPS.items()
                                     if device.startswith("cuda") and k in torch.cuda.get_device_name()), None)
    for batch in batches or ((2, 4) if args.tiny else (16, 32, 64, 128)):
        warm = time.perf_counter()
        x = torch.randint(0, 255, (batch, 1, clip, size, size), dtype=torch.uint8, device=device)
        y = torch.randint(0, 8, (batch,), device=device)
        inputs = (x.float() * (2 / 255) - 1).contiguous(memory_format=torch.channels_last_3d)
        for i in range(args.video_steps + 3):
            if i == 3:
                sync(device)
                t0 = time.perf_counter()
                warm = t0 - warm
            with torch.autocast(device.split(":")[0], dtype=torch.bfloat16, enabled=device.startswith("cuda")):
                loss = step(inputs, y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        sync(device)
        rate = batch * args.video_steps / (time.perf_counter() - t0)
        yield dict(layout=layout, compiled=compiled, batch=batch, clips_per_s=round(rate, 1),
                   tflops=round(rate * flops / 1e12, 1),
                   mfu=round(rate * flops / (peak * 1e12), 4) if peak else None, warmup_s=round(warm, 2))


def epoch_seconds(ml100k: Path, device: str, gpu_path: str) -> float | None:
    """One SASRec epoch on ml-100k (maxlen 200, batch 128, the README's settings) on a device and path."""
    if not (ml100k / "u.data").exists():
        return None
    tr, _ = epoch_loop_for("sasrec", [f"data.path={ml100k}", "data.maxlen=200", "train.batch_size=128",
                                   "model.time=false", "model.mhc=false", f"train.gpu_path={gpu_path}"], device)
    our_epoch(tr, 0, device)         # the first epoch warms up; the second is timed
    return round(our_epoch(tr, 1, device), 3)


def our_epoch(tr, epoch: int, device: str) -> float:
    """Seconds of one epoch of an EpochLoop's own batches (device-side sampling included), until the GPU is done."""
    tr.run.recipe.on_epoch_start(epoch, tr.run.model)
    sync(device)
    t0 = time.perf_counter()
    for micro, batch in enumerate(tr.batches(epoch, 0)):
        tr.step(batch, micro)
    tr.losses.read()
    sync(device)
    return time.perf_counter() - t0


def stock_sasrec(args, device: str) -> dict:
    """Our SASRec epoch (ml-100k, maxlen 200, batch 128, bf16, the GPU-shaped step; compile.mode off and
    reduce-overhead) against the stock PyTorch SASRec of bench/sasrec_stock.py on the same device and data, bf16
    autocast, epochs interleaved after one warm-up epoch each (a compiled run's warm-up is its compile, stated
    apart). The stock epoch is the reference's: len(users) // batch random users, batches made before it."""
    import numpy as np

    from bench import sasrec_stock as stock
    s, ml = stock.SETTINGS, Path(args.ml100k)
    maxlen, batch = (30, 16) if args.tiny else (s["maxlen"], s["batch_size"])
    data = [f"data.path={ml}"] if (ml / "u.data").exists() and not args.tiny else \
        [f"data.synthetic_users={200 if args.tiny else 943}", f"data.synthetic_items={100 if args.tiny else 1349}",
         f"data.synthetic_mean_len={20 if args.tiny else 104}"]
    base = [*data, f"data.maxlen={maxlen}", f"train.batch_size={batch}", "model.time=false", "model.mhc=false",
            f"model.width={s['width']}", f"model.depth={s['depth']}", f"model.heads={s['heads']}",
            f"model.dropout={s['dropout']}", "train.amp=bf16", "train.gpu_path=on"]
    modes = ("off", "reduce-overhead") if device.startswith("cuda") else ("off",)   # inductor: a GPU's row
    ours = {m: epoch_loop_for("sasrec", [*base, f"compile.mode={m}"], device)[0] for m in modes}
    split = ours["off"].run.recipe.split
    torch.manual_seed(0)
    model = stock.StockSASRec(split.data.num_items, maxlen, s["width"], s["depth"], s["heads"], s["dropout"])
    model = model.to(device).train()
    opt = torch.optim.Adam(model.parameters(), lr=s["lr"], betas=s["betas"])     # the reference's, unfused
    rng = np.random.default_rng(0)

    def stock_batches():
        return [tuple(t.to(device) for t in b) for b in stock.stock_batches(split, rng, maxlen, batch)]

    epochs = 2 if args.tiny else args.stock_epochs
    warm = {f"ours compile={m}": round(our_epoch(tr, 0, device), 3) for m, tr in ours.items()}
    first = stock_batches()
    warm["stock"] = round(stock.stock_epoch(model, opt, first, torch.bfloat16), 3)
    times: dict[str, list[float]] = {k: [] for k in warm}
    for epoch in range(1, epochs + 1):                   # interleaved: the machine's drift hits all alike
        for m, tr in ours.items():
            times[f"ours compile={m}"].append(round(our_epoch(tr, epoch, device), 4))
        times["stock"].append(round(stock.stock_epoch(model, opt, stock_batches(), torch.bfloat16), 4))
    med = {k: statistics.median(v) for k, v in times.items()}
    out = dict(device=device, data=data[0], maxlen=maxlen, batch=batch, amp="bf16", epochs=epochs,
               warmup_epoch_s=warm, epoch_s=times, median_epoch_s={k: round(v, 4) for k, v in med.items()},
               batches=dict(ours=ours["off"].run.micro_per_epoch, stock=len(first)),
               ratio_ours_over_stock={m: round(med[f"ours compile={m}"] / med["stock"], 3) for m in modes})
    if len(modes) == 1:
        out["compiled"] = "not on a CPU (inductor's compile is a GPU row here)"
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--quick", action="store_true", help="fewer steps and rows (about 2-3 minutes)")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes (a plumbing check, e.g. on a CPU)")
    ap.add_argument("--steps", type=int, default=0, help="timed steps per row (default 100, --quick 40)")
    ap.add_argument("--video-steps", type=int, default=0)
    ap.add_argument("--ml100k", default=str(REPO.parent / "shared" / "data" / "ml-100k"))
    ap.add_argument("--peak-tflops", type=float, default=0.0, help="dense bf16 peak (default: known parts)")
    ap.add_argument("--budget-s", type=float, default=330.0, help="rows left after this many seconds are skipped")
    ap.add_argument("--stock-only", action="store_true", help="only the stock-SASRec row (issue 54 step 2)")
    ap.add_argument("--no-stock", action="store_true", help="leave out the stock-SASRec row")
    ap.add_argument("--stock-epochs", type=int, default=5, help="interleaved epochs of each in the stock row")
    ap.add_argument("--amps", default=",".join(AMPS[:3]), help="the modes of each row, comma-separated, of "
                    f"{', '.join(AMPS)} (deterministic: bf16 under train.deterministic=true; its cost is "
                    "its step over the bf16 row's)")
    ap.add_argument("--only", default="", help="these rows only (comma-separated names, e.g. har,kgat,video; "
                    "video-bare: the bare video step alone), "
                    "joined to the report already at --out")
    ap.add_argument("--video-layouts", default="conv3d", help="the bare video step's model.layout values, "
                    "comma-separated (conv3d, frames)")
    ap.add_argument("--video-batches", default="", help="the bare video step's batches (default 16,32,64,128)")
    ap.add_argument("--video-eager", action="store_true", help="the bare video step eager too, before compiled")
    ap.add_argument("--out", default="")
    ap.add_argument("--plot", metavar="JSON", default="", help="only draw JSON's PNG beside it (e.g. on a machine "
                    "with matplotlib, from a GPU machine's JSON)")
    args = ap.parse_args(argv)
    if args.plot:
        plot(json.loads(Path(args.plot).read_text()), Path(args.plot).with_suffix(".png"))
        print(f"wrote {Path(args.plot).with_suffix('.png')}")
        return 0
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("bench.gpu: no CUDA device here (torch.cuda.is_available() is False); nothing measured.\n"
              "Run it on a GPU node, or `python -m bench.gpu --device cpu --tiny` to check the script.")
        return 2
    args.steps = args.steps or (3 if args.tiny else 40 if args.quick else 100)
    args.video_steps = args.video_steps or (2 if args.tiny else 10 if args.quick else 20)
    name = torch.cuda.get_device_name().replace(" ", "-") if args.device.startswith("cuda") else "cpu"
    out = Path(args.out or REPO / "bench" / "results" / f"gpu-{name}.json")
    start, report = time.perf_counter(), dict(device=name, torch=torch.__version__, date=time.strftime("%Y-%m-%d"),
                                              cuda=torch.version.cuda, rows={}, skipped=[])
    if (args.stock_only or args.only) and out.exists():     # these rows join the report of an earlier run
        report = {**json.loads(out.read_text()), **{k: report[k] for k in ("device", "torch", "cuda")}}
    if args.device.startswith("cuda"):
        report["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    compiled = args.device.startswith("cuda") and not args.tiny     # inductor on a GPU: a row of its own
    only = set(filter(None, args.only.split(",")))
    amps = [a.strip() for a in args.amps.split(",") if a.strip()]
    layouts = [la.strip() for la in args.video_layouts.split(",") if la.strip()]
    if set(layouts) - {"conv3d", "frames"}:
        ap.error(f"--video-layouts {args.video_layouts}: each one of conv3d, frames")
    if set(amps) - set(AMPS):
        ap.error(f"--amps {args.amps}: each one of {', '.join(AMPS)}")
    for row, recipe, overrides in [] if args.stock_only else [r for r in rows(args) if not only or r[0] in only]:
        for amp in amps:
            if amp == "compiled" and (not compiled or row == "kgat"):      # KGAT's sparse products: not compiled
                continue
            if amp == "graph-compiled" and (not compiled or row == "kgat"):
                continue            # graph: compile.step_graph=on, the whole step one CUDA graph per batch shape
            if time.perf_counter() - start > args.budget_s:
                report["skipped"].append(f"{row} {amp}: over --budget-s")
                continue
            key = f"{row} {amp}"
            cfg = [*overrides, f"train.amp={'off' if amp == 'fp32' else 'bf16'}", "train.gpu_path=on",
                   "log.tensorboard=false"] + (["compile.mode=reduce-overhead"] if amp == "compiled" else []) \
                + (["train.deterministic=true"] if amp == "deterministic" else []) \
                + (["compile.step_graph=on"] if amp.startswith("graph") else []) \
                + (["compile.mode=default"] if amp == "graph-compiled" else [])
            try:
                r = time_steps(recipe, cfg, args.device, args.steps, 10 if not args.tiny else 2,
                               profile=amp in ("bf16", "graph") and row in TARGETS)
                # graph: the steps counted are replays (the host's work per step), not the warm-up or the capture
                counts = step_counts(recipe, cfg, device=args.device, warmup=3 if amp.startswith("graph") else 2)
            except Exception as err:  # noqa: BLE001 - one row's defect is a finding; the other rows still run
                report["rows"][key] = {"error": f"{type(err).__name__}: {str(err).splitlines()[0][:300]}"}
                print(f"{key:28s} FAILED {report['rows'][key]['error']}", flush=True)
                traceback.print_exc()
                torch._dynamo.reset()
                save(report, out)
                continue
            finally:
                if amp == "deterministic":      # a process-wide setting: the rows after it are not deterministic
                    nondeterministic_kernels()
            bf16 = report["rows"].get(f"{row} bf16", {}).get("step_ms")
            if amp == "deterministic" and bf16:
                r["cost_over_bf16"] = round(r["step_ms"] / bf16, 3)
            report["rows"][key] = r
            r.update(ops=counts.ops, syncs=counts.syncs, batch_ops=counts.data_ops)
            if row in TARGETS and amp in ("bf16", "compiled", "graph", "graph-compiled"):
                metric, bound, how = TARGETS[row]
                r["target"] = f"{metric} {how} {bound}"
                r["met"] = r[metric] <= bound if how == "<=" else r[metric] >= bound
            print(f"{key:28s} {json.dumps(r)}", flush=True)
            save(report, out)         # row by row: a step stopped at its cap keeps the rows it measured
    if time.perf_counter() - start < args.budget_s and not args.stock_only and \
            (not only or only & {"video", "video-bare"}):
        report["video_bare"] = bare = [] if not only or "video" in only else \
            [b for b in report.get("video_bare", []) if b.get("layout", "conv3d") not in layouts]
        batches = [int(b) for b in args.video_batches.split(",")] if args.video_batches else None
        for layout, compiled in [(la, False) for la in layouts if args.video_eager] + [(la, True) for la in layouts]:
            for one in video_sweep(args, args.device, layout, compiled, batches):    # batch by batch: a step
                bare.append(one)                                                      # stopped at its cap keeps them
                print("video bare step:", json.dumps(one), flush=True)
                save(report, out)
        loop = report["rows"].get("video compiled") or report["rows"].get("video bf16")
        same = next((b for b in bare if b["batch"] == (4 if args.tiny else 16) and b.get("compiled", True)
                     and b.get("layout", "conv3d") == "conv3d"), None)
        if loop and same:     # the loop (loader, engine) against the bare step at the loop's batch
            report["video_loop_loss"] = round(1 - loop["samples_per_s"] / same["clips_per_s"], 4)
    if time.perf_counter() - start < args.budget_s and not args.no_stock and not only:
        report["stock_sasrec"] = row = stock_sasrec(args, args.device)
        print("stock SASRec:", json.dumps(row), flush=True)
    if time.perf_counter() - start < args.budget_s and not (args.tiny or args.stock_only) and \
            (not only or only & {"sasrec-ml100k", "epoch"}):
        report["sasrec_ml100k_epoch_s"] = dict(gpu=epoch_seconds(Path(args.ml100k), args.device, "on"),
                                               cpu=epoch_seconds(Path(args.ml100k), "cpu", "off"))
    report["stock_seconds" if args.stock_only else "seconds"] = seconds = round(time.perf_counter() - start, 1)
    save(report, out)
    try:
        plot(report, out.with_suffix(".png"))
        print(f"wrote {out} and {out.with_suffix('.png')} in {seconds} s")
    except ImportError:
        print(f"wrote {out} in {seconds} s; no matplotlib here: `python -m bench.gpu --plot {out.name}` draws the "
              f"PNG where there is one")
    return 0


def save(report: dict, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(report, indent=1) + "\n")
    tmp.replace(out)


def plot(report: dict, png: Path) -> None:
    """Step time per recipe, fp32 beside bf16, compiled and deterministic where measured; beside it, the
    stock-SASRec row's epochs."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    names = list(dict.fromkeys(k.rsplit(" ", 1)[0] for k in report["rows"]))
    stock = report.get("stock_sasrec")
    fig, axes = plt.subplots(1, 2 if stock else 1, figsize=(12 if stock else 8, 3.5), squeeze=False,
                             gridspec_kw=dict(width_ratios=[2, 1] if stock else [1]))
    ax = axes[0][0]
    for i, amp in enumerate(AMPS):
        ms = [report["rows"].get(f"{n} {amp}", {}).get("step_ms", 0) for n in names]
        ax.bar([j + 0.2 * i for j in range(len(names))], ms, width=0.2, label=amp)
    ax.set_xticks([j + 0.3 for j in range(len(names))], names, rotation=20)
    ax.set_ylabel("ms per optimizer step")
    ax.set_yscale("log")
    ax.set_title(f"{report['device']}, torch {report['torch']}, CUDA {report.get('cuda')}, {report['date']}",
                 fontsize=9)
    ax.legend(fontsize=8)
    if stock:
        right = axes[0][1]
        for label, times in stock["epoch_s"].items():
            right.plot(range(1, len(times) + 1), times, marker="o", label=label)
        right.set_xlabel("interleaved epoch")
        right.set_ylabel("seconds per epoch")
        right.set_ylim(bottom=0)
        ratios = ", ".join(f"{m}: {r}" for m, r in stock["ratio_ours_over_stock"].items())
        right.set_title(f"SASRec epoch, ours / stock\n(compile {ratios})", fontsize=9)
        right.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
