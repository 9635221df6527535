"""Process-group set-up and teardown: a launch environment in, a frozen DistInfo out.

    info = runtime.init(select_environment(), cfg.dist)   # then pass `info` around; no rank globals
"""
from __future__ import annotations

import datetime
import gc
import logging
import os
import time
from dataclasses import dataclass
from typing import Any, Iterable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from trainer.distributed import shm
from trainer.distributed.binding import exchange_and_assign, visible_ids
from trainer.distributed.environment import LaunchEnvironment, LaunchError

log = logging.getLogger(__name__)
_TEARDOWN_KEY = "trainer/teardown"
# like the process group: one per process, set by init: the shared-memory all-reduce, and a gloo group for
# host values where the default group is NCCL's
_local: dict[str, Any] = {"comm": None, "host_group": None}


@dataclass(frozen=True)
class DistInfo:
    """Where this process sits, fixed for the whole run."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    node_rank: int = 0
    device: str = "cpu"
    backend: str = "none"
    launcher: str = "local"
    local_world_size: int = 1
    job_id: str | None = None
    step_id: str | None = None        # the Slurm job step (srun) this rank runs in; None outside one
    requeue_id: str | None = None     # the Slurm job rank 0 requeues after a signal checkpoint (None: none)
    dp_devices: tuple[int, ...] = ()  # --strategy dp: the CUDA devices DataParallel spreads each batch over
    restart_count: int = 0            # how often the scheduler restarted this job (SLURM_RESTART_COUNT)
    can_requeue: bool = False         # a requeue follows a signal checkpoint (scontrol requeue or submitit)
    preempt_signal: str | None = None  # the launcher's own "checkpoint and requeue" signal (submitit's)
    agent_signals: tuple[str, ...] | None = None  # what a launcher agent (torchrun) forwards to this rank
    agent_shutdown_s: float | None = None  # and how long after forwarding one it SIGKILLs the rank
    gpu: str | None = None            # the allocated GPU this rank drives, as CUDA_VISIBLE_DEVICES names it
                                      # (set for fake gres too, where CUDA is absent and device is the CPU)
    join_s: float = 0.0               # this rank's time in init_process_group (the pre-flight reports it)

    @property
    def is_main(self) -> bool:
        """Rank 0 writes logs and checkpoints."""
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        """True when a process group with more than one rank exists."""
        return self.world_size > 1

    @property
    def replicas(self) -> int:
        """GPUs this process's batch is spread over (DataParallel); --batch-size is per GPU under dp as
        under ddp (the seed's rule), and lr scaling counts them."""
        return len(self.dp_devices) if len(self.dp_devices) >= 2 else 1

    @property
    def torch_device(self) -> torch.device:
        """The device as a torch.device."""
        return torch.device(self.device)


def dp_device_ids(gpu_ids: list[int], device_count: int, visible: str | None = None) -> tuple[int, ...]:
    """The devices of --strategy dp: --gpu-ids (checked against the visible devices) or all of them;
    () without CUDA (the caller falls back to one device with a warning)."""
    if device_count <= 0:
        return ()
    ids = list(gpu_ids) or list(range(device_count))
    where = f" (CUDA_VISIBLE_DEVICES={visible})" if visible is not None else ""
    bad = [i for i in ids if not 0 <= i < device_count]
    if bad:
        raise LaunchError(f"--gpu-ids {','.join(map(str, ids))}: {device_count} CUDA device(s) are visible{where}, "
                          f"ids 0..{device_count - 1}; {','.join(map(str, bad))} is not one of them.\n"
                          f"HINT: ids count the visible devices from 0 (after CUDA_VISIBLE_DEVICES).")
    if len(set(ids)) != len(ids):
        raise LaunchError(f"--gpu-ids {','.join(map(str, ids))}: a device is listed twice")
    return tuple(ids)


def choose_backend(requested: str, device: str) -> str:
    """NCCL when this process drives a CUDA device, else gloo; an explicit request wins."""
    if requested and requested != "auto":
        return requested
    return "nccl" if device.startswith("cuda") else "gloo"


def attempt_store(env: dict, world: int, timeout: float):
    """Under torchrun's agent store: a client of it whose keys carry the restart count. torch's env:// takes the
    agent's store as is, and a group restarted after a worker died (--max-restarts, static rendezvous with a fixed
    --master-port) then read the dead group's gloo addresses: its ranks retried connecting to them until the
    timeout. None elsewhere and on the first launch (env:// as before: with TORCH_DISTRIBUTED_DEBUG=DETAIL, DDP's
    wrapper group crashed on a store passed in)."""
    if env.get("TORCHELASTIC_USE_AGENT_STORE") != str(True) or int(env.get("TORCHELASTIC_RESTART_COUNT") or 0) == 0:
        return None
    client = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), world, is_master=False,
                           timeout=datetime.timedelta(seconds=timeout))
    return dist.PrefixStore(f"trainer/attempt_{env['TORCHELASTIC_RESTART_COUNT']}/", client)


