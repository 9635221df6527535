"""SASRec's data at the sizes users bring (issue 55): generated u.data files of 2M and 20M interactions (MovieLens-
20M's users and items per row), each read in fresh processes, side by side in one run:

    python -m bench.data_scale                        # 2M and 20M (about 6 minutes on 2 cores)
    python -m bench.data_scale --sizes 200000 --repeat 1 --out /tmp/ds   # a plumbing check (tests)

Per size: a bare `pandas.read_csv` of the file (C engine; where pandas is installed), the cold parse and build
with the cache off (today's reader), the cold build into the cache, the warm start from it, each in its own process
with its time and peak RSS; and two processes mapping the same cache at once (peak RSS and PSS of each: PSS
counts a page shared by two processes half to each); then one SASRec training epoch from the cache (steps/s) and
the validation split's evaluation with full ranking (of at most --eval-users users); SASRec's training start from
the warm cache (one step, 50 users evaluated: what every rank of a later launch pays) with its peak RSS, recorded per
commit in bench/results/data_scale_history.jsonl and compared with the last row there (a change of more than 10%
named in the report's "changes" and printed). Every figure is also given
for a tiny dataset (ml-100k's size), so that "above a tiny dataset's" is measured, not assumed. Writes
bench/results/data_scale.{json,png}.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
USERS_PER_ROW, ITEMS = 138_493 / 20_000_263, 26_744           # MovieLens-20M's shape

# each probe: a fresh process that prints one JSON line {"s": seconds of the load (imports apart), "rss_mb": peak
# RSS of the process (torch's import included, as in training: compare with the tiny dataset's), ...}
PROBE = r"""
import json, sys, time
mode, path, cache = sys.argv[1], sys.argv[2], sys.argv[3]
def status_mb(field):          # VmHWM: this process's peak RSS (ru_maxrss would carry the parent's over exec)
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return round(int(line.split()[1]) / 1024, 1)
def pss_mb():
    try:
        for line in open("/proc/self/smaps_rollup"):
            if line.startswith("Pss:"):
                return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        return None
if mode == "pandas":
    import pandas
    t0 = time.perf_counter()
    rows = len(pandas.read_csv(path, sep="\t", header=None))
elif mode == "arrow":
    import pyarrow.parquet
    t0 = time.perf_counter()
    rows = pyarrow.parquet.read_table(path, columns=["user", "item", "timestamp"]).num_rows
elif mode.startswith("kgat"):                # a KGAT folder: train.txt, test.txt, kg_final.txt
    from trainer.recipes.kgat import data as KG
    t0 = time.perf_counter()
    data = KG.load_cached(path, cache_setting=cache)
    rows = int(data.train.offsets[-1] + data.test.offsets[-1] + len(data.kg))
    touched = int(data.train.flat.sum() + data.test.flat.sum() + data.kg.sum())
else:
    from trainer.recipes.sasrec.config import SeqDataConfig
    from trainer.recipes.sasrec.data import load          # torch comes with it, as in a training process
    t0 = time.perf_counter()
    data = load(SeqDataConfig(path=path, cache=cache))
    rows = int(data.seqs.offsets[-1])
    touched = int(data.seqs.flat.sum() + data.times.flat.sum())     # every page read, as an epoch would
seconds = time.perf_counter() - t0
if mode not in ("pandas", "arrow") and cache != "off":     # a build in a child process: its peak is the parse's
    import glob
    for manifest in glob.glob(cache + "/*-*/manifest.json"):
        child = json.load(open(manifest))["meta"].get("child_peak_rss_mb")
if mode.endswith("hold"):
    sys.stdout.write(json.dumps(dict(ready=True)) + "\n"); sys.stdout.flush(); sys.stdin.readline()
print(json.dumps(dict(s=round(seconds, 3), rss_mb=status_mb("VmHWM"), pss_mb=pss_mb(), rows=rows,
                      child_rss_mb=locals().get("child"))))
"""


def probe(mode: str, path: Path, cache: str) -> dict:
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", PROBE, mode, str(path), cache], env=env, capture_output=True,
                          text=True, timeout=3600)
    if proc.returncode != 0:
        raise RuntimeError(f"probe {mode} {path}: {proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def two_ranks(path: Path, cache: str) -> list[dict]:
    """Two processes that map the same warm cache and read every page, alive at once: each one's RSS and PSS."""
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    hold = "kgat-hold" if (path / "train.txt").exists() else "hold"
    procs = [subprocess.Popen([sys.executable, "-c", PROBE, hold, str(path), cache], env=env, text=True,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE) for _ in range(2)]
    for p in procs:
        assert json.loads(p.stdout.readline())["ready"]
    out = []
    for p in procs:                       # both hold their mapping until both have said ready
        p.stdin.write("\n")
        p.stdin.flush()
    for p in procs:
        out.append(json.loads(p.stdout.read().strip().splitlines()[-1]))
        p.wait(60)
    return out


