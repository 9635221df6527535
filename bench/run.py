"""One benchmark entry point for every recipe: a fixed number of training steps after a warm-up on the recipe's
synthetic data, sized so that every timed step is a full batch of the first epoch, then the test evaluation.
Per recipe it runs one rank, then at each larger world size (gloo, one thread per rank, the same per-rank
batch): DDP under torchrun, as many independent single-rank processes at once (what sharing the machine costs,
no communication), DDP under Slurm's srun (one task per node; when a cluster answers), and the step's
collectives timed alone. Writes one JSON per run and summary.{json,md,png} in bench/results/harness/.

    python -m bench.run                              # every recipe, worlds 1 and 2 -> bench/results/harness/
    python -m bench.run har video --steps 20 --warmup 3 --slurm off
    python -m bench kgat --world 1                   # the same through bench/__main__.py
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from bench.common import trainer_env
from bench.harness import cost_shares, phase_extra_ms, repeat_efficiency, scaling_efficiency, step_stats
from bench.report import plot, tables
from trainer.engine.logging import read_metrics

REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class BenchPreset:
    """CPU-sized settings for the harness: per-rank batch, fixed overrides, and data(n, out) -> overrides giving at
    least n training samples (out: the harness's output folder)."""

    batch: int
    args: tuple[str, ...]
    data: Callable[[int, Path], list[str]]


def presets() -> dict[str, BenchPreset]:
    """Each recipe's bench preset: `BENCH = dict(batch=..., args=..., data=...)` beside `SPEC` in its spec module
    (trainer/recipes/<name>/spec.py, or a TRAINER_PLUGINS module); the product's RecipeSpec knows nothing of it."""
    from trainer.config.registry import spec_modules, specs
    specs()                                   # imports every spec module, once
    builtin, plugins = spec_modules()
    found = {}
    for name in builtin + plugins:
        module = sys.modules.get(name)
        bench, spec = getattr(module, "BENCH", None), getattr(module, "SPEC", None)
        if bench is not None and spec is not None:
            found[spec.name] = BenchPreset(batch=bench["batch"], args=tuple(bench["args"]), data=bench["data"])
    return found


COMMON = ("--epochs", "100000", "log.every_steps=1", "train.eval_every_epochs=100000", "ckpt.every_epochs=0",
          "log.tensorboard=false", "log.progress=off", "ckpt.save_best=false", "log.measure_sync=true")
LAUNCHERS = ("torchrun", "independent", "slurm")


def clean_env(**extra: str) -> dict[str, str]:
    """This environment without a surrounding Slurm job's variables (they would make the trainer a Slurm
    task), one thread per rank."""
    env = {k: v for k, v in trainer_env(threads=1, **extra).items()
           if not k.startswith("SLURM_") or k == "SLURM_CONF"}
    return env


def slurm_conf() -> tuple[str | None, str]:
    """(slurm.conf of a cluster that answers, why not)."""
    from hpc.slurm_info import local_cluster_dir
    where = local_cluster_dir()
    conf = os.environ.get("SLURM_CONF") or (str(where / "slurm.conf") if where else "(no local cluster started)")
    if shutil.which("srun") is None:
        return None, "srun is not on PATH (make slurm-install)"
    if not Path(conf).exists():
        return None, f"no cluster configuration at {conf} (make slurm-up, or set SLURM_CONF)"
    try:
        proc = subprocess.run(["sinfo", "-h", "-o", "%D"], env=clean_env(SLURM_CONF=conf), capture_output=True,
                              text=True, timeout=20)
    except subprocess.TimeoutExpired:
        return None, f"sinfo did not answer in 20 s ({conf})"
    if proc.returncode != 0:
        return None, f"sinfo failed ({conf}): {proc.stderr.strip()[:200]}"
    return conf, ""


def generates_on_request(recipe: str) -> bool:
    """Whether the recipe's data section has data.synthetic (trainer/config/data_source.py)."""
    from trainer.config.registry import get_spec
    return hasattr(get_spec(recipe).data_config(), "synthetic")


def trainer_args(recipe: str, run_dir: Path, steps: int, warmup: int, max_world: int, out: Path) -> list[str]:
    preset = presets()[recipe]
    data = preset.data(max_world * (warmup + steps) * preset.batch, out)
    if not any(a.startswith("data.path=") for a in data) and generates_on_request(recipe):
        data = [*data, "data.synthetic=true"]         # generated data on purpose: srun runs refuse it otherwise
    return ["-m", "trainer", "train", "--recipe", recipe, "--run-dir", str(run_dir), "--batch-size",
            str(preset.batch), *preset.args, *data, *COMMON, f"train.max_steps={warmup + steps}"]


def commands(launcher: str, world: int, args_for: Callable[[Path], list[str]], dirs: list[Path],
             tag: str) -> list[list[str]]:
    """The processes of one run (started together); args_for(run_dir) gives the trainer's arguments."""
    py = sys.executable
    if launcher == "independent":
        return [[py, *args_for(d)] for d in dirs]
    args = args_for(dirs[0])
    if launcher == "slurm":
        return [["srun", f"--nodes={world}", "--ntasks-per-node=1", "--cpus-per-task=1", "--time=20",
                 f"--job-name=bench-{tag}", py, *args]]
    if world == 1:
        return [[py, *args]]
    return [[py, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}", *args]]


def run_dirs(launcher: str, world: int, run_dir: Path) -> list[Path]:
    return [Path(f"{run_dir}-{i}") for i in range(world)] if launcher == "independent" else [run_dir]


def read_run(run_dir: Path, warmup: int, launched: float) -> dict:
    """One run directory's step statistics, start-up time, evaluation and parameter count."""
    rows = read_metrics(run_dir)
    train = [r for r in rows if r["split"] == "train" and "step_time_s" in r]
    test = next((r for r in reversed(rows) if r["split"] == "test"), {})
    params = re.search(r"params=(\d+)", (run_dir / "train.log").read_text())
    stats = step_stats(train, warmup)
    return dict(stats, epochs_timed=sorted({r["epoch"] for r in train[warmup:]}),
                first_step_s=round(train[0]["time"] - launched, 3),
                eval_time_s=test.get("eval_time_s"), params=int(params.group(1)) if params else 0,
                metrics={k: v for k, v in test.items()
                         if isinstance(v, (int, float)) and k not in ("epoch", "step", "time", "eval_time_s")})


def combine(parts: list[dict]) -> dict:
    """Independent processes side by side: their throughputs add, their step times average."""
    out = dict(parts[0])
    out.update(samples_per_s=sum(p["samples_per_s"] for p in parts),
               step_time_mean_s=sum(p["step_time_mean_s"] for p in parts) / len(parts),
               step_time_median_s=max(p["step_time_median_s"] for p in parts),
               step_time_p90_s=max(p["step_time_p90_s"] for p in parts),
               data_wait_frac=sum(p["data_wait_frac"] for p in parts) / len(parts),
               peak_rss_mb=max(p["peak_rss_mb"] for p in parts),
               **{k: sum(p[k] for p in parts) / len(parts) for k in ("forward_s", "backward_s")
                  if all(k in p for p in parts)},
               per_process_samples_per_s=[round(p["samples_per_s"], 3) for p in parts])
    return out


def run_one(recipe: str, launcher: str, world: int, steps: int, warmup: int, max_world: int, out: Path,
            conf: str | None = None, rep: int = 0) -> dict:
    """Train `recipe` for warmup + steps optimizer steps; the run's record."""
    tag = f"{recipe}-{launcher}-w{world}-r{rep}"
    run_dir = out / "runs" / tag
    dirs = run_dirs(launcher, world, run_dir)
    for d in dirs:
        shutil.rmtree(d, ignore_errors=True)
    env = clean_env(SLURM_CONF=conf) if conf else clean_env()
    cmds = commands(launcher, world, lambda d: trainer_args(recipe, d, steps, warmup, max_world, out), dirs, tag)
    # output to files, not pipes: a process blocked on a full pipe while another is awaited would skew its timing
    logs = [run_dir.parent / f"{tag}-{i}.out" for i in range(len(cmds))]
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    launched = time.time()
    procs = []
    for cmd, log in zip(cmds, logs):
        with open(log, "w") as f:
            procs.append(subprocess.Popen(cmd, env=env, cwd=REPO, stdout=f, stderr=subprocess.STDOUT, text=True))
    for cmd, proc, log in zip(cmds, procs, logs):
        if proc.wait() != 0:
            raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}:\n{log.read_text()[-3000:]}")
    wall = time.time() - launched
    parts = [read_run(d, warmup, launched) for d in dirs]
    stats = combine(parts) if launcher == "independent" else parts[0]
    if stats["epochs_timed"] != [0]:
        print(f"WARNING {tag}: the timed steps span epochs {stats['epochs_timed']}: partial batches and epoch "
              f"start-up are in the figures (fewer --steps, or a larger preset)", file=sys.stderr)
    record = dict(recipe=recipe, launcher=launcher, world=world, threads_per_rank=1,
                  batch_per_rank=presets()[recipe].batch, warmup=warmup, wall_s=round(wall, 2),
                  **{k: round(v, 6) if isinstance(v, float) else v for k, v in stats.items()})
    print(f"{recipe:<7} {launcher:<11} world {world} #{rep}: {record['samples_per_s']:9.1f} samples/s, step "
          f"{record['step_time_median_s']:.4f} s (p90 {record['step_time_p90_s']:.4f}), loader wait "
          f"{record['data_wait_frac']:.1%}, first step done after {record['first_step_s']:.1f} s", flush=True)
    return record


def best_of(runs: list[dict]) -> dict:
    """The repeat with the highest throughput (interference on a shared machine only slows a run down), with
    every repeat's figure kept."""
    best = dict(max(runs, key=lambda r: r["samples_per_s"]))
    best["repeats_samples_per_s"] = [round(r["samples_per_s"], 3) for r in runs]
    return best


def time_collectives(params: int, world: int) -> dict:
    """bench/allreduce.py at this world size: the gradient all-reduce and the loop's two small ones."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
           str(REPO / "bench" / "allreduce.py"), str(params)]
    proc = subprocess.run(cmd, env=clean_env(), cwd=REPO, capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stderr[-2000:]}")
    return json.loads(next(x for x in proc.stdout.splitlines() if x.startswith("{")))


def annotate(records: list[dict], collectives: dict[tuple[str, int], dict]) -> None:
    """Scaling efficiency on every distributed record, and the cost split on the torchrun ones."""
    single = {r["recipe"]: r for r in records if r["world"] == 1}
    for r in records:
        base = single.get(r["recipe"])
        if r["world"] == 1 or base is None:
            continue
        r["scaling_efficiency"] = round(scaling_efficiency(r["samples_per_s"], r["world"], base["samples_per_s"]), 4)
        shared = next((x for x in records if (x["recipe"], x["launcher"], x["world"]) ==
                       (r["recipe"], "independent", r["world"])), None)
        coll = collectives.get((r["recipe"], r["world"]))
        if r["launcher"] == "torchrun" and shared and coll:
            r["collectives"] = coll
            r["costs"] = {k: round(v, 4) for k, v in cost_shares(
                base["step_time_mean_s"], r["step_time_mean_s"], shared["step_time_mean_s"],
                r["sync_wait_frac"] * r["step_time_mean_s"]).items()}
            extra = phase_extra_ms(r, shared)
            if extra:
                r["ddp_extra_ms"] = {k: round(v, 3) for k, v in extra.items()}


def summarize(records: list[dict]) -> list[dict]:
    """One row per recipe and world size > 1 (or world 1 alone when nothing larger ran)."""
    rows = []
    for recipe in dict.fromkeys(r["recipe"] for r in records):
        runs = {(r["launcher"], r["world"]): r for r in records if r["recipe"] == recipe}
        base = runs.get(("torchrun", 1))
        worlds = sorted({w for _, w in runs if w > 1}) or [1]
        for w in worlds:
            ddp, shared, slurm = (runs.get((launcher, w)) for launcher in LAUNCHERS)
            row = dict(recipe=recipe, world=w)
            if base:
                row.update(samples_per_s_1=round(base["samples_per_s"], 2),
                           step_time_median_s=base["step_time_median_s"],
                           step_time_p90_s=base["step_time_p90_s"], data_wait_frac=base["data_wait_frac"],
                           peak_rss_mb=base["peak_rss_mb"], eval_time_s=base["eval_time_s"],
                           first_step_s_1=base["first_step_s"], params=base["params"])
                one = base.get("repeats_samples_per_s") or []
                if len(one) > 1:        # the machine's own drift: one process alone, run to run
                    row["single_rank_spread"] = round(max(one) / min(one), 4)
            for name, run in (("ddp", ddp), ("independent", shared), ("slurm", slurm)):
                if run and w > 1:
                    row[f"samples_per_s_{name}"] = round(run["samples_per_s"], 2)
                    row[f"first_step_s_{name}"] = run["first_step_s"]
                    if "scaling_efficiency" in run:
                        row[f"efficiency_{name}"] = run["scaling_efficiency"]
                    if base and run.get("repeats_samples_per_s") and base.get("repeats_samples_per_s"):
                        spread = repeat_efficiency(base["repeats_samples_per_s"], run["repeats_samples_per_s"], w)
                        row[f"efficiency_{name}_repeats"] = {k: round(v, 4) for k, v in spread.items()}
            if ddp and "costs" in ddp:
                row.update(costs=ddp["costs"], allreduce_alone_ms=ddp["collectives"]["grad_ms"],
                           collectives_alone_ms=ddp["collectives"].get("step_ms"),
                           sync_wait_ms=round(1000 * ddp["sync_wait_frac"] * ddp["step_time_mean_s"], 3),
                           data_wait_frac_ddp=ddp["data_wait_frac"], ddp_extra_ms=ddp.get("ddp_extra_ms"))
            if ddp and slurm:
                row["slurm_vs_torchrun"] = round(slurm["samples_per_s"] / ddp["samples_per_s"], 4)
            rows.append(row)
    return rows


def machine() -> dict:
    import torch
    return dict(cpus=os.cpu_count(), processor=platform.processor() or platform.machine(),
                python=platform.python_version(), torch=str(torch.__version__), device="cpu (gloo)",
                threads_per_rank=1)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    known = presets()
    p.add_argument("recipes", nargs="*", default=list(known), help=f"any of {', '.join(known)} (default all)")
    p.add_argument("--world", type=int, nargs="+", default=[1, 2], help="world sizes (default 1 2)")
    p.add_argument("--steps", type=int, default=20, help="timed optimizer steps")
    p.add_argument("--warmup", type=int, default=3, help="untimed optimizer steps first")
    p.add_argument("--repeat", type=int, default=2, help="runs of each configuration, interleaved; the fastest "
                   "counts (default 2)")
    p.add_argument("--slurm", choices=["auto", "on", "off"], default="auto",
                   help="also launch through srun on a Slurm cluster (auto: when one answers)")
    p.add_argument("--out", default=str(REPO / "bench" / "results" / "harness"))
    args = p.parse_args(argv)
    unknown = [r for r in args.recipes if r not in known]
    if unknown:
        p.error(f"unknown recipe(s) {unknown}; choose from {', '.join(known)}")
    if min(args.world) < 1 or args.steps < 1 or args.warmup < 0 or args.repeat < 1:
        p.error("--world >= 1, --steps >= 1, --warmup >= 0 and --repeat >= 1")
    conf, why = slurm_conf() if args.slurm != "off" else (None, "--slurm off")
    if args.slurm == "on" and conf is None:
        p.error(f"--slurm on: {why}")
    if conf is None:
        print(f"Slurm launch path not measured: {why}", flush=True)
    out = Path(args.out).resolve()       # the trainer runs with cwd=REPO
    out.mkdir(parents=True, exist_ok=True)
    worlds, top = sorted(set(args.world)), max(args.world)
    records: list[dict] = []
    collectives: dict[tuple[str, int], dict] = {}
    for recipe in args.recipes:
        configs = [(launcher, w) for w in worlds
                   for launcher in ["torchrun"] + (["independent"] + (["slurm"] if conf else []) if w > 1 else [])]
        runs: dict[tuple[str, int], list[dict]] = {c: [] for c in configs}
        for rep in range(args.repeat):             # interleaved: a slow spell of the machine hits every config
            for launcher, w in configs:
                runs[(launcher, w)].append(run_one(recipe, launcher, w, args.steps, args.warmup, top, out, conf, rep))
        records += [best_of(runs[c]) for c in configs]
        for w in (w for w in worlds if w > 1):
            collectives[(recipe, w)] = time_collectives(records[-1]["params"], w)
    annotate(records, collectives)
    rows = summarize(records)
    for r in records:                              # written once annotate() added the efficiencies
        (out / f"{r['recipe']}-{r['launcher']}-w{r['world']}.json").write_text(json.dumps(r, indent=1))
    summary = dict(rows=rows, runs=records, date=time.strftime("%Y-%m-%d %H:%M"), machine=machine(),
                   steps=args.steps, warmup=args.warmup, repeat=args.repeat, slurm=conf is not None, slurm_note=why)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    text = tables(rows)
    (out / "summary.md").write_text(text + "\n")
    plot(rows, out / "summary.png")
    print(text)
    print(f"wrote {out}/summary.{{json,md,png}} and one JSON per run")
    return 0


if __name__ == "__main__":
    sys.exit(main())
