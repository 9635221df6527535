"""In-allocation restarts: whether slurm/common.sh's loop relaunches a failed training step, the record of each
relaunch (RUN_DIR/restarts.jsonl) and the failure summary (also `trainer doctor --run RUN_DIR`).

    python -m trainer.launch.restarts decide --run-dir runs/123 --rc 137 --attempt 0 --max 2 \\
        --attempt-start 1764160000 --job-start 1764159000 --end-time 1764166000 --nodes "node1 node2" --tasks-per-node 2
    python -m trainer.launch.restarts summary runs/123

`decide` prints one line for the shell: `relaunch [HOST,...]` (the hosts to leave out) or `stop`; what it decided
and why goes to stderr and, relaunch or stop, to restarts.jsonl. The batch shell runs it with the tasks' own Python
(inside the image when there is one), so it reads only files: squeue's end time comes in as --end-time.
"""
from __future__ import annotations

import argparse
import json
import re
import shlex
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from trainer.launch.exitcodes import EXITS_DIR, NEVER_RETRIED, PREEMPTED_MARKER, RUNNING, unfit_hosts

RESTARTS = "restarts.jsonl"
PERIODIC = re.compile(r"^step-(\d+)\.pt$")
TAIL_LINES = 20
SIMULTANEOUS_S = 0.2     # ranks that failed within this long of the first are all named as its cause
# what a rank says when it lost a peer (the shared-memory all-reduce, gloo, NCCL) or was ended by srun: not a cause
# while another rank says something else
LOST_PEER = re.compile(r"has exited|closed by peer|connection reset|broken pipe|remote process exited|"
                       r"SIGTERM|terminated", re.IGNORECASE)
HOST_FAILURES = 2        # a host that failed this often in one allocation is left out of the next relaunch
HUNG = re.compile(r"hang: rank (\d+) ")


@dataclass
class Failure:
    """What ended one attempt: the ranks to blame, their hosts, codes and causes."""

    ranks: list[int] = field(default_factory=list)
    hosts: list[str] = field(default_factory=list)      # each rank's
    codes: list[int | None] = field(default_factory=list)
    cause: str = ""
    kinds: set[str] = field(default_factory=set)
    time: float | None = None


def attempt_records(run_dir: Path, job: str, requeue: int, attempt: int) -> list[dict]:
    """The exit records (trainer/launch/exitcodes.py) this attempt's ranks left; older attempts' are ignored."""
    found = []
    for path in sorted((run_dir / EXITS_DIR).glob("rank-*.json")):
        try:
            rec = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if (str(rec.get("job", "")), rec.get("requeue", 0), rec.get("attempt", 0)) == (job, requeue, attempt):
            found.append(rec)
    return found


def failure_of(records: list[dict], rc: int) -> Failure:
    """Blame: a rank that died without an exit record (killed by a signal: SIGKILL, the OOM killer, a lost node)
    before any other; else the first to exit with an error of its own. The others were ended by srun
    --kill-on-bad-exit or lost their peer in a collective, and say so (LOST_PEER)."""
    kinds = {r["kind"] for r in records}
    silent = [r for r in records if r["kind"] == RUNNING]
    failed = [r for r in records if r["kind"] not in (RUNNING, "done")]
    hangs = sorted((r for r in failed if r["kind"] == "hang"), key=lambda r: r["time"])
    if hangs:       # every watch that told applied one rule to the same heartbeats: the first one's verdict is theirs
        first = hangs[0]
        if not HUNG.match(first["cause"]):      # "hang: the group made no progress ...": no single rank to blame
            return Failure(cause=first["cause"], kinds=kinds, time=first["time"])
        hung = int(HUNG.match(first["cause"]).group(1))
        named = [r for r in records if r["rank"] == hung] or [first]
        return Failure([r["rank"] for r in named], [r["host"] for r in named], [r["code"] for r in named],
                       first["cause"], kinds, first["time"])
    if silent:
        blamed = silent
        cause = "killed by a signal without an exit record (SIGKILL, the OOM killer or a lost node)"
        # when it died is not recorded: the others' exits (srun ended them at once) are the nearest figure
        at = min((r["time"] for r in failed), default=None)
    elif failed:
        causes = [r for r in failed if not LOST_PEER.search(r["cause"])] or failed
        first = min(r["time"] for r in causes)
        blamed = [r for r in causes if r["time"] - first <= SIMULTANEOUS_S]
        cause, at = blamed[0]["cause"], first
    else:
        return Failure(cause=f"srun exited {rc} and no rank recorded its exit (a task that failed to launch, or "
                             f"died before it opened the run directory)", kinds=kinds)
    blamed.sort(key=lambda r: r["rank"])
    return Failure([r["rank"] for r in blamed], [r["host"] for r in blamed], [r["code"] for r in blamed],
                   cause, kinds, at)


