"""`python -m trainer doctor`: what the launcher, devices and collectives look like from every rank.

    srun -N2 --ntasks-per-node=2 python -m trainer doctor --json
"""
from __future__ import annotations

import ipaddress
import json
import os
import platform
import shutil
import socket
import subprocess
import time
from pathlib import Path

import torch

from trainer.config.settings import DistConfig
from trainer.distributed import runtime
from trainer.distributed.environment import LaunchError, select_environment
from trainer.engine.exits import exit_of

SLURM_VARS = ("SLURM_JOB_ID", "SLURM_JOB_NODELIST", "SLURM_STEP_NODELIST", "SLURM_NNODES", "SLURM_NTASKS",
              "SLURM_NTASKS_PER_NODE", "SLURM_TASKS_PER_NODE", "SLURM_PROCID", "SLURM_LOCALID", "SLURM_NODEID",
              "SLURM_CPUS_PER_TASK", "SLURM_GPUS_ON_NODE", "SLURM_GPUS_PER_TASK", "SLURM_RESTART_COUNT",
              "SLURMD_NODENAME", "CUDA_VISIBLE_DEVICES")


def versions() -> dict[str, str | None]:
    """Python, torch, CUDA, cuDNN and NCCL versions (and, inside the image, its base)."""
    nccl = None
    if torch.cuda.is_available():
        try:
            nccl = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception:  # NCCL missing from this build
            nccl = None
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    facts = dict(python=platform.python_version(), torch=torch.__version__, cuda=torch.version.cuda,
                 cudnn=str(cudnn) if cudnn else None, nccl=nccl, cuda_available=str(torch.cuda.is_available()))
    if os.environ.get("HPC_TRAINER_BASE_IMAGE"):       # inside the image: the base it was built on
        facts["image_base"] = os.environ["HPC_TRAINER_BASE_IMAGE"]
    return facts


def rank_facts(env, info) -> dict:
    """What one rank sees."""
    return dict(rank=info.rank, local_rank=info.local_rank, node_rank=info.node_rank, world_size=info.world_size,
                host=socket.gethostname(), slurmd_nodename=os.environ.get("SLURMD_NODENAME"),
                device=info.device, gpu=info.gpu, backend=info.backend, master_addr=env.master_addr,
                master_port=env.master_port, cuda_visible_devices=os.environ.get("CUDA_VISIBLE_DEVICES"),
                omp_num_threads=os.environ.get("OMP_NUM_THREADS"), pid=os.getpid(),
                cpus_bound=len(os.sched_getaffinity(0)))


def port_check(env) -> tuple[str, str | None]:
    """(what was checked, the problem or None), under every launcher. torchrun's agent already listens on
    MASTER_PORT, so every rank must reach it; elsewhere rank 0 must be able to bind it (a local run only
    needs it for a later torchrun/srun launch with the same port)."""
    port = env.master_port
    if env.needs_agreement:     # Lightning's shape: the processes meet on MASTER_PORT before any rank is known
        return f"rendezvous {env.master_addr}:{port} (the processes count each other there)", None
    if env.name == "torchrun":
        what = f"rendezvous store {env.master_addr}:{port} reachable"
        if port == 0:
            return what, None
        try:
            with socket.create_connection((env.master_addr, port), timeout=5):
                pass
        except OSError as err:
            return what, (f"the rendezvous store {env.master_addr}:{port} cannot be reached ({err.strerror})\n"
                          "HINT: the torchrun agent on the first node is gone or a firewall is in the way; "
                          "check --rdzv-endpoint / --master-addr and --master-port")
        return what, None
    what = f"MASTER_PORT {port} free on {socket.gethostname()}"
    if env.rank != 0:
        return what, None
    try:
        with socket.socket() as s:
            s.bind(("", port))
    except OSError as err:
        return what, (f"MASTER_PORT {port} on {socket.gethostname()} is in use ({err.strerror})\n"
                      "HINT: another job on this node holds it: export MASTER_PORT=<free port> (the default is "
                      "derived from SLURM_JOB_ID and the step id; torchrun needs --master-port)")
    return what, None


