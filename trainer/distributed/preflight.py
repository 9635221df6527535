"""Pre-flight: before the first step, each rank checks its device and the group checks its links, so that a
slow or broken host is named before it costs a run (faults.preflight=auto|on|off; auto: a world of more than one
rank, or a GPU).

    verdict = run_checks(info, need_bytes=fp.total, dtype=torch.bfloat16)   # every rank, collectively
    verdict.summary()            # one line; verdict.unfit: the hosts below the rule, with why
    write_report(run_dir, verdict)                                           # RUN_DIR/preflight.json

Per rank: a matmul at the training dtype (GFLOP/s, the best of REPEATS), the free memory against the model's
estimate (trainer/engine/footprint.py), a small allocation written and read back. Per host and for the group:
an all-reduce of a fixed buffer, timed to bus bandwidth (2 (n-1)/n x bytes / time: the ring's traffic per rank),
among the ranks of each host and across all of them; each rank's time to join the process group. Between hosts:
each host's first rank exchanges a buffer with the next host's in a ring, every link at once within a round (2
rounds, 3 for an odd number of hosts: the time does not grow with the hosts), so a slow link is timed on its own.

Unfit (the run stops with exit 5, trainer/launch/exitcodes.py, naming the host; the restart loop leaves it out at
once): a failed check; a host whose matmul or host-local all-reduce falls below the slow fraction (SLOW_FRACTION,
0.5, unless faults.preflight_slow or TRAINER_PREFLIGHT_SLOW says otherwise) of the other hosts' median; a host both of
whose ring links fall below it of the median of the links it is not on (three hosts or more: with two, the one link
has no end to blame); a GPU below it of its own host's other GPUs
(the host is left out: srun leaves out nodes, not devices, and the layout of the relaunch stays whole). Noted, not
unfit: a single slow link whose ends are otherwise fine (a cable or a switch port), a host that joined late.
"""
from __future__ import annotations

import json
import logging
import os
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from trainer.distributed import runtime
from trainer.distributed.runtime import DistInfo
from trainer.launch.exitcodes import host_name

log = logging.getLogger(__name__)

SLOW_FRACTION = 0.5        # a host below half the others' median is slow (this machine's noise: 1.2-1.5x)
SLOW_ENV = "TRAINER_PREFLIGHT_SLOW"   # a site's own fraction (nodes shared with other work: lower), below train's
REPEATS = 5                # timed all-reduces; the best counts (the least disturbed)
WINDOWS, WINDOW_S = 3, 0.1     # the matmul's: the median of 3 windows of 0.1 s
CONFIRM = 3                # a host found slow is measured again (matmul and host all-reduce, every rank), best counts
CONFIRM_PAUSE_S = 1.0      # before each round: a load spike of a second or two passes (CI, 2026-11-29: 0.45x, 3 rounds
                           # back to back in 1.4 s, all inside one spike)
MATMUL_N = {"cuda": 4096, "cpu": 256}
BUFFER_BYTES = 8 * 2**20   # the all-reduce's buffer
ALLOC_BYTES = 64 * 2**20   # the small allocation
LINK_BYTES = 8 * 2**20     # exchanged both ways over each link between hosts
LINK_REPEATS = 2           # timed exchanges per link (after one untimed); the best counts
JOIN_LATE_S = 30.0         # a host whose ranks reached the group this much after the others' is noted
REPORT = "preflight.json"


@dataclass
class RankFigures:
    rank: int
    host: str
    device: str
    join_s: float = 0.0                 # init_process_group's time on this rank
    gflops: float = 0.0                 # the matmul's rate at the training dtype
    free_bytes: int = 0
    need_bytes: int = 0
    host_busbw_gbs: float | None = None  # the all-reduce among this host's ranks (None: alone on its host)
    failed: list[str] = field(default_factory=list)


@dataclass
class LinkFigures:
    a: str                              # the hosts at its ends (their first ranks exchanged)
    b: str
    gbs: float                          # GB/s each way, both ways at once