def init(env: LaunchEnvironment, dist_cfg: Any) -> DistInfo:
    """Validate the environment, create the process group (world > 1 only) and bind the device: under
    ddp the ranks of a node agree through the rendezvous store on who drives which visible GPU."""
    strategy = getattr(dist_cfg, "strategy", "ddp")
    timeout = float(getattr(dist_cfg, "timeout_s", 1800))
    met = None
    if env.needs_agreement:          # Lightning's launcher gives no RANK: the processes count each other first
        env, met = env.agree(timeout)
    env.validate(strategy)
    cuda = torch.cuda.is_available()
    ids = visible_ids(env.env, torch.cuda.device_count() if cuda else 0)
    if ids and not cuda:
        log.warning("%d GPU(s) allocated (CUDA_VISIBLE_DEVICES=%s) but CUDA is not usable here: "
                    "running on CPU with gloo", len(ids), env.env.get("CUDA_VISIBLE_DEVICES"))
    on_gpu = cuda and bool(ids)
    world, backend, join_s = env.world_size, "none", 0.0
    if world > 1:
        backend = choose_backend(getattr(dist_cfg, "backend", "auto"), "cuda" if on_gpu else "cpu")
        log.debug("init_process_group(%s, %s, rank=%d, world=%d)", backend, env.init_method, env.rank, world)
        store = met or attempt_store(env.env, world, timeout)
        where = dict(store=store) if store is not None else dict(init_method=env.init_method)
        joining = time.perf_counter()
        dist.init_process_group(backend, rank=env.rank, world_size=world, timeout=datetime.timedelta(seconds=timeout),
                                **where)
        join_s = time.perf_counter() - joining
    # ranks may share a GPU only where gloo was asked for (dist.backend=gloo): gloo chosen because CUDA is not usable
    # here must still refuse a layout that NCCL would refuse on the GPU node the user is preparing for
    share = getattr(dist_cfg, "backend", "auto") == "gloo"
    index = _bind(env, ids, timeout, share=share) if world > 1 and strategy == "ddp" else 0
    device = f"cuda:{index}" if on_gpu else "cpu"
    dp_devices: tuple[int, ...] = ()
    if strategy == "dp" and on_gpu:
        dp_devices = dp_device_ids(list(getattr(dist_cfg, "gpu_ids", [])), torch.cuda.device_count(),
                                   env.env.get("CUDA_VISIBLE_DEVICES"))
        index = dp_devices[0]
        device = f"cuda:{index}"      # DataParallel wants the module on device_ids[0]
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    info = DistInfo(rank=env.rank, local_rank=env.local_rank, world_size=world, node_rank=env.node_rank,
                    device=device, backend=backend, launcher=env.name,
                    local_world_size=env.local_world_size, job_id=env.job_id, step_id=env.step_id,
                    requeue_id=env.requeue_id,
                    restart_count=env.restart_count, can_requeue=env.can_requeue,
                    preempt_signal=env.preempt_signal, agent_signals=env.agent_signals,
                    agent_shutdown_s=env.agent_shutdown_s, gpu=ids[index] if index < len(ids) else None,
                    dp_devices=dp_devices, join_s=join_s)
    if world > 1 and backend != "gloo":
        _local["host_group"] = host_group(timeout)
    try:
        attach_local(info, getattr(dist_cfg, "shm_allreduce", "auto"), timeout)
    except LaunchError:
        dist.destroy_process_group()
        raise
    return info