def allreduce_check(info, size_mb: float) -> dict:
    """Correctness (sum of rank+1) and algorithm bandwidth of a size_mb all_reduce."""
    dev = runtime.comm_device(info)
    x = torch.tensor([float(info.rank + 1)], device=dev)
    runtime.all_reduce(x, info)
    expected = info.world_size * (info.world_size + 1) / 2
    buf = torch.ones(max(int(size_mb * 2**20 / 4), 1), device=dev)
    runtime.all_reduce(buf, info)  # warm-up
    reps = 3
    runtime.barrier(info)
    t0 = time.perf_counter()
    for _ in range(reps):
        runtime.all_reduce(buf, info)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    dt = (time.perf_counter() - t0) / reps
    via = "shared memory" if runtime.local_comm() else info.backend
    return dict(allreduce_sum=x.item(), allreduce_expected=expected, allreduce_ok=x.item() == expected,
                bandwidth_gb_s=round(buf.numel() * 4 / dt / 1e9, 3), size_mb=size_mb, via=via,
                shm_off=runtime.shm.attach.why if info.distributed and not runtime.local_comm() else "")


def checks(env, facts: list[dict], ar: dict, port: tuple[str, str | None] | None = None) -> list[dict]:
    """Checks with a HINT each: the rendezvous port, scontrol, MASTER_ADDR, CPUs vs threads, all_reduce."""
    out = []

    def add(name, ok, detail, hint="", warn_only=False):
        level = "ok" if ok else ("warn" if warn_only else "fail")
        out.append(dict(check=name, ok=bool(ok), level=level, detail=detail, hint="" if ok else hint))

    if port is not None:
        what, problem = port
        first, _, hint = (problem or "").partition("\nHINT: ")
        add(what, problem is None, first or "ok", hint, warn_only=env.world_size == 1)

    if os.environ.get("SLURM_JOB_ID"):
        exe = shutil.which("scontrol")
        ok = exe is not None and subprocess.run([exe, "show", "job", os.environ["SLURM_JOB_ID"]],
                                                capture_output=True, timeout=30).returncode == 0
        add("scontrol reachable", ok, exe or "not on PATH",
            "requeue on preemption needs scontrol: bind-mount it (and slurm.conf, munge socket) into the container")
    addr = env.master_addr
    try:
        resolved = socket.gethostbyname(addr)
        nodes = len({f["node_rank"] for f in facts})
        loop_ok = nodes == 1 or not ipaddress.ip_address(resolved).is_loopback
        add("MASTER_ADDR resolves", True, f"{addr} -> {resolved}")
        add("MASTER_ADDR not loopback on multi-node", loop_ok, f"{nodes} node(s), {resolved}",
            "other nodes cannot reach a loopback address: fix /etc/hosts or set MASTER_ADDR to a routable "
            "name (fine only when every 'node' is this machine, as in the local test cluster)", warn_only=True)
    except OSError as err:
        add("MASTER_ADDR resolves", False, f"{addr}: {err}", "set MASTER_ADDR to a resolvable host name or IP")
    cpus, omp = os.environ.get("SLURM_CPUS_PER_TASK"), os.environ.get("OMP_NUM_THREADS")
    if cpus:
        add("OMP_NUM_THREADS <= CPUs per task", omp is not None and int(omp) <= int(cpus),
            f"SLURM_CPUS_PER_TASK={cpus} OMP_NUM_THREADS={omp}",
            f"export OMP_NUM_THREADS={cpus} (slurm/common.sh does) to avoid oversubscribing cores")
        usable = min(int(cpus), os.cpu_count() or 1)
        bound = min(f["cpus_bound"] for f in facts)
        add("tasks see their --cpus-per-task", bound >= usable, f"fewest CPUs bound to a task: {bound}, "
            f"--cpus-per-task={cpus}", "Slurm >= 22.05: srun no longer inherits --cpus-per-task; export "
            "SRUN_CPUS_PER_TASK=$SLURM_CPUS_PER_TASK before srun (slurm/common.sh does)")
    add("NCCL errors abort instead of hanging", os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3") != "0",
        f"TORCH_NCCL_ASYNC_ERROR_HANDLING={os.environ.get('TORCH_NCCL_ASYNC_ERROR_HANDLING', 'unset (3)')}",
        "unset TORCH_NCCL_ASYNC_ERROR_HANDLING=0: a failed collective should end the job, not hang it",
        warn_only=True)
    ifname = os.environ.get("NCCL_SOCKET_IFNAME")
    if ifname:
        names = {name for _, name in socket.if_nameindex()}
        wanted = [n for n in ifname.lstrip("^=").split(",") if n]
        ok = ifname.startswith("^") or any(any(have.startswith(w) for have in names) for w in wanted)
        add("NCCL_SOCKET_IFNAME names an interface", ok, f"{ifname} (interfaces: {', '.join(sorted(names))})",
            "NCCL waits for a network interface that does not exist: fix or unset NCCL_SOCKET_IFNAME")
    add("all_reduce correct", ar["allreduce_ok"], f"sum={ar['allreduce_sum']} expected={ar['allreduce_expected']}",
        "ranks disagree: check that every task joined the same process group (MASTER_ADDR/PORT)")
    return out