@dataclass
class Verdict:
    ranks: list[RankFigures]
    group_busbw_gbs: float | None
    seconds: float
    unfit: dict[str, str]               # host -> why
    links: list[LinkFigures] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)      # found, not a reason to leave a host out
    slow_fraction: float = SLOW_FRACTION                # the rule it was judged by (slow_fraction())

    def summary(self) -> str:
        hosts = sorted({r.host for r in self.ranks})
        rates = [r.gflops for r in self.ranks]
        bw = f"; all-reduce {self.group_busbw_gbs:.2f} GB/s bus across the group" if self.group_busbw_gbs else ""
        if self.links:
            speeds = [link.gbs for link in self.links]
            bw += f"; {len(speeds)} link(s) between hosts {min(speeds):.2f}-{max(speeds):.2f} GB/s"
        verdict = "; UNFIT: " + "; ".join(f"{h}: {why}" for h, why in self.unfit.items()) if self.unfit else "; ok"
        notes = "".join(f"; note: {n}" for n in self.notes)
        if self.slow_fraction != SLOW_FRACTION:
            verdict += f" (a host below {self.slow_fraction:g}x the others' median is slow)"
        return (f"pre-flight: {len(self.ranks)} rank(s) on {len(hosts)} host(s) in {self.seconds:.1f} s; matmul "
                f"{min(rates):.1f}-{max(rates):.1f} GFLOP/s per rank{bw}{verdict}{notes}")


def matmul_gflops(device: torch.device, dtype: torch.dtype) -> float:
    """Sustained square-matmul rate on the device: the median of WINDOWS windows of WINDOW_S seconds each (after a
    warm-up), each counting the products it finished. Sustained, not the best single product: a product takes
    under a millisecond, less than a scheduler's time slice, so the best one would not see a host whose cores
    are shared (or a GPU that throttles as it warms)."""
    n = MATMUL_N["cuda" if device.type == "cuda" else "cpu"]
    if device.type == "cpu" and dtype not in (torch.float32, torch.float64):
        dtype = torch.float32            # the CPU path trains fp32 where bf16 autocast is off
    # its own generator: the run's random streams (restored from a checkpoint just before) stay untouched
    gen = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, device=device, dtype=dtype, generator=gen)
    b = torch.randn(n, n, device=device, dtype=dtype, generator=gen)
    out = torch.empty(n, n, device=device, dtype=dtype)
    torch.mm(a, b, out=out)
    rates = []
    for _ in range(WINDOWS):
        done, t0 = 0, time.perf_counter()
        while True:
            for _ in range(4):
                torch.mm(a, b, out=out)
            done += 4
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            took = time.perf_counter() - t0
            if took >= WINDOW_S:
                break
        rates.append(2 * n ** 3 * done / took / 1e9)
    return statistics.median(rates)