def log_tail(run_dir: Path, rank: int | None, job_log: str | None) -> list[str]:
    """The last lines the failing rank wrote: its srun task file, its own train log, rank 0's, else the job's."""
    names = [f"task-{rank}.out", f"train.rank{rank}.log"] if rank is not None else []
    candidates = [run_dir / n for n in names] + ([Path(job_log)] if job_log else []) + [run_dir / "train.log"]
    for path in candidates:
        if path.is_file():
            with open(path, "rb") as fh:
                fh.seek(max(0, path.stat().st_size - 64_000))
                lines = fh.read().decode("utf-8", "replace").splitlines()
            return [f"{path.name}: {line}" for line in lines[-TAIL_LINES:]]
    return []


def checkpoint_steps(run_dir: Path, since: float = 0.0) -> list[tuple[int, float]]:
    """(step, mtime) of the periodic checkpoints written at or after `since`, oldest first."""
    found = []
    for path in (run_dir / "checkpoints").glob("step-*.pt"):
        match = PERIODIC.match(path.name)
        if match:
            try:
                found.append((int(match.group(1)), path.stat().st_mtime))
            except OSError:
                continue
    return sorted(item for item in found if item[1] >= since)


def last_train_step(run_dir: Path, since: float) -> int | None:
    """The highest training step metrics.jsonl recorded at or after `since`."""
    steps = [r["step"] for r in read_jsonl(run_dir / "metrics.jsonl") if r.get("split") == "train"
             and r.get("time", 0) >= since]
    return max(steps) if steps else None