def render(report: dict) -> str:
    """Human-readable report."""
    lines = [f"launcher: {report['launcher']}   world size: {report['world_size']}",
             "versions: " + ", ".join(f"{k}={v}" for k, v in report["versions"].items()),
             f"{'rank':>4} {'local':>5} {'node':>4}  {'host/slurmd':<24} {'device':<8} master"]
    for f in report["ranks"]:
        host = f"{f['host']}/{f['slurmd_nodename'] or '-'}"
        lines.append(f"{f['rank']:>4} {f['local_rank']:>5} {f['node_rank']:>4}  {host:<24} {f['device']:<8} "
                     f"{f['master_addr']}:{f['master_port']}")
    lines.append("slurm: " + (", ".join(f"{k}={v}" for k, v in report["slurm"].items()) or "not in a job"))
    ar = report["allreduce"]
    speed = (f"{ar['bandwidth_gb_s']} GB/s for {ar['size_mb']} MB" if report["world_size"] > 1 else
             "no bandwidth: one process copies nothing (run it under srun or torchrun to measure the links)")
    lines.append(f"all_reduce via {ar['via']}: sum={ar['allreduce_sum']} (expected {ar['allreduce_expected']}), "
                 + speed + (f" (no shared memory: {ar['shm_off']})" if ar.get("shm_off") else ""))
    for c in report["checks"]:
        lines.append(f"[{c['level'].upper()}] {c['check']}: {c['detail']}"
                     + (f"\n       HINT: {c['hint']}" if c["hint"] else ""))
    return "\n".join(lines)


def data_report(run_dir: Path) -> str:
    """The data the run's newest checkpoint trained on (its fingerprint) against the files at data.path now."""
    from trainer.data import cache
    from trainer.data.fingerprint import fingerprint
    from trainer.engine.ckpt_io import CheckpointError, CheckpointFolder, load
    lines = []
    for path in CheckpointFolder(run_dir).candidates():
        try:
            ckpt = load(path)
            break
        except CheckpointError:         # a damaged one: the next one says it
            continue
    else:
        return "  data: no readable checkpoint"
    data = ckpt.get("data")
    if not data:
        return f"  data: {path.name} has no data fingerprint (written before fingerprints)"
    counts = ", ".join(f"{k} {v:,}" for k, v in data.get("counts", {}).items()) or "no counts"
    source = (ckpt.get("config", {}).get("data") or {}).get("path", "")
    lines.append(f"  data ({path.name}, step {ckpt.get('global_step')}): {counts}; "
                 f"{len(data.get('files', {}))} file(s) under {source or 'generated data'}")
    root, memo = Path(source) if source else None, None
    if (where := cache.root_of((ckpt.get("config", {}).get("data") or {}).get("cache", ""))) is not None:
        memo = where / "fingerprints"
    for name, f in sorted(data.get("files", {}).items()):
        now = (root / name if root.is_dir() else root) if root is not None else None
        if now is None or not now.is_file():
            state = "missing now"
        elif now.stat().st_size != f["size"]:
            state = f"changed: {f['size']:,} -> {now.stat().st_size:,} bytes"
        else:
            state = "unchanged" if fingerprint(now, memo) == f["sha256"] else "changed: same size, other content"
        lines.append(f"    {name}: {f['size']:,} bytes, sha256 {f['sha256'][:12]}: {state}")
    return "\n".join(lines)


