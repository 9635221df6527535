"""The benchmark harness's arithmetic, kept free of I/O so it can be tested on synthetic timings.

    stats = step_stats(train_records, warmup=5)        # per-step records of metrics.jsonl (log_every_steps=1)
    scaling_efficiency(throughput_2, 2, throughput_1)  # 1.0 = perfect linear scaling
    cost_shares(t1, t2, t_shared, sync_wait_s)         # where the step time beyond t1 goes
    repeat_efficiency(ones, twos, 2)                   # from the medians; the paired repeats' range
    phase_extra_ms(ddp_stats, independent_stats)       # DDP's extra ms per step: forward, backward, rest
"""
from __future__ import annotations

import math
import statistics
from typing import Iterable


def percentile(values: Iterable[float], q: float) -> float:
    """The q-th percentile (0-100) with linear interpolation between order statistics (numpy's default)."""
    xs = sorted(float(v) for v in values)
    if not xs:
        raise ValueError("percentile of no values")
    if not 0 <= q <= 100:
        raise ValueError(f"percentile q={q} is outside 0..100")
    pos = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def step_stats(records: list[dict], warmup: int) -> dict[str, float]:
    """Throughput and step-time statistics from one-step training records after `warmup` steps.

    Each record holds samples_per_s (all ranks), step_time_s and data_wait_frac of one optimizer step, so a
    step's samples are samples_per_s x step_time_s and its loader wait data_wait_frac x step_time_s; the
    totals are summed, not the rates averaged (a slow step weighs what it costs)."""
    steps = [r for r in records if "step_time_s" in r and "samples_per_s" in r][warmup:]
    if not steps:
        raise ValueError(f"no training steps after a warm-up of {warmup} (got {len(records)} records)")
    times = [r["step_time_s"] for r in steps]
    total = sum(times)
    samples = sum(r["samples_per_s"] * r["step_time_s"] for r in steps)
    waited = sum(r.get("data_wait_frac", 0.0) * r["step_time_s"] for r in steps)
    synced = sum(r.get("sync_wait_frac", 0.0) * r["step_time_s"] for r in steps)
    phases = {f"{p}_s": sum(r[f"{p}_frac"] * r["step_time_s"] for r in steps) / len(steps)
              for p in PHASES if all(f"{p}_frac" in r for r in steps)}
    return dict(steps=len(steps), samples_per_s=samples / total, step_time_mean_s=total / len(steps),
                step_time_median_s=percentile(times, 50),
                step_time_p90_s=percentile(times, 90), data_wait_frac=waited / total, sync_wait_frac=synced / total,
                peak_rss_mb=max((r.get("rss_mb", 0.0) for r in records), default=0.0),
                peak_gpu_mem_mb=max((r.get("gpu_mem_mb", 0.0) for r in records), default=0.0), **phases)


PHASES = ("forward", "backward")      # timed per step with log.measure_sync; the rest is optimizer + loop


def phase_extra_ms(ddp: dict, alone: dict) -> dict[str, float] | None:
    """What a DDP step spends beyond as many independent processes sharing the machine (no communication),
    per phase, in ms per step: forward (DDP's pre-forward), backward (with the gradient all-reduce waits in
    it), rest (optimizer, the loop's per-step agreement, logging). They add up to the step time difference.
    None where a run lacks the phase times."""
    keys = [f"{p}_s" for p in PHASES]
    if not all(k in ddp and k in alone for k in keys):
        return None
    out = {p: 1000 * (ddp[k] - alone[k]) for p, k in zip(PHASES, keys)}
    rest = [r["step_time_mean_s"] - sum(r[k] for k in keys) for r in (ddp, alone)]
    out["rest"] = 1000 * (rest[0] - rest[1])
    return out


def scaling_efficiency(throughput: float, world: int, single: float) -> float:
    """throughput(world) / (world x throughput(1)) for the same per-rank batch."""
    if world < 1 or single <= 0:
        raise ValueError(f"scaling efficiency needs world >= 1 and a positive single-rank throughput "
                         f"(world={world}, single={single})")
    return throughput / (world * single)


def repeat_efficiency(single: list[float], many: list[float], world: int) -> dict[str, float]:
    """Scaling efficiency from every repeat, not only the fastest: from the median throughputs, and the range
    over each world-size repeat paired with the single-rank repeat run just before it (the repeats are
    interleaved, so a pair shares the machine's state). On a shared VM the best-of figure alone can flip."""
    pairs = [scaling_efficiency(m, world, s) for s, m in zip(single, many)]
    if not pairs:
        raise ValueError("repeat_efficiency needs at least one repeat of each")
    return dict(median=scaling_efficiency(statistics.median(many), world, statistics.median(single)),
                paired_min=min(pairs), paired_max=max(pairs))


def cost_shares(t1: float, tw: float, t_shared: float, sync_wait_s: float) -> dict[str, float]:
    """Where a distributed step's time tw goes beyond the single-rank step time t1, as shares of tw.

    With the same per-rank batch, scaling efficiency = t1 / tw, so 1 - efficiency = (tw - t1) / tw splits into
    machine_sharing (t_shared: the step time of as many independent single-rank processes running at once, no
    communication), sync_wait (the step's measured time in collectives: DDP's gradient all-reduce and the
    loop's per-step agreement, each including the wait for the slowest rank) and other (the rest: DDP's
    bookkeeping, noise); the three sum to 1 - t1 / tw."""
    if min(t1, tw, t_shared) <= 0 or sync_wait_s < 0:
        raise ValueError(f"step times must be positive (t1={t1}, tw={tw}, t_shared={t_shared}, "
                         f"sync_wait_s={sync_wait_s})")
    sharing, sync = (t_shared - t1) / tw, sync_wait_s / tw
    return dict(machine_sharing=sharing, sync_wait=sync, other=(tw - t1) / tw - sharing - sync)
