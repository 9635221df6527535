"""How KGAT's cost grows to amazon-book's size: the CF phase, the KG phase, the attention refresh and the
full-ranking evaluation of every test user, with peak memory, at 1/8, 1/4, 1/2 and the full size, at 1 and 2
ranks (gloo). Writes bench/results/kgat_scale.{json,png}: a table and a log-log plot with fitted slopes.

    python -m bench.kgat_scale                                  # amazon-book's sizes (~4 minutes on 2 cores)
    python -m bench.kgat_scale --repeat 3                       # each point the median of 3 sweeps
    python -m bench.kgat_scale --preset tiny --cf-steps 2       # seconds

Each point is a fresh process (torchrun for 2 ranks) on generated data of the preset's statistics times the
fraction (relations stay). A full epoch at amazon-book's size is ~30 minutes on this CPU, nearly all CF steps,
so the phases are timed on their first steps and scaled to the epoch's step count (the steps of a phase are
alike: the same propagation over the whole graph, a fixed batch): CF = the first --warmup steps as they took
(at two ranks the second CF step took up to 2x a steady one at the larger sizes) + the mean of the next
--cf-steps x the remaining CF steps, KG likewise; the attention refresh runs in full --attention-repeats
times (their median: one refresh takes tens of ms at 1/8) and the evaluation once. Work units for the slopes:
CF = steps x graph edges (each step propagates over the whole graph), KG = triples (steps x batch),
attention = graph edges, evaluation = test users x items (every user is ranked against every item, in
batches). The optimizer's share of each step is recorded too (`model.kg_update=dense` to measure the
original's every-row KG update).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

FRACTIONS = (0.125, 0.25, 0.5, 1.0)
PHASES = ("cf", "kg", "attention", "eval")


def stats_for(preset: str, fraction: float):
    from trainer.recipes.kgat import convert
    s = convert.PRESETS[preset]
    scaled = {k: max(1, round(v * fraction)) for k, v in s.items() if k != "relations"}
    return convert.Stats(relations=s["relations"], **scaled)


def worker(args) -> None:
    """One measurement in this process (one rank of it under torchrun); rank 0 prints a JSON line."""
    import numpy as np
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from trainer.config.settings import DistConfig, TrainConfig
    from trainer.distributed import gradsync
    from trainer.distributed.runtime import DistInfo, all_reduce, attach_local, teardown
    from trainer.engine.build import wrap_model
    from trainer.recipes.kgat import convert
    from trainer.recipes.kgat import data as D
    from trainer.recipes.kgat.config import KGATDataConfig, KGATEvalConfig, KGATLossConfig, KGATModelConfig
    from trainer.recipes.kgat.recipe import KGATRecipe
    if KGATRecipe.reuse_freed_memory:                # as the engine does before it builds a recipe's data
        from trainer.native import memory
        memory.reuse_freed_memory()

    world, rank = int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("RANK", 0))
    if world > 1:
        dist.init_process_group("gloo")
    info = DistInfo(rank=rank, local_rank=rank, world_size=world, backend="gloo" if world > 1 else "none",
                    local_world_size=world)
    comm = attach_local(info, args.shm)                    # the trainer's all-reduce path (shared memory)
    torch.manual_seed(args.seed)
    t0 = time.perf_counter()
    stats = stats_for(args.preset, args.fraction)
    data = D.hold_out_validation(convert.synthesize(stats, args.seed), 0.0, 2019)
    recipe = KGATRecipe(KGATDataConfig(val_fraction=0.0), KGATModelConfig(kg_update=args.kg_update),
                        replace(TrainConfig(), batch_size=1024), info, KGATEvalConfig(), seed=args.seed,
                        loss_cfg=KGATLossConfig())
    import trainer.recipes.kgat.recipe as R
    R.load_data = lambda cfg, *rest: data                  # the generated data above, not the config's
    _, evals = recipe.build_datasets()
    model = recipe.build_model()
    wrapped = wrap_model(model, info, DistConfig(), recipe.find_unused_parameters, recipe.broadcast_buffers,
                         not recipe.average_after_backward)          # as the engine wraps it (KGAT: no DDP)
    sync = gradsync.after_backward(list(model.parameters()), info, None) if wrapped is model else None
    if comm is not None and isinstance(wrapped, DDP):
        gradsync.attach(wrapped, comm, timed=False)
    optimizer = recipe.build_optimizer(wrapped, 1e-4)
    setup_s = time.perf_counter() - t0
    plan = recipe.epoch_batches(0)

    optimizer_s = {"cf": [], "kg": []}

    def steps(indices, wrapped=wrapped, optimizer=optimizer, sync=sync) -> list[float]:
        times = []
        for i in indices:
            batch = plan[i]
            t = time.perf_counter()
            recipe.before_step(batch)
            loss = recipe.training_step(wrapped, batch)
            loss.backward()
            if sync is not None:
                sync()
            t_opt = time.perf_counter()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            times.append(time.perf_counter() - t)
            optimizer_s[batch["phase"]].append(time.perf_counter() - t_opt)
        return times

    n_cf, n_kg = plan.n_cf_steps, plan.n_kg_steps
    cf_all = steps(range(min(n_cf, args.warmup + args.cf_steps)))
    kg_all = steps(range(n_cf, n_cf + min(n_kg, args.warmup + args.kg_steps)))
    # a phase's first steps are slower (its heap grows, the products are built): counted once, as they occur,
    # and the steady steps' mean for the rest (extrapolating a mean that held a 2x first step multiplied it)
    cf_warm, cf = cf_all[:args.warmup], cf_all[args.warmup:] or [0.0]
    kg_warm, kg = kg_all[:args.warmup], kg_all[args.warmup:] or [0.0]
    refreshes = []
    for _ in range(args.attention_repeats):       # the attention refresh; tens of ms at 1/8: a median of a few
        t = time.perf_counter()
        recipe.on_epoch_end(0, wrapped)
        refreshes.append(time.perf_counter() - t)
    attention_s = statistics.median(refreshes)

    users = evals["test"]
    share = list(range(rank, len(users), world))                            # the engine's strided shards
    t = time.perf_counter()
    wrapped.eval()
    recipe.on_evaluation_start(wrapped)
    totals = None
    with torch.no_grad():
        for start in range(0, len(share), args.eval_batch):
            idx = share[start:start + args.eval_batch]
            batch = [torch.tensor([users[i][0] for i in idx]), torch.tensor([users[i][1] for i in idx])]
            out = recipe.eval_step(wrapped, batch)
            totals = out if totals is None else {k: totals[k] + v for k, v in out.items()}
    totals = {k: all_reduce(v.double(), info) for k, v in totals.items()}
    metrics = recipe.compute_metrics(totals)
    recipe.on_evaluation_end()
    eval_s = time.perf_counter() - t
    peak = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20], dtype=torch.float64)
    peak = all_reduce(peak, info, op="max")
    if rank == 0:
        edges = len(recipe.ckg.heads)
        print(json.dumps(dict(
            fraction=args.fraction, world=world, users=data.n_users, items=data.n_items,
            entities=data.n_entities, triples=len(data.kg), train_interactions=int(sum(map(len, data.train))),
            test_users=len(users), edges=edges, cf_steps=n_cf, kg_steps=n_kg, cf_batch=recipe.cf_batch,
            kg_batch=recipe.kg_batch, cf_steps_timed=len(cf), kg_steps_timed=len(kg),
            cf_step_s=float(np.mean(cf)), kg_step_s=float(np.mean(kg)),
            optimizer_step_s={k: float(np.mean(v[args.warmup:] or v or [0.0])) for k, v in optimizer_s.items()},
            warmup_steps_s=dict(cf=cf_warm, kg=kg_warm), attention_runs_s=refreshes,
            phase_s=dict(cf=sum(cf_warm) + float(np.mean(cf)) * (n_cf - len(cf_warm)),
                         kg=sum(kg_warm) + float(np.mean(kg)) * (n_kg - len(kg_warm)), attention=attention_s,
                         eval=eval_s),
            work=dict(cf=n_cf * edges, kg=n_kg * recipe.kg_batch * world, attention=edges,
                      eval=len(users) * data.n_items),
            dense_scores_gib=len(users) * data.n_items * 4 / 2 ** 30,
            eval_batch_scores_gib=args.eval_batch * data.n_items * 4 / 2 ** 30,
            peak_rss_gib=float(peak), setup_s=setup_s, recall20=metrics.get("recall@20"),
            allreduce_via="shm" if comm is not None else info.backend)), flush=True)
    del steps, wrapped, optimizer, sync              # a DDP reducer holds the group: free it before teardown
    teardown(info)        # the trainer's ordered shutdown: a bare destroy here aborted a rank now and then


def measure(fraction: float, world: int, args) -> dict:
    cmd = [sys.executable, "-m", "bench.kgat_scale", "--worker", "--fraction", str(fraction),
           "--preset", args.preset, "--cf-steps", str(args.cf_steps), "--kg-steps", str(args.kg_steps),
           "--warmup", str(args.warmup), "--attention-repeats", str(args.attention_repeats),
           "--eval-batch", str(args.eval_batch), "--seed", str(args.seed), "--kg-update", args.kg_update,
           "--shm", args.shm]
    if world > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}", *cmd[1:]]
    env = dict(os.environ, OMP_NUM_THREADS=str(max(1, args.threads // world)),
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH", "")])))
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1])


def slope(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of log(y) on log(x)."""
    lx, ly = [math.log(x) for x in xs], [math.log(max(y, 1e-9)) for y in ys]
    mx, my = sum(lx) / len(lx), sum(ly) / len(ly)
    return sum((a - mx) * (b - my) for a, b in zip(lx, ly)) / sum((a - mx) ** 2 for a in lx)