def preflight_only(info) -> int:
    """`trainer doctor --preflight` (under srun: a whole allocation): the training run's pre-flight checks alone,
    every rank's figures; exit 5 where a host is unfit, as a training run would."""
    from trainer.distributed import preflight
    from trainer.launch.exitcodes import UNFIT_HOST
    try:
        verdict = preflight.run_checks(info, 0, torch.float32, slow=preflight.slow_fraction())
    finally:
        runtime.teardown(info)
    if info.is_main:
        print(preflight.render(verdict), flush=True)
    return UNFIT_HOST if verdict.unfit else 0


def preflight_report(run_dir: Path) -> str:
    """RUN_DIR/preflight.json (the last launch's pre-flight) as `doctor --run` shows it."""
    from trainer.distributed import preflight
    path = run_dir / preflight.REPORT
    if not path.is_file():
        return "  pre-flight: none recorded (a run of one CPU rank, or faults.preflight=off)"
    try:
        return "  " + preflight.render(preflight.read_report(path)).replace("\n", "\n  ")
    except (OSError, ValueError, KeyError, TypeError) as err:
        return f"  pre-flight: {path} unreadable ({err})"


def metrics_report(run_dir: Path) -> str:
    """metrics.jsonl's records, and each line that is not one, by file and line (a write cut off by a full disk)."""
    from trainer.engine.logging import read_lines
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return "  metrics: no metrics.jsonl"
    rows, damaged = read_lines(path.read_text(errors="replace"), path)
    lines = [f"  metrics: {len(rows)} records in {path}" + (f", {len(damaged)} damaged line(s) skipped:"
                                                              if damaged else "")]
    return "\n".join(lines + [f"    {d}" for d in damaged])


def straggler_report(run_dir: Path) -> str:
    """The stragglers metrics.jsonl's train records name (trainer/distributed/stragglers.py)."""
    from trainer.distributed import stragglers
    from trainer.engine.logging import read_metrics
    if not (run_dir / "metrics.jsonl").is_file():
        return "  stragglers: no metrics.jsonl"
    return stragglers.report(read_metrics(run_dir, "train"))


def run_doctor(args) -> int:
    if args.run:
        from trainer.launch.restarts import run_report
        print(run_report(Path(args.run)))
        if Path(args.run).is_dir():
            print(preflight_report(Path(args.run)))
            print(metrics_report(Path(args.run)))
            print(straggler_report(Path(args.run)))
            print(data_report(Path(args.run)))
        return 0
    env = select_environment()
    try:
        port = port_check(env)
        if port[1] and env.world_size > 1:      # the process group could not form: say why now
            print(f"doctor: [FAIL] {port[1]}")
            return 2
        info = runtime.init(env, DistConfig(timeout_s=args.timeout))
    except LaunchError as err:
        print(f"doctor: launch environment is inconsistent:\n{err}")
        return exit_of(err).code            # trainer/engine/exits.py: a usage error
    if args.preflight:
        return preflight_only(info)
    try:
        facts = runtime.all_gather_object(rank_facts(env, info), info)
        ar = allreduce_check(info, args.bandwidth_mb)
        report = dict(launcher=env.name, world_size=info.world_size, ranks=facts, allreduce=ar,
                      versions=versions(), slurm={k: os.environ[k] for k in SLURM_VARS if k in os.environ})
        report["checks"] = checks(env, facts, ar, port if info.is_main else None)
        if info.is_main:
            print(json.dumps(report) if args.json else render(report), flush=True)
    finally:
        runtime.teardown(info)
    return 0 if all(c["level"] != "fail" for c in report["checks"]) else 1