def warm_start(path: Path, cache: str, run_dir: Path) -> dict:
    """What every rank of a later launch pays (issue 88): `train --recipe sasrec` for one step from the warm cache, a
    sampled evaluation of 50 users, in its own process; its wall time and peak RSS (the child's, by wait4)."""
    shutil.rmtree(run_dir, ignore_errors=True)
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="2")
    argv = [sys.executable, "-m", "trainer", "train", "--recipe", "sasrec", "--epochs", "1", "train.max_steps=1",
            "eval.max_users=50", "eval.full_ranking=false", "log.tensorboard=false", "log.progress=off",
            f"data.path={path}", f"data.cache={cache}", "--run-dir", str(run_dir)]
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    err = proc.stderr.read()
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise RuntimeError(f"warm start {path}: exit {proc.returncode}: {err[-2000:]}")
    return dict(s=round(time.perf_counter() - t0, 3), rss_mb=round(usage.ru_maxrss / 1024, 1))


# a change of more than this fraction against the last recorded row (of another commit) is named in the report
CHANGE = 0.10
HISTORY_FIELDS = {"warm_start_rss_mb": ("warm_start", "rss_mb"), "cold_build_s": ("cold_build", "s")}


def commit() -> str:
    proc = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO, capture_output=True,
                           text=True).stdout.strip()
    return (proc.stdout.strip() or "unknown") + ("+changes" if dirty else "")


def history_rows(report: dict, commit_id: str) -> list[dict]:
    """One row per size of the report: its commit, date, rows, and the figures HISTORY_FIELDS names."""
    out = []
    for name, r in report.get("sizes", {}).items():
        row = dict(commit=commit_id, date=report["date"], size=name, rows=r["rows"])
        for field, (probe_name, key) in HISTORY_FIELDS.items():
            if probe_name in r:
                row[field] = r[probe_name][key]
        out.append(row)
    return out


def changes_since(history: list[dict], rows: list[dict], change: float = CHANGE) -> list[str]:
    """Each figure of `rows` that moved by more than `change` against the last recorded row of the same size from
    another commit, in words: 'size 20000000: warm_start_rss_mb 498.0 -> 722.0 (+45%) since 10eb9f3'."""
    said = []
    for row in rows:
        before = [h for h in history if h.get("size") == row["size"] and h.get("commit") != row["commit"]]
        if not before:
            continue
        last = before[-1]
        for field in HISTORY_FIELDS:
            old, new = last.get(field), row.get(field)
            if old and new is not None and abs(new - old) / old > change:
                said.append(f"size {row['size']}: {field} {old:g} -> {new:g} ({(new - old) / old:+.0%}) since "
                            f"{last['commit']} ({last.get('date', '')})")
    return said


def record_history(report: dict, path: Path) -> list[str]:
    """Append this run's rows to the history file (JSON lines) and return the changes against its last rows."""
    history = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
    rows = history_rows(report, commit())
    said = changes_since(history, rows)
    with open(path, "a") as fh:
        for row in rows:
            fh.write(json.dumps(row) + "\n")
    return said


def train_epoch(path: Path, cache: str, run_dir: Path, eval_users: int) -> dict:
    """One SASRec epoch (maxlen 50, batch 128, SASRec without time or mHC) from the warm cache, then the
    validation split's evaluation, full ranking included, of at most `eval_users` users: from metrics.jsonl."""
    from bench.common import run_trainer
    rows, _ = run_trainer(["--recipe", "sasrec", "--epochs", "1", f"data.path={path}", f"data.cache={cache}",
                           "data.maxlen=50", "model.time=false", "model.mhc=false", "--batch-size", "128",
                           f"eval.max_users={eval_users}", "log.tensorboard=false", "log.progress=off"], run_dir)
    epoch = next(r for r in rows if r["split"] == "train" and "epoch_time_s" in r)
    val = next(r for r in rows if r["split"] == "val")
    rss = max(r.get("rss_mb", 0) for r in rows if r["split"] == "train")
    return dict(steps=epoch["step"], epoch_s=epoch["epoch_time_s"],
                steps_per_s=round(epoch["step"] / epoch["epoch_time_s"], 2), train_rss_mb=rss,
                eval_users=val["users"], eval_s=val["eval_time_s"],
                eval_users_per_s=round(val["users"] / val["eval_time_s"], 1), full_ndcg10=round(val["full_ndcg@10"], 4))