def median_point(runs: list[dict]) -> dict:
    """One point from its runs: the median of each timed figure (the last run's sizes and metrics), and
    every run's phase times under phase_s_runs."""
    point = dict(runs[-1])
    for key in ("cf_step_s", "kg_step_s", "peak_rss_gib", "setup_s"):
        point[key] = statistics.median(r[key] for r in runs)
    for key in ("phase_s", "optimizer_step_s"):
        point[key] = {k: statistics.median(r[key][k] for r in runs) for k in runs[-1][key]}
    point["phase_s_runs"] = {k: [r["phase_s"][k] for r in runs] for k in runs[-1]["phase_s"]}
    return point


def fit_slopes(points: list[dict], worlds: str) -> dict:
    slopes = {}
    for world in map(int, worlds.split(",")):
        rows = [r for r in points if r["world"] == world]
        for phase in PHASES:
            if len(rows) > 1:
                slopes[f"{phase}_w{world}"] = round(slope([r["work"][phase] for r in rows],
                                                          [r["phase_s"][phase] for r in rows]), 3)
    return slopes


def plot(report: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for world, marker in ((1, "o"), (2, "s")):
        rows = [r for r in report["points"] if r["world"] == world]
        if len(rows) < 2:
            continue
        for i, phase in enumerate(PHASES):
            xs, ys = [r["work"][phase] for r in rows], [r["phase_s"][phase] for r in rows]
            k = report["slopes"][f"{phase}_w{world}"]
            axes[0].loglog(xs, ys, marker=marker, c=f"C{i}", ls="-" if world == 1 else "--",
                           label=f"{phase}, {world} rank{'s' if world > 1 else ''} (slope {k:.2f})")
        axes[1].plot([r["fraction"] for r in rows], [r["peak_rss_gib"] for r in rows], marker=marker,
                     label=f"peak RSS per rank, {world} rank{'s' if world > 1 else ''}")
    full = max(report["points"], key=lambda r: r["fraction"])
    axes[1].axhline(full["dense_scores_gib"], c="gray", ls=":", label="one dense test-users x items matrix")
    axes[0].set_xlabel("work (phase's units, see docstring)"), axes[0].set_ylabel("seconds per epoch")
    axes[0].legend(fontsize=7)
    axes[1].set_xlabel(f"fraction of {report['preset']}"), axes[1].set_ylabel("GiB"), axes[1].legend(fontsize=8)
    fig.suptitle(f"KGAT at 1/8..1 of {report['preset']}'s size (generated data), CPU, gloo")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="amazon-book", choices=["amazon-book", "tiny"])
    p.add_argument("--fractions", default=",".join(map(str, FRACTIONS)))
    p.add_argument("--worlds", default="1,2")
    p.add_argument("--cf-steps", type=int, default=5, help="CF steps timed per point (after the warm-up)")
    p.add_argument("--kg-steps", type=int, default=100, help="KG steps timed per point (after the warm-up)")
    p.add_argument("--warmup", type=int, default=2,
                   help="a phase's first steps: timed and counted once in the phase, not in the steady mean")
    p.add_argument("--attention-repeats", type=int, default=3, help="attention refreshes timed (their median)")
    p.add_argument("--kg-update", default="sparse", choices=["sparse", "dense"],
                   help="model.kg_update: the batch's rows (default) or every row at every KG step (the original)")
    p.add_argument("--eval-batch", type=int, default=2048, help="test users scored at once, per rank")
    p.add_argument("--threads", type=int, default=2, help="threads in all (divided among the ranks)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--shm", default="auto", choices=["auto", "off"],
                   help="dist.shm_allreduce: the trainer's shared-memory all-reduce (auto) or gloo's (off)")
    p.add_argument("--repeat", type=int, default=1, help="sweeps; each point's times are the median of its runs")
    p.add_argument("--out", default=str(REPO / "bench" / "results"))
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--fraction", type=float, default=1.0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    grid = [(float(f), int(w)) for f in args.fractions.split(",") for w in args.worlds.split(",")]
    runs = {point: [] for point in grid}
    for round_ in range(args.repeat):       # rounds outermost: the machine's slow spells spread over every point
        for fraction, world in grid:
            t0 = time.time()
            r = measure(fraction, world, args)
            runs[fraction, world].append(r)
            tag = f" [{round_ + 1}/{args.repeat}]" if args.repeat > 1 else ""
            print(f"{fraction:>6} x {args.preset}, {world} rank(s){tag}: "
                  + ", ".join(f"{k} {v:.2f} s" for k, v in r["phase_s"].items())
                  + f", peak {r['peak_rss_gib']:.2f} GiB ({time.time() - t0:.0f} s)", flush=True)
    points = [median_point(runs[point]) for point in grid]
    slopes, slope_range = fit_slopes(points, args.worlds), {}
    if args.repeat > 1:                     # each round's own slopes: how far one sweep can stray
        per_round = [fit_slopes([runs[point][k] for point in grid], args.worlds) for k in range(args.repeat)]
        slope_range = {key: [min(s[key] for s in per_round), max(s[key] for s in per_round)] for key in slopes}
    full = max(points, key=lambda r: (r["fraction"], -r["world"]))
    report = dict(preset=args.preset, points=points, slopes=slopes, repeats=args.repeat,
                  slope_range_over_rounds=slope_range, cf_steps_timed=args.cf_steps, warmup_steps=args.warmup,
                  kg_steps_timed=args.kg_steps, kg_update=args.kg_update, eval_batch=args.eval_batch, shm=args.shm,
                  full_epoch_plus_eval_s=round(sum(full["phase_s"].values()), 1),
                  full_peak_rss_gib=round(full["peak_rss_gib"], 2),
                  machine_memory_gib=round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2 ** 30, 1),
                  machine=dict(cpus=os.cpu_count(), python=platform.python_version()),
                  date=time.strftime("%Y-%m-%d %H:%M"))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "kgat_scale.json").write_text(json.dumps(report, indent=1))
    if len(points) > 1 and slopes:
        plot(report, out / "kgat_scale.png")
    print("slopes (log time / log work):", slopes, f"(each round alone: {slope_range})" if slope_range else "")
    print(f"wrote {out / 'kgat_scale.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