def attach_local(info: DistInfo, mode: str = "auto", timeout_s: float = 1800.0) -> shm.ShmComm | None:
    """Set up the shared-memory all-reduce for this process group (init does; a script that forms its own
    group calls it after init_process_group); every rank must call it."""
    _local["comm"] = shm.attach(info, mode, timeout_s)
    return _local["comm"]


def host_group(timeout_s: float = 1800.0):
    """A gloo group over every rank (a collective call: every rank makes it, in the same order), for values
    that live on the host: agreeing on them over NCCL meant a copy to the GPU and a read back, a host sync."""
    return dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))


def local_comm() -> shm.ShmComm | None:
    """The shared-memory all-reduce of this process group (gloo, every rank on one host), else None."""
    return _local["comm"]


def _bind(env: LaunchEnvironment, ids: list[str], timeout_s: float, share: bool = False) -> int:
    """This rank's index into its visible GPUs, agreed with the node's other ranks (binding.py); on a
    layout DDP cannot use, every rank leaves the process group and raises the same LaunchError. `share`
    (gloo): ranks may share a GPU, e.g. two ranks on a one-GPU machine standing in for NCCL's multi-GPU run."""
    try:
        return exchange_and_assign(dist.distributed_c10d._get_default_store(), env.node_rank, env.local_rank,
                                   env.local_world_size, env.world_size, ids, timeout_s, share)
    except LaunchError:
        dist.destroy_process_group()
        raise


def teardown(info: DistInfo, clean: bool = True) -> None:
    """Destroy the process group if this run created one. After a clean run: a barrier, then every
    rank but 0 tears down and says so through the store; rank 0, which hosts the TCP store under srun,
    leaves last, so no peer loses the store in the middle of its own shutdown (an abort at exit)."""
    if not (info.distributed and dist.is_initialized()):
        return
    _local["comm"] = _local["host_group"] = None
    gc.collect()  # free DDP reducers (they hold the group) now, not at interpreter exit after it is gone
    store = None
    if clean:
        dist.barrier()
        store = dist.distributed_c10d._get_default_store()
    if info.rank != 0 or store is None:
        dist.destroy_process_group()
        if store is not None:
            store.add(_TEARDOWN_KEY, 1)
        return
    deadline = time.monotonic() + 60
    while store.add(_TEARDOWN_KEY, 0) < info.world_size - 1 and time.monotonic() < deadline:
        time.sleep(0.02)
    dist.destroy_process_group()


def all_reduce(tensor: torch.Tensor, info: DistInfo, op: str = "sum") -> torch.Tensor:
    """In-place all-reduce (sum, max, min); a no-op for a world of one."""
    comm = _local["comm"]
    if info.distributed and not (comm is not None and comm.all_reduce_(tensor, op)):
        dist.all_reduce(tensor, op={"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX,
                                    "min": dist.ReduceOp.MIN}[op])
    return tensor


def all_reduce_host(tensor: torch.Tensor, info: DistInfo, op: str = "sum") -> torch.Tensor:
    """all_reduce of a CPU tensor that never touches a GPU: over the gloo host group where the default
    group is NCCL's (runtime.init makes it), else as all_reduce."""
    group = _local["host_group"]
    if not info.distributed or group is None:
        return all_reduce(tensor, info, op)
    dist.all_reduce(tensor, op={"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX,
                                "min": dist.ReduceOp.MIN}[op], group=group)
    return tensor


def broadcast(tensor: torch.Tensor, info: DistInfo, src: int = 0) -> torch.Tensor:
    """In-place broadcast from rank src; a no-op for a world of one."""
    if info.distributed:
        dist.broadcast(tensor, src)
    return tensor


