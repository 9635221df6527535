"""The harness's summary: two Markdown tables (throughput and scaling; where the step time goes) and a PNG."""
from __future__ import annotations

from pathlib import Path

COSTS = (("machine_sharing", "machine sharing"), ("sync_wait", "waiting in collectives"), ("other", "other"))


def _f(value, fmt: str = "{:.2f}") -> str:
    return "" if value is None else fmt.format(value)


def _pct(value) -> str:
    return _f(None if value is None else 100 * value, "{:.1f}%")


def _spread(rep: dict | None) -> str:
    return "" if not rep else f"{rep['median']:.3f} ({rep['paired_min']:.2f}-{rep['paired_max']:.2f})"


def tables(rows: list[dict]) -> str:
    w = max((r["world"] for r in rows), default=2)
    head = [f"| recipe | params | samples/s, 1 rank | samples/s, DDP {w} ranks (torchrun) | scaling efficiency | "
            "from the repeats' medians (paired range) | "
            f"{w} independent processes: efficiency (medians) | samples/s, srun {w} nodes x 1 task | srun efficiency | "
            "srun / torchrun |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        head.append(f"| {r['recipe']} | {r.get('params', '')} | {_f(r.get('samples_per_s_1'), '{:.1f}')} | "
                    f"{_f(r.get('samples_per_s_ddp'), '{:.1f}')} | {_f(r.get('efficiency_ddp'), '**{:.3f}**')} | "
                    f"{_spread(r.get('efficiency_ddp_repeats'))} | "
                    f"{_f(r.get('efficiency_independent'), '{:.3f}')}"
                    f"{_f((r.get('efficiency_independent_repeats') or {}).get('median'), ' ({:.3f})')} | "
                    f"{_f(r.get('samples_per_s_slurm'), '{:.1f}')} | "
                    f"{_f(r.get('efficiency_slurm'), '{:.3f}')} | {_f(r.get('slurm_vs_torchrun'), '{:.3f}')} |")
    cost = ["", f"Where the {w}-rank step time beyond one rank's goes (shares of the {w}-rank step; they add up to "
            "1 - efficiency), and the single-rank figures:", "",
            "| recipe | machine sharing | waiting in collectives (ms / step; the gradient all-reduce alone) | other | "
            "step median / p90 s (1 rank) | "
            f"loader wait 1 / {w} ranks | peak RSS MB | eval s | first step done after s: 1 rank / torchrun / srun | "
            "1 rank alone, run to run: fastest / slowest repeat |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        c = r.get("costs", {})
        cost.append(f"| {r['recipe']} | {_pct(c.get('machine_sharing'))} | {_pct(c.get('sync_wait'))} "
                    f"({_f(r.get('sync_wait_ms'))}; {_f(r.get('allreduce_alone_ms'))}) | {_pct(c.get('other'))} | "
                    f"{_f(r.get('step_time_median_s'), '{:.4f}')} / {_f(r.get('step_time_p90_s'), '{:.4f}')} | "
                    f"{_pct(r.get('data_wait_frac'))} / {_pct(r.get('data_wait_frac_ddp'))} | "
                    f"{_f(r.get('peak_rss_mb'), '{:.0f}')} | {_f(r.get('eval_time_s'), '{:.3f}')} | "
                    f"{_f(r.get('first_step_s_1'), '{:.1f}')} / {_f(r.get('first_step_s_ddp'), '{:.1f}')} / "
                    f"{_f(r.get('first_step_s_slurm'), '{:.1f}')} | {_f(r.get('single_rank_spread'), '{:.2f}x')} |")
    return "\n".join(head + cost + _extra_table(rows, w))


def _extra_table(rows: list[dict], w: int) -> list[str]:
    """DDP's own cost, phase by phase: the DDP step against the independent processes' (same machine sharing)."""
    out = ["", f"What a {w}-rank DDP step spends beyond {w} independent processes' steps, ms per step by phase "
           "(they add up to the difference; the backward holds DDP's gradient all-reduce waits):", "",
           "| recipe | forward | backward | rest (optimizer, loop) | DDP step - independent step | "
           "waiting in collectives | the step's collectives alone |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        x = r.get("ddp_extra_ms")
        if not x:
            continue
        out.append(f"| {r['recipe']} | {x['forward']:+.2f} | {x['backward']:+.2f} | {x['rest']:+.2f} | "
                   f"{sum(x.values()):+.2f} | {_f(r.get('sync_wait_ms'))} | {_f(r.get('collectives_alone_ms'))} |")
    return out


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    names = [r["recipe"] for r in rows]
    x = np.arange(len(rows))
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.2))
    for i, (key, label) in enumerate((("efficiency_ddp", "DDP, torchrun"), ("efficiency_slurm", "DDP, srun"),
                                      ("efficiency_independent", "independent processes"))):
        vals = [r.get(key) or 0.0 for r in rows]
        bars = left.bar(x + (i - 1) * 0.27, vals, 0.27, label=label, color=f"C{i}")
        left.bar_label(bars, labels=[f"{v:.2f}" if v else "" for v in vals], fontsize=7)
    left.axhline(0.9, ls="--", c="gray", lw=1, label="target 0.9")
    top = max([r.get(k) or 0.0 for r in rows for k in ("efficiency_ddp", "efficiency_slurm", "efficiency_independent")]
              + [1.0])
    left.set_xticks(x, names), left.set_ylim(0, top + 0.3), left.legend(fontsize=8, ncol=2)
    left.set_ylabel("throughput(2) / (2 x throughput(1))"), left.set_title("Scaling on CPU, gloo, 1 thread per rank")
    for i, (key, label) in enumerate(COSTS):          # side by side: noise can make a share negative
        vals = [r.get("costs", {}).get(key, 0.0) for r in rows]
        right.bar(x + (i - 1) * 0.27, vals, 0.27, label=label, color=f"C{i + 3}")
    right.scatter(x, [1 - (r.get("efficiency_ddp") or 1.0) for r in rows], marker="_", s=900, c="black", zorder=3,
                  label="1 - efficiency (their sum)")
    right.axhline(0, c="black", lw=0.8)
    right.set_xticks(x, names), right.legend(fontsize=8)
    right.set_ylabel("share of the 2-rank step time"), right.set_title("Where 1 - efficiency goes (DDP, torchrun)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