def generate(rows: int, folder: Path, kind: str = "udata") -> Path:
    """A u.data (kind "udata") or Parquet file (user, item, timestamp: int64) of about `rows` interactions from
    the project's generator (vectorized above 1M rows)."""
    path = folder / f"u-{rows}.{'data' if kind == 'udata' else 'parquet'}"
    if not path.exists():
        from trainer.recipes.sasrec import sequences
        users = max(10, round(rows * USERS_PER_ROW))
        t0 = time.perf_counter()
        inter = sequences.synthesize(users, ITEMS, max(5, round(rows / users)), seed=0, vectorized=True)
        if kind == "udata":
            sequences.write_udata(inter, path)
        else:
            import pyarrow as pa
            import pyarrow.parquet as pq
            tmp = path.with_name(f".{path.name}.tmp")
            pq.write_table(pa.table(dict(user=inter.user_ids, item=inter.item_ids, timestamp=inter.times)), tmp,
                           row_group_size=4_000_000)
            tmp.replace(path)
        print(f"generated {len(inter):,} rows in {time.perf_counter() - t0:.1f} s: {path}", flush=True)
    return path


def generate_kgat(scale: float, folder: Path) -> Path:
    """A KGAT folder of amazon-book's statistics (the KGAT paper's) times `scale` (relations stay; 0: the tiny
    preset), from the project's generator: train.txt, test.txt, kg_final.txt."""
    out = folder / (f"kgat-amazon-book-x{scale:g}" if scale else "kgat-tiny")
    if not (out / "kg_final.txt").exists():
        from trainer.recipes.kgat import convert
        preset = dict(convert.PRESETS["amazon-book"] if scale else convert.PRESETS["tiny"])
        stats = convert.Stats(**{k: (round(v * (scale or 1)) if k != "relations" else v) for k, v in preset.items()})
        t0 = time.perf_counter()
        tmp = out.with_name(f".{out.name}.tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        convert.write(convert.synthesize(stats, seed=0), tmp)
        shutil.rmtree(out, ignore_errors=True)
        tmp.rename(out)
        print(f"generated KGAT x{scale:g} ({stats.interactions:,} interactions, {stats.triples:,} triples) in "
              f"{time.perf_counter() - t0:.1f} s: {out}", flush=True)
    return out


def has_pandas() -> bool:
    return subprocess.run([sys.executable, "-c", "import pandas"], capture_output=True).returncode == 0


def measure(path: Path, work: Path, repeat: int, pandas: bool, train: bool = False, eval_users: int = 0) -> dict:
    cache = work / "cache"
    parquet = path.suffix == ".parquet"
    load = "kgat-load" if (path / "train.txt").exists() else "load"
    runs: dict[str, list[dict]] = {k: [] for k in ("pandas", "arrow", "cold_no_cache", "cold_build", "warm")}
    for _ in range(repeat):                               # interleaved: the machine's drift hits all alike
        if parquet:                                       # the bare reader of the format: pyarrow's
            runs["arrow"].append(probe("arrow", path, "off"))
        elif pandas:
            runs["pandas"].append(probe("pandas", path, "off"))
        runs["cold_no_cache"].append(probe(load, path, "off"))
        shutil.rmtree(cache, ignore_errors=True)
        runs["cold_build"].append(probe(load, path, str(cache)))
        runs["warm"].append(probe(load, path, str(cache)))
    out = {k: dict(s=statistics.median(r["s"] for r in v), rss_mb=statistics.median(r["rss_mb"] for r in v),
                   all_s=[r["s"] for r in v]) for k, v in runs.items() if v}
    child = [r["child_rss_mb"] for r in runs["cold_build"] if r.get("child_rss_mb")]
    if child:                                  # the parse ran in a child: the build's peak is the larger one
        out["cold_build"]["child_rss_mb"] = statistics.median(child)
        out["cold_build"]["rss_mb"] = max(out["cold_build"]["rss_mb"], out["cold_build"]["child_rss_mb"])
    out["rows"] = runs["warm"][0]["rows"]
    files = [f for f in path.rglob("*") if f.is_file()] if path.is_dir() else [path]
    out["file_mb"] = round(sum(f.stat().st_size for f in files) / 2**20, 1)
    out["cache_mb"] = round(sum(f.stat().st_size for f in cache.rglob("*.npy")) / 2**20, 1)
    out["two_ranks"] = two_ranks(path, str(cache))
    if load == "load" and not parquet:         # SASRec's training start from the warm cache (issue 88)
        starts = [warm_start(path, str(cache), work / "start") for _ in range(repeat)]
        out["warm_start"] = dict(s=statistics.median(r["s"] for r in starts),
                                 rss_mb=statistics.median(r["rss_mb"] for r in starts))
    if train:
        out["train"] = train_epoch(path, str(cache), work / "run", eval_users)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="2000000,20000000,100000000", help="interactions per u.data file (comma list)")
    ap.add_argument("--repeat", type=int, default=3, help="interleaved repeats of each probe (the median counts)")
    ap.add_argument("--data", default=str(REPO / "bench" / "results" / "data"), help="where the files are made")
    ap.add_argument("--out", default=str(REPO / "bench" / "results"))
    ap.add_argument("--parquet-sizes", default="100000000", help="interactions per Parquet file (\"\": none)")
    ap.add_argument("--kgat-scales", default="1,4", help="KGAT folders of amazon-book's size times these (\"\": none)")
    ap.add_argument("--no-train", action="store_true", help="leave out the training epoch and evaluation")
    ap.add_argument("--update", action="store_true", help="keep the sections of an earlier report this run leaves "
                    "out (e.g. --sizes '' --parquet-sizes '' --kgat-scales 1,4 adds the KGAT rows)")
    ap.add_argument("--eval-users", type=int, default=20000, help="users of the evaluation (full ranking included)")
    ap.add_argument("--history", default=str(REPO / "bench" / "results" / "data_scale_history.jsonl"),
                    help="per commit and size: the warm start's peak RSS and the cold build's time (JSON lines); "
                         "a change of more than 10%% against its last row is named")
    args = ap.parse_args(argv)
    folder, out = Path(args.data), Path(args.out)
    folder.mkdir(parents=True, exist_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    pandas = has_pandas()
    report = dict(date=time.strftime("%Y-%m-%d %H:%M"), cpus=os.cpu_count(), pandas=pandas, sizes={})
    earlier = json.loads((out / "data_scale.json").read_text()) if args.update and (out / "data_scale.json").exists() \
        else {}
    kgat_scales = [float(s) for s in args.kgat_scales.split(",") if s]
    kept = (() if args.sizes else ("sizes", "slope_per_million_rows")) + (() if args.parquet_sizes else ("parquet",)) \
        + (() if kgat_scales else ("kgat",)) + (() if args.sizes or args.parquet_sizes else ("tiny",))
    report.update({k: earlier[k] for k in kept if k in earlier})
    if args.sizes or args.parquet_sizes:
        report["tiny"] = measure(generate(100_000, folder), folder / "work-tiny", args.repeat, pandas)
    for rows in (int(s) for s in args.sizes.split(",") if s):
        path = generate(rows, folder)
        report["sizes"][str(rows)] = r = measure(path, folder / f"work-{rows}", args.repeat, pandas,
                                                 not args.no_train, args.eval_users)
        if pandas:
            r["cold_over_pandas"] = round(r["cold_no_cache"]["s"] / r["pandas"]["s"], 2)
        r["warm_minus_tiny_s"] = round(r["warm"]["s"] - report["tiny"]["warm"]["s"], 3)
        r["warm_rss_minus_tiny_mb"] = round(r["warm"]["rss_mb"] - report["tiny"]["warm"]["rss_mb"], 1)
        r["cold_rss_minus_tiny_mb"] = round(r["cold_build"]["rss_mb"] - report["tiny"]["cold_build"]["rss_mb"], 1)
        print(json.dumps({rows: r}), flush=True)
    parquet_sizes = [int(s) for s in args.parquet_sizes.split(",") if s]
    if parquet_sizes:
        report["parquet"] = {}
    for rows in parquet_sizes:
        path = generate(rows, folder, "parquet")
        report["parquet"][str(rows)] = r = measure(path, folder / f"work-pq-{rows}", args.repeat, pandas,
                                                   not args.no_train, args.eval_users)
        r["cold_over_arrow"] = round(r["cold_no_cache"]["s"] / r["arrow"]["s"], 2)
        r["warm_minus_tiny_s"] = round(r["warm"]["s"] - report["tiny"]["warm"]["s"], 3)
        r["warm_rss_minus_tiny_mb"] = round(r["warm"]["rss_mb"] - report["tiny"]["warm"]["rss_mb"], 1)
        r["cold_rss_minus_tiny_mb"] = round(r["cold_build"]["rss_mb"] - report["tiny"]["cold_build"]["rss_mb"], 1)
        print(json.dumps({f"parquet {rows}": r}), flush=True)
    if kgat_scales:                  # reading, cache and RSS (an epoch at 4x is out of reach on 2 cores)
        report["kgat"] = {"tiny": measure(generate_kgat(0, folder), folder / "work-kgat-tiny", args.repeat, False)}
    for scale in kgat_scales:
        r = report["kgat"][f"x{scale:g}"] = measure(generate_kgat(scale, folder), folder / f"work-kgat-x{scale:g}",
                                                    args.repeat, False)
        r["warm_minus_tiny_s"] = round(r["warm"]["s"] - report["kgat"]["tiny"]["warm"]["s"], 3)
        r["warm_rss_minus_tiny_mb"] = round(r["warm"]["rss_mb"] - report["kgat"]["tiny"]["warm"]["rss_mb"], 1)
        r["cold_rss_minus_tiny_mb"] = round(r["cold_build"]["rss_mb"] - report["kgat"]["tiny"]["cold_build"]["rss_mb"],
                                            1)
        print(json.dumps({f"kgat x{scale:g}": r}), flush=True)
    sizes = sorted(int(k) for k in report["sizes"])
    if len(sizes) >= 2 and args.sizes:    # cost per million rows between the two largest sizes: the slope
        a, b = report["sizes"][str(sizes[-2])], report["sizes"][str(sizes[-1])]
        per_m = (b["rows"] - a["rows"]) / 1e6
        report["slope_per_million_rows"] = {k: round((b[k]["s"] - a[k]["s"]) / per_m, 3)
                                            for k in ("cold_no_cache", "cold_build", "warm")}
        report["slope_per_million_rows"]["cold_rss_mb"] = round((b["cold_build"]["rss_mb"] - a["cold_build"]["rss_mb"])
                                                                / per_m, 1)
    if args.sizes:
        report["changes"] = record_history(report, Path(args.history))
        for line in report["changes"]:
            print(f"CHANGED: {line}", flush=True)
    (out / "data_scale.json").write_text(json.dumps(report, indent=1) + "\n")
    plot(report, out / "data_scale.png")
    print(f"wrote {out / 'data_scale.json'} and {out / 'data_scale.png'}")
    return 0


def plot(report: dict, png: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    sizes = sorted(int(k) for k in report["sizes"])
    rows = [report["sizes"][str(s)]["rows"] / 1e6 for s in sizes]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 3.8))
    for key, label in (("pandas", "bare pandas.read_csv"), ("cold_no_cache", "cold parse + build (no cache)"),
                       ("cold_build", "cold, into the cache"), ("warm", "warm start from the cache")):
        if all(key in report["sizes"][str(s)] for s in sizes):
            left.plot(rows, [report["sizes"][str(s)][key]["s"] for s in sizes], marker="o", label=label)
            right.plot(rows, [report["sizes"][str(s)][key]["rss_mb"] for s in sizes], marker="o", label=label)
    for key, label, marker in (("arrow", "Parquet: bare pyarrow read", "s"), ("cold_no_cache", "Parquet: cold", "^"),
                               ("warm", "Parquet: warm", "v")):
        pq = report.get("parquet", {})
        if pq:
            at = [pq[s]["rows"] / 1e6 for s in sorted(pq, key=int)]
            left.scatter(at, [pq[s][key]["s"] for s in sorted(pq, key=int)], marker=marker, label=label, color="k")
            right.scatter(at, [pq[s][key]["rss_mb"] for s in sorted(pq, key=int)], marker=marker, label=label,
                          color="k")
    kg = {k: v for k, v in report.get("kgat", {}).items() if k != "tiny"}
    for key, label, marker in (("cold_no_cache", "KGAT (amazon-book x1, x4): cold", "x"),
                               ("warm", "KGAT: warm", "+")):
        if kg:
            at = [v["rows"] / 1e6 for v in kg.values()]
            left.scatter(at, [v[key]["s"] for v in kg.values()], marker=marker, label=label, color="tab:red")
            right.scatter(at, [v[key]["rss_mb"] for v in kg.values()], marker=marker, label=label, color="tab:red")
    for ax, what in ((left, "seconds"), (right, "peak RSS of the process (MB)")):
        ax.set_xlabel("rows: interactions (KGAT: + triples), millions")
        ax.set_ylabel(what)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.legend(fontsize=7)
    fig.suptitle(f"Data at scale: SASRec (text, Parquet) and KGAT folders, {report['cpus']} CPUs, {report['date']}",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
