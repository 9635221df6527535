"""The first build of the CPU kernels, as one module or as one module per owner (issue 56 point 4): a cold build
of each (a fresh cache, the native target, what a first run or `make setup` waits for), interleaved and repeated.

    python -m bench.kernel_build                    # 2 repeats -> bench/results/kernel_build.{json,png}
    python -m bench.kernel_build --repeats 3

One module: every *_kernels.inc under trainer/recipes/ in one translation unit (what trainer/recipes/kernels.py
builds). One per owner: a module per folder holding kernel headers (sasrec/, kgat/, and trainer/recipes/ itself for
the shared dropout), each a translation unit of its own; `make setup` builds them one after the other, and a run
builds only its recipe's. Each build runs in a child process of its own, with its own empty cache.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from trainer.recipes import kernels

REPO = Path(__file__).resolve().parents[1]

BUILD = """
import sys, time
from trainer.native import extensions as native
from trainer.recipes import kernels
headers = [kernels.ROOT / h for h in sys.argv[2:]]
ext = native.Extension(sys.argv[1], None, kernels.CFLAGS, ["-fopenmp"], what=sys.argv[1], fallback="-",
                       off_env="BENCH_KERNELS", depends=lambda: sorted(kernels.ROOT.rglob("*.h")),
                       include_dirs=(kernels.ROOT,), generate=lambda: kernels.module_source(headers))
t0 = time.monotonic()
module = ext.build()
print("BUILT", round(time.monotonic() - t0, 2), sum(not n.startswith("_") for n in dir(module)))
"""


def arms() -> dict[str, dict[str, list[str]]]:
    """{arm: {module: its headers, relative to the root}}."""
    headers = [h.relative_to(kernels.ROOT).as_posix() for h in kernels.kernel_fragments()]
    owners: dict[str, list[str]] = {}
    for h in headers:
        owners.setdefault(h.split("/")[0] if "/" in h else "shared", []).append(h)
    return {"one module": {"all": headers}, "one per owner": owners}


def build(name: str, headers: list[str]) -> dict:
    with tempfile.TemporaryDirectory(prefix="bench-kernels-") as cache:
        env = dict(os.environ, TRAINER_EXTENSIONS_DIR=cache)
        t0 = time.monotonic()
        proc = subprocess.run([sys.executable, "-c", BUILD, f"bench_kernels_{name}", *headers], cwd=REPO, env=env,
                              capture_output=True, text=True)
        wall = time.monotonic() - t0
    if proc.returncode != 0 or "BUILT" not in proc.stdout:
        raise SystemExit(f"bench.kernel_build: the {name} build failed:\n{proc.stderr[-3000:]}")
    build_s, functions = proc.stdout.split("BUILT")[1].split()[:2]
    return dict(module=name, headers=headers, build_s=float(build_s), wall_s=round(wall, 2), functions=int(functions))


def draw(result: dict, png: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6.5, 3.5))
    labels, x = [], 0
    for arm, modules in result["arms"].items():
        for module, times in modules.items():
            ax.scatter([x] * len(times), times, color="C0" if arm == "one module" else "C1", alpha=0.8)
            labels.append(f"{arm}:\n{module}")
            x += 1
        total = result["summary"][arm]["total_median_s"]
        ax.hlines(total, x - len(modules) - 0.3, x - 0.7, color="grey", linestyles="dotted")
    ax.set_xticks(range(len(labels)), labels, fontsize=8)
    ax.set_ylabel("cold build, s (dotted: the arm's total)")
    ax.set_title("first build of the CPU kernels: one module vs one per owner")
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "kernel_build.json"))
    args = ap.parse_args(argv)
    plan = arms()
    times: dict[str, dict[str, list[float]]] = {arm: {m: [] for m in modules} for arm, modules in plan.items()}
    runs = []
    for rep in range(args.repeats):
        for arm, modules in plan.items():           # interleaved: both arms in each repeat
            for module, headers in modules.items():
                run = dict(arm=arm, repeat=rep, **build(module, headers))
                times[arm][module].append(run["build_s"])
                runs.append(run)
                print(json.dumps(run), flush=True)
    summary = {}
    for arm, modules in times.items():
        totals = [sum(modules[m][r] for m in modules) for r in range(args.repeats)]
        summary[arm] = dict(total_median_s=round(statistics.median(totals), 1), totals_s=totals,
                            per_module_median_s={m: round(statistics.median(t), 1) for m, t in modules.items()})
    result = dict(date=time.strftime("%Y-%m-%d %H:%M"), cpus=os.cpu_count(), repeats=args.repeats, arms=times,
                  summary=summary, runs=runs)
    out = Path(args.out)
    out.write_text(json.dumps(result, indent=1) + "\n")
    draw(result, out.with_suffix(".png"))
    for arm, row in summary.items():
        print(f"{arm}: {row['total_median_s']} s in all ({row['per_module_median_s']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