def read_jsonl(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    out = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue            # a line cut short by the crash itself
    return out


def own_batch_plan(run_dir: Path) -> bool | None:
    """Whether the run's recipe draws batches from its own plan (then a smaller world does not resume exactly:
    trainer/engine/resume.py); None when config.yaml is missing."""
    import yaml

    from trainer.config.registry import get_spec
    try:
        return get_spec(yaml.safe_load((run_dir / "config.yaml").read_text())["recipe"]).own_batch_plan
    except Exception as err:     # noqa: BLE001 - a missing file or plugin means "not known": the job stops
        print(f"restart loop: cannot tell whether the recipe resumes exactly on a smaller world: {err}",
              file=sys.stderr)
        return None


@dataclass
class Attempt:
    """The loop's facts about the attempt that just ended (from the batch shell)."""

    run_dir: Path
    rc: int
    attempt: int
    max_restarts: int
    attempt_start: float
    job_start: float
    end_time: float | None
    nodes: list[str]
    tasks_per_node: int
    excluded: list[str]
    job: str
    requeue: int
    job_log: str | None = None
    stop: str = ""           # the batch shell's own reason not to relaunch (the time-limit warning came)


def time_needed(a: Attempt, now: float) -> float:
    """How long a relaunch needs before it saves anything: for the first, the time since the job started; after
    that, how long the attempt that just failed took to write its first checkpoint (all of it, if it wrote none)."""
    if a.attempt == 0:
        return now - a.job_start
    written = checkpoint_steps(a.run_dir, a.attempt_start)
    return (written[0][1] if written else now) - a.attempt_start


def allocation_entries(a: Attempt) -> list[dict]:
    """This allocation's relaunches so far (a Slurm requeue starts the count again)."""
    return [r for r in read_jsonl(a.run_dir / RESTARTS) if str(r.get("job")) == a.job
            and r.get("requeue", 0) == a.requeue and r.get("decision") == "relaunch"]


def decide(a: Attempt, now: float | None = None) -> tuple[str, list[str], dict]:
    """("relaunch", hosts to leave out, the record) or ("stop", [], the record) for the attempt that failed."""
    now = time.time() if now is None else now
    f = failure_of(attempt_records(a.run_dir, a.job, a.requeue, a.attempt), a.rc)
    done = allocation_entries(a)
    need = time_needed(a, now)
    resumed = checkpoint_steps(a.run_dir)
    last = last_train_step(a.run_dir, a.attempt_start)
    record = dict(time=round(now, 3), job=a.job, requeue=a.requeue, attempt=a.attempt, restart=len(done) + 1,
                  max_restarts=a.max_restarts, rc=a.rc, ranks=f.ranks, hosts=f.hosts, codes=f.codes, cause=f.cause,
                  failed_at=f.time, attempt_start=a.attempt_start, attempt_seconds=round(now - a.attempt_start, 3),
                  checkpoint_step=resumed[-1][0] if resumed else 0, last_logged_step=last,
                  log_tail=log_tail(a.run_dir, f.ranks[0] if f.ranks else None, a.job_log), excluded=list(a.excluded),
                  time_left=None if a.end_time is None else round(a.end_time - now, 1),
                  time_needed=round(need, 1))
    stop = why_stop(a, f, len(done), now, need)
    exclude = [] if stop else hosts_to_leave_out(a, f, done)
    if isinstance(exclude, str):
        stop, exclude = exclude, []
    record.update(decision="stop" if stop else "relaunch", reason=stop or "retryable failure",
                  excluded=sorted({*a.excluded, *exclude}))
    with open(a.run_dir / RESTARTS, "a") as fh:      # a stop too: `doctor --run` says why the run ended
        fh.write(json.dumps(record) + "\n")
    return ("stop", [], record) if stop else ("relaunch", record["excluded"], record)


def why_stop(a: Attempt, f: Failure, done: int, now: float, need: float) -> str:
    """The reason not to relaunch, or "" to relaunch (need: time_needed)."""
    if a.stop:
        return a.stop
    never = {code: kind for code, kind in NEVER_RETRIED.items() if kind in f.kinds or code == a.rc}
    if never:
        code = min(never)
        if never[code] == "pruned":
            return f"pruned by the search's pruner (exit {code}): the study ended this trial, not retried"
        return f"{never[code]} error (exit {code}): it would fail the same way again, not retried"
    if (a.run_dir / PREEMPTED_MARKER).exists() or "preempted" in f.kinds:
        return "preempted after an agreed checkpoint: Slurm requeues the job, not this loop"
    if a.max_restarts <= 0:
        return "MAX_RESTARTS=0: relaunching is off"
    if done >= a.max_restarts:
        return f"{done} of MAX_RESTARTS={a.max_restarts} relaunches used in this allocation"
    if a.end_time is not None and a.end_time - now < need:
        return (f"{a.end_time - now:.0f} s left in the allocation, fewer than the {need:.0f} s a relaunch needs "
                f"to reach its first checkpoint")
    return ""


def hosts_to_leave_out(a: Attempt, f: Failure, done: list[dict]) -> list[str] | str:
    """Hosts that failed HOST_FAILURES times in this allocation (counting this failure), or at once those the
    pre-flight found unfit (exit 5, named in the cause); a str when one must be left out and the run cannot go
    on without it. A pre-flight failure blames the hosts it names, not every rank's."""
    unfit = sorted(h for h in set(unfit_hosts(f.cause)) if h not in a.excluded)
    counts: dict[str, int] = {}
    for r in [*done, dict(hosts=f.hosts, cause=f.cause)]:
        for host in set(unfit_hosts(r.get("cause", "")) or r.get("hosts", [])):
            counts[host] = counts.get(host, 0) + 1
    bad = unfit or sorted(h for h, n in counts.items() if n >= HOST_FAILURES and h not in a.excluded)
    why = ("was a straggler" if f.cause.startswith("straggler") else "failed the pre-flight") if unfit else \
        f"failed {HOST_FAILURES} times"
    if not bad:
        return []
    left = [n for n in a.nodes if n not in a.excluded and n not in bad]
    if not left:
        return f"host {', '.join(bad)} {why} and the allocation has no other node"
    # before the first checkpoint any recipe may start on fewer ranks; after it, only one that resumes exactly
    plan = own_batch_plan(a.run_dir) if checkpoint_steps(a.run_dir) or not unfit else False
    if plan is not False:
        return (f"host {', '.join(bad)} {why}; without it the world shrinks, and this run's recipe does not "
                f"resume exactly on a smaller world (its own batch plan)")
    return bad


def summary(run_dir: Path) -> str:
    """Every relaunch of the run: how many, which ranks and hosts, why, the steps recomputed and the seconds lost
    (from the failure to training again), and why the loop stopped if it did. Empty when nothing failed."""
    entries = read_jsonl(run_dir / RESTARTS)
    if not entries:
        return ""
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    relaunched = [e for e in entries if e.get("decision") == "relaunch"]
    lines = [f"{len(relaunched)} relaunch(es) in {run_dir}:"]
    for e in entries:
        where = ", ".join(f"rank {r} on {h}" for r, h in zip(e["ranks"], e["hosts"])) or "no rank recorded"
        failure = f"{where}, srun exit {e['rc']}: {e['cause']}"
        if e.get("decision") != "relaunch":
            lines.append(f"  stopped (job {e['job']}, requeue {e['requeue']}, attempt {e['attempt']}): {failure}")
            lines.append(f"    not relaunched: {e['reason']}")
            continue
        back = next((r["time"] for r in metrics if r.get("split") == "train" and r.get("time", 0) > e["time"]), None)
        failed = e.get("failed_at") or e["time"]
        lost = f"{back - failed:.1f} s from the failure to training again" if back else "did not train again"
        redo = (e["last_logged_step"] - e["checkpoint_step"]) if e.get("last_logged_step") is not None else None
        lines.append(f"  relaunch {e['restart']} of {e['max_restarts']} (job {e['job']}, requeue {e['requeue']}): "
                     f"{failure}")
        lines.append(f"    resumed from step {e['checkpoint_step']}; "
                     f"{'?' if redo is None else max(redo, 0)} step(s) recomputed; {lost}"
                     + (f"; left out: {', '.join(e['excluded'])}" if e.get("excluded") else ""))
    return "\n".join(lines)


def run_report(run_dir: Path) -> str:
    """`trainer doctor --run RUN_DIR`: how the run ended (each rank's last exit record), and its relaunches."""
    if not run_dir.is_dir():
        return f"{run_dir}: no such run directory"
    lines = [f"run directory {run_dir}"]
    final = run_dir / "checkpoints" / "final.pt"
    lines.append(f"  final checkpoint: {'yes' if final.is_file() else 'no'}; newest periodic checkpoint: step "
                 f"{(checkpoint_steps(run_dir) or [(0, 0)])[-1][0]}")
    for path in sorted((run_dir / EXITS_DIR).glob("rank-*.json"), key=lambda p: int(p.stem.split("-")[-1])):
        try:
            r = json.loads(path.read_text())
        except (OSError, ValueError) as err:
            lines.append(f"  {path.name}: unreadable ({err})")
            continue
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(r["time"]))
        what = "died without an exit record" if r["kind"] == RUNNING else f"exit {r['code']} ({r['kind']})"
        lines.append(f"  rank {r['rank']} on {r['host']}: {what} at {when}, job {r.get('job') or '-'} requeue "
                     f"{r.get('requeue', 0)} attempt {r.get('attempt', 0)}: {r['cause'][:300]}")
    if not (run_dir / EXITS_DIR).is_dir():
        lines.append("  no exit records (a run of an older version, or one that never started training)")
    lines.append(summary(run_dir) or "  no relaunches")
    lines.append(next_step(run_dir, final.is_file()))
    return "\n".join(lines)