def average_grad(grad: torch.Tensor, info: DistInfo) -> torch.Tensor:
    """The mean of every rank's gradient, as DDP's all-reduce would give it. A sparse gradient (rows of a
    table) travels as its rows: every rank's (row ids, values) gathered, so a step sends its batch's rows,
    not the whole table (NCCL has no sparse all-reduce)."""
    if not info.distributed:
        return grad
    if not grad.is_sparse:
        return all_reduce(grad, info).div_(info.world_size)
    grad = grad.coalesce()
    rows, values = grad.indices()[0], grad.values()
    counts = all_gather(torch.tensor([len(rows)], device=rows.device), info)
    most = int(max(counts))
    pad = most - len(rows)
    rows, values = F.pad(rows, (0, pad)), F.pad(values, (0, 0, 0, pad))
    all_rows, all_values = all_gather(rows, info), all_gather(values, info)
    keep = [slice(0, int(n)) for n in counts]
    rows = torch.cat([r[k] for r, k in zip(all_rows, keep)])
    values = torch.cat([v[k] for v, k in zip(all_values, keep)]).div_(info.world_size)
    return torch.sparse_coo_tensor(rows[None], values, grad.shape).coalesce()


def average_grads(params: Iterable[torch.nn.Parameter], info: DistInfo) -> None:
    """Every parameter's gradient replaced by the mean over the ranks, the dense ones of a dtype in one
    all-reduce (DDP's result without its buckets); parameters without a gradient are left out, so every rank
    must leave out the same ones (the same phase on every rank)."""
    if not info.distributed:
        return
    groups: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for p in params:
        if p.grad is not None and p.grad.is_sparse:
            p.grad = average_grad(p.grad, info)
        elif p.grad is not None:
            groups.setdefault((p.grad.dtype, p.grad.device), []).append(p.grad)
    comm = _local["comm"]
    for dense in groups.values():
        if comm is not None and comm.all_reduce_many_(dense, "sum", 1.0 / info.world_size):
            continue
        flat = torch._utils._flatten_dense_tensors(dense)
        dist.all_reduce(flat)
        flat.div_(info.world_size)
        for g, f in zip(dense, torch._utils._unflatten_dense_tensors(flat, dense)):
            g.copy_(f)


def all_gather(tensor: torch.Tensor, info: DistInfo) -> list[torch.Tensor]:
    """Every rank's tensor (the same shape on every rank), in rank order."""
    if not info.distributed:
        return [tensor]
    comm = _local["comm"]
    parts = comm.all_gather(tensor) if comm is not None else None
    if parts is None:
        parts = [torch.empty_like(tensor) for _ in range(info.world_size)]
        dist.all_gather(parts, tensor.contiguous())
    return parts


def barrier(info: DistInfo) -> None:
    """Barrier across ranks; a no-op for a world of one."""
    if info.distributed:
        dist.barrier()


def all_gather_object(obj: Any, info: DistInfo) -> list[Any]:
    """Every rank's picklable object, in rank order."""
    if not info.distributed:
        return [obj]
    out: list[Any] = [None] * info.world_size
    dist.all_gather_object(out, obj)
    return out


def broadcast_object(obj: Any, info: DistInfo, src: int = 0) -> Any:
    """Rank src's object on every rank."""
    if not info.distributed:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def deterministic_kernels() -> None:
    """train.deterministic: only kernels that give the same bits at every run. CUDA's atomics (embedding and
    index_add backward, SDPA's flash/efficient backward) take their deterministic variants, cuDNN its
    deterministic algorithms without benchmarking, cuBLAS a fixed workspace (read when its handle is made, at
    the first matmul: this runs before the model exists). An op with no deterministic kernel raises, naming it."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False


def comm_device(info: DistInfo) -> torch.device:
    """Where collective tensors must live for the backend (NCCL: the GPU, gloo: the CPU)."""
    return torch.device(info.device) if info.backend == "nccl" else torch.device("cpu")


__all__ = ["DistInfo", "init", "teardown", "attach_local", "local_comm", "all_reduce", "all_reduce_host",
           "host_group", "average_grad", "average_grads", "all_gather", "barrier", "all_gather_object", "broadcast",
           "broadcast_object", "choose_backend", "comm_device", "deterministic_kernels"]