def allocation_ok(device: torch.device) -> str | None:
    """None, or why a small allocation written and read back failed."""
    try:
        x = torch.full((ALLOC_BYTES // 4,), 3.0, device=device)
        if float(x.sum()) != 3.0 * x.numel():
            return "a 64 MiB buffer read back other values"
    except RuntimeError as err:
        return f"a 64 MiB allocation failed: {str(err).splitlines()[0][:200]}"
    return None


def busbw_gbs(info: DistInfo, group, size: int) -> float:
    """Bus bandwidth of an all-reduce of BUFFER_BYTES over `group` (size ranks): the best of REPEATS."""
    device = runtime.comm_device(info)
    buf = torch.ones(BUFFER_BYTES // 4, device=device)
    best = float("inf")
    for k in range(REPEATS + 1):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        dist.all_reduce(buf, group=group)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if k:
            best = min(best, time.perf_counter() - t0)
    return 2 * (size - 1) / size * BUFFER_BYTES / best / 1e9


def ring_rounds(n: int) -> list[list[tuple[int, int]]]:
    """The links (i, i+1 mod n) of a ring of n hosts, in rounds where no host is on two links: two rounds, a third
    for the closing link of an odd ring; one link for two hosts, none for one."""
    if n < 2:
        return []
    if n == 2:
        return [[(0, 1)]]
    links = [(i, (i + 1) % n) for i in range(n)]
    even = links[:n - n % 2]
    rounds = [[link for k, link in enumerate(even) if k % 2 == colour] for colour in (0, 1)]
    return rounds + ([[links[-1]]] if n % 2 else [])


def link_figures(info: DistInfo, hosts: list[str]) -> list[LinkFigures]:
    """Each host's first rank exchanges LINK_BYTES both ways with the next host's first rank, one round of
    ring_rounds at a time (every link of a round at once); collective: every rank must call it."""
    leaders: dict[str, int] = {}
    for rank, host in enumerate(hosts):
        leaders.setdefault(host, rank)
    order = list(leaders)
    device = runtime.comm_device(info)
    send = torch.ones(LINK_BYTES // 4, device=device)
    recv = torch.empty_like(send)
    mine: dict[tuple[int, int], float] = {}
    for links in ring_rounds(len(order)):
        dist.barrier()
        for i, j in links:
            a, b = leaders[order[i]], leaders[order[j]]
            if info.rank in (a, b):
                mine[(i, j)] = _exchange(send, recv, b if info.rank == a else a, device)
    seen = runtime.all_gather_object(mine, info)
    figures = []
    for i, j in sorted({link for ends in seen for link in ends}):
        took = max(ends[(i, j)] for ends in seen if (i, j) in ends)       # both ends done
        figures.append(LinkFigures(order[i], order[j], round(LINK_BYTES / took / 1e9, 3)))
    return figures


def _exchange(send: torch.Tensor, recv: torch.Tensor, peer: int, device: torch.device) -> float:
    """Seconds of the best of LINK_REPEATS exchanges (a send and a receive at once) with `peer`."""
    best = float("inf")
    for k in range(LINK_REPEATS + 1):
        t0 = time.perf_counter()
        for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, send, peer), dist.P2POp(dist.irecv, recv, peer)]):
            work.wait()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if k:
            best = min(best, time.perf_counter() - t0)
    return best


def slow_fraction(setting: float = 0.0) -> float:
    """The fraction of the other hosts' median below which a host is slow: faults.preflight_slow where set, else the
    site's TRAINER_PREFLIGHT_SLOW, else SLOW_FRACTION. Where nodes are shared with other work (oversubscribed CPU
    nodes, the local test cluster's two nodes on one machine's cores beside the rest of the suite: 0.39x and 0.45x
    seen for seconds on end, CI 2026-11-29) a site judges looser; a slow host for real is 0.05x or less."""
    from trainer.config.settings import ConfigError
    if setting:
        return setting
    raw = os.environ.get(SLOW_ENV, "").strip()
    if not raw:
        return SLOW_FRACTION
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not 0 < value < 1:
        raise ConfigError(f"{SLOW_ENV}={raw!r} (environment): a fraction above 0 and below 1, the share of the other "
                          f"hosts' median below which a host is unfit; unset it for {SLOW_FRACTION}, or set "
                          f"faults.preflight_slow")
    return value


def run_checks(info: DistInfo, need_bytes: int, dtype: torch.dtype, free_bytes: int | None = None,
               slow: float = SLOW_FRACTION) -> Verdict:
    """Every rank: its own checks, then the links' (collective: every rank must call it); SLOW: slow_fraction()."""
    from trainer.native.memory import free_memory
    t0 = time.perf_counter()
    device = info.torch_device
    me = RankFigures(rank=info.rank, host=host_name(), device=str(device), join_s=round(info.join_s, 3),
                     need_bytes=int(need_bytes))
    if info.distributed:
        dist.barrier()                  # every rank measures at the same time: they share the hosts' cores
    me.gflops, why = _matmul(device, dtype)
    if why:
        me.failed.append(why)
    free, _, sharing = free_memory(info)
    me.free_bytes = int(free if free_bytes is None else free_bytes)
    if need_bytes * sharing > me.free_bytes:
        me.failed.append(f"{need_bytes * sharing / 2**30:.1f} GiB needed, {me.free_bytes / 2**30:.1f} GiB free")
    if (why := allocation_ok(device)) is not None:
        me.failed.append(why)
    group_bw, host_bw, hosts = None, (lambda: None), [me.host]
    links: list[LinkFigures] = []
    if info.distributed:
        hosts = runtime.all_gather_object(me.host, info)
        by_host: dict[str, list[int]] = {}
        for rank, host in enumerate(hosts):
            by_host.setdefault(host, []).append(rank)
        # every rank takes part in making every host's group (new_group is collective)
        groups = {h: dist.new_group(ranks) for h, ranks in sorted(by_host.items())}
        mine = by_host[me.host]

        def host_bw() -> float | None:
            return round(busbw_gbs(info, groups[me.host], len(mine)), 3) if len(mine) > 1 else None
        me.host_busbw_gbs = host_bw()
        links = link_figures(info, hosts)
        dist.barrier()
        group_bw = round(busbw_gbs(info, None, info.world_size), 3)
    ranks = [RankFigures(**r) for r in runtime.all_gather_object(asdict(me), info)]
    unfit, notes = judge(ranks, links, slow)
    for _ in range(CONFIRM):
        # a host found slow is measured again, every figure on every rank, and each keeps its best round: a load
        # spike on a shared machine passes, a slow host stays slow (a failed check is not measured again)
        if all(why.startswith("rank ") for why in unfit.values()):
            break
        time.sleep(CONFIRM_PAUSE_S)
        if info.distributed:
            dist.barrier()
        again = runtime.all_gather_object((_matmul(device, dtype)[0], host_bw()), info)
        for r in ranks:
            rate, bw = again[r.rank]
            r.gflops = max(r.gflops, rate)
            if bw is not None:
                r.host_busbw_gbs = max(r.host_busbw_gbs or 0.0, bw)
        if links:
            for link, other in zip(links, link_figures(info, hosts)):
                link.gbs = max(link.gbs, other.gbs)
        unfit, notes = judge(ranks, links, slow)
    return Verdict(ranks, group_bw, round(time.perf_counter() - t0, 2), unfit, links, notes, slow)


def _matmul(device: torch.device, dtype: torch.dtype) -> tuple[float, str | None]:
    """(GFLOP/s, None), or (0, why) where the product failed (every rank goes on to the collectives)."""
    try:
        return round(matmul_gflops(device, dtype), 2), None
    except RuntimeError as err:
        return 0.0, f"matmul failed: {str(err).splitlines()[0][:200]}"


def judge(ranks: list[RankFigures], links: list[LinkFigures] = (),
          slow: float = SLOW_FRACTION) -> tuple[dict[str, str], list[str]]:
    """(the unfit hosts with why, notes): a failed check; a host's matmul (host_rate) or host-local
    all-reduce below SLOW (slow_fraction()) of the other hosts' median (two hosts or more); a GPU below SLOW of its
    host's other GPUs; a host both of whose links are slow (judge_links). Notes: a slow link alone, a late host."""
    unfit: dict[str, str] = {}
    for r in ranks:
        if r.failed:
            unfit.setdefault(r.host, f"rank {r.rank}: {'; '.join(r.failed)}")
    hosts = sorted({r.host for r in ranks})
    for h in hosts:
        why = _slow_gpu([r for r in ranks if r.host == h], slow)
        if why and h not in unfit:
            unfit[h] = why
    if len(hosts) >= 2:
        for name, value in (("matmul", host_rate),
                            ("all-reduce among its ranks", lambda rs: min((r.host_busbw_gbs for r in rs
                                                                          if r.host_busbw_gbs), default=None))):
            per_host = {h: value([r for r in ranks if r.host == h]) for h in hosts}
            if sum(1 for v in per_host.values() if v) < 2:
                continue
            for h, v in per_host.items():
                median = _median([w for g, w in per_host.items() if g != h and w])
                if v and median and v < slow * median and h not in unfit:
                    unit = "GFLOP/s" if name == "matmul" else "GB/s"
                    unfit[h] = f"{name} {v:.2f} {unit}, {v / median:.2f}x the other hosts' median {median:.2f}"
    slow_hosts, notes = judge_links(list(links), slow)
    for h, why in slow_hosts.items():
        unfit.setdefault(h, why)
    return unfit, notes + late_hosts(ranks)


def host_rate(host_ranks: list[RankFigures]) -> float:
    """A host's matmul rate: its slowest GPU (the step waits for it), or its CPU ranks' median: they share the host's
    cores, so one rank the scheduler put aside for a moment says nothing of the host (CI, 2026-11-28: a two-node job
    beside the rest of the suite on 2 cores lost a host to its slowest rank's figure)."""
    gpus = [r.gflops for r in host_ranks if r.device.startswith("cuda")]
    return min(gpus) if gpus else statistics.median(r.gflops for r in host_ranks)


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _slow_gpu(host_ranks: list[RankFigures], fraction: float = SLOW_FRACTION) -> str | None:
    """Why a host's slowest GPU makes it unfit: below FRACTION of the median of the host's other GPUs. GPUs
    only: a CPU host's ranks share its cores and memory, so their rates differ by where the scheduler put them."""
    gpus = [r for r in host_ranks if r.device.startswith("cuda") and r.gflops > 0]
    if len(gpus) < 2:
        return None
    slow = min(gpus, key=lambda r: r.gflops)
    median = _median([r.gflops for r in gpus if r is not slow])
    if slow.gflops >= fraction * median:
        return None
    return (f"GPU {slow.device} (rank {slow.rank}): matmul {slow.gflops:.2f} GFLOP/s, {slow.gflops / median:.2f}x "
            f"the median {median:.2f} of this host's other GPUs")


def judge_links(links: list[LinkFigures], slow: float = SLOW_FRACTION) -> tuple[dict[str, str], list[str]]:
    """(hosts both of whose links are below SLOW of the median of the links they are not on, notes on
    slow links with no host to blame). Two hosts have one link and no reference: nothing is judged."""
    hosts = sorted({h for link in links for h in (link.a, link.b)})
    unfit: dict[str, str] = {}
    if len(hosts) < 3:
        return unfit, []
    for h in hosts:
        on = [link for link in links if h in (link.a, link.b)]
        median = _median([link.gbs for link in links if h not in (link.a, link.b)])
        if on and median and all(link.gbs < slow * median for link in on):
            unfit[h] = ("links " + ", ".join(f"to {link.b if link.a == h else link.a} {link.gbs:.2f} GB/s"
                                              for link in on)
                        + f": {max(link.gbs for link in on) / median:.2f}x or less the median {median:.2f} of the "
                          f"links it is not on")
    notes = []
    for link in links:
        median = _median([other.gbs for other in links if other is not link])
        if link.a not in unfit and link.b not in unfit and median and link.gbs < slow * median:
            notes.append(f"the link {link.a}-{link.b} is slow ({link.gbs:.2f} GB/s, {link.gbs / median:.2f}x the "
                         f"others' median) while its ends' other links are not: a cable or a switch port?")
    return unfit, notes


def late_hosts(ranks: list[RankFigures]) -> list[str]:
    """Hosts that reached the group JOIN_LATE_S or more after the others. Every rank leaves init_process_group at
    about the same moment, so a rank's join time says how long it waited: the late rank's is the shortest (no
    clocks compared). Noted, not unfit: a late start (a container pulled, a slow file system) costs once."""
    notes = []
    for h in sorted({r.host for r in ranks}):
        others = _median([r.join_s for r in ranks if r.host != h])
        latest = min(r.join_s for r in ranks if r.host == h)
        if others is not None and others - latest >= JOIN_LATE_S:
            notes.append(f"{h} joined the group {others - latest:.0f} s after the other hosts' ranks (a slow start: "
                         f"image, file system, or a node still busy?)")
    return notes


def write_report(run_dir: str | Path, verdict: Verdict) -> Path:
    path = Path(run_dir) / REPORT
    body = dict(time=round(time.time(), 3), seconds=verdict.seconds, slow_fraction=verdict.slow_fraction,
                group_busbw_gbs=verdict.group_busbw_gbs, unfit=verdict.unfit, notes=verdict.notes,
                links=[asdict(link) for link in verdict.links], ranks=[asdict(r) for r in verdict.ranks])
    tmp = path.with_name(f".{REPORT}.{os.getpid()}")
    tmp.write_text(json.dumps(body, indent=1) + "\n")
    tmp.replace(path)
    return path


def wanted(setting: str, info: DistInfo) -> bool:
    """faults.preflight: on, off, or auto (a world of more than one rank, or a GPU)."""
    return setting == "on" or setting == "auto" and (info.distributed or info.device.startswith("cuda"))


def read_report(path: Path) -> Verdict:
    body = json.loads(Path(path).read_text())
    return Verdict([RankFigures(**r) for r in body["ranks"]], body.get("group_busbw_gbs"), body.get("seconds", 0.0),
                   body.get("unfit", {}), [LinkFigures(**link) for link in body.get("links", [])],
                   body.get("notes", []), body.get("slow_fraction", SLOW_FRACTION))


def render(verdict: Verdict) -> str:
    """The summary line, then one line per rank."""
    lines = [verdict.summary()]
    for r in verdict.ranks:
        bw = f", host all-reduce {r.host_busbw_gbs:.2f} GB/s" if r.host_busbw_gbs else ""
        lines.append(f"  rank {r.rank} on {r.host} ({r.device}): matmul {r.gflops:.1f} GFLOP/s, joined in "
                     f"{r.join_s:.2f} s, {r.free_bytes / 2**30:.1f} GiB free for {r.need_bytes / 2**20:.1f} MiB"
                     f"{bw}" + (f"; FAILED: {'; '.join(r.failed)}" if r.failed else ""))
    lines += [f"  link {link.a}-{link.b}: {link.gbs:.2f} GB/s each way" for link in verdict.links]
    return "\n".join(lines)