def next_step(run_dir: Path, finished: bool) -> str:
    """What to run next: eval a finished run; continue an unfinished one from its newest checkpoint."""
    q = shlex.quote(str(run_dir))
    if finished:
        return f"  next: python -m trainer eval --checkpoint {q}    # or predict --checkpoint {q} --out FILE"
    step = (checkpoint_steps(run_dir) or [(0, 0)])[-1][0]
    where = f"from step {step}" if step else "from the start: no checkpoint was written"
    config = f" --config {shlex.quote(str(run_dir / 'config.yaml'))}" if (run_dir / "config.yaml").is_file() else ""
    return (f"  next: continue it ({where}) with the same launch and --resume auto, e.g. python -m trainer "
            f"train{config} --run-dir {q} --resume auto")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m trainer.launch.restarts", allow_abbrev=False)
    sub = p.add_subparsers(dest="command", required=True)
    d = sub.add_parser("decide", allow_abbrev=False, help="relaunch or stop after a failed training step")
    d.add_argument("--run-dir", required=True, type=Path)
    for name in ("--rc", "--attempt", "--max", "--tasks-per-node", "--requeue"):
        d.add_argument(name, type=int, required=name not in ("--requeue",), default=0)
    for name in ("--attempt-start", "--job-start"):
        d.add_argument(name, type=float, required=True)
    d.add_argument("--end-time", default="", help="seconds since the epoch; empty: no time limit")
    d.add_argument("--nodes", default="", help="the allocation's hosts, space-separated")
    d.add_argument("--excluded", default="", help="hosts already left out, space-separated")
    d.add_argument("--job", default="")
    d.add_argument("--job-log", default=None)
    d.add_argument("--stop", default="", help="stop with this reason (the batch shell's)")
    s = sub.add_parser("summary", allow_abbrev=False, help="the relaunches of a run directory")
    s.add_argument("run_dir", type=Path)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.command == "summary":
        text = summary(args.run_dir)
        print(text or f"no relaunches recorded in {args.run_dir}")
        return 0
    a = Attempt(args.run_dir, args.rc, args.attempt, args.max, args.attempt_start, args.job_start,
                float(args.end_time) if args.end_time else None, args.nodes.split(), args.tasks_per_node,
                args.excluded.split(), args.job, args.requeue, args.job_log, args.stop)
    verdict, exclude, record = decide(a)
    where = ", ".join(f"rank {r} on {h}" for r, h in zip(record["ranks"], record["hosts"]))
    print(f"restart loop: attempt {a.attempt} failed (srun exit {a.rc}; {where or 'no rank recorded'}): "
          f"{record['cause']}", file=sys.stderr)
    print(f"restart loop: {verdict}: {record['reason']}"
          + (f" (relaunch {record['restart']} of {a.max_restarts})" if verdict == "relaunch" else ""), file=sys.stderr)
    print(" ".join([verdict, ",".join(exclude)]).strip())
    return 0


if __name__ == "__main__":
    sys.exit(main())
