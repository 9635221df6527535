"""Which GPU each DDP rank drives, in every layout Slurm and torchrun produce.

    assign_devices([["0", "1"], ["0", "1"]])   # all GPUs visible to both tasks -> [0, 1]
    assign_devices([["0", "1"], ["2", "3"]])   # --gpus-per-task=2: the model on each task's first -> [0, 0]
    assign_devices([["0"], ["0"]], share=True)  # gloo only: two ranks on one GPU -> [0, 0]

The ranks of a node swap what they can see (CUDA_VISIBLE_DEVICES, or every device when it is unset)
through the rendezvous store, so the same table is computed on each of them; no rank guesses from its own
local rank (which breaks for --gpu-bind=closest with cyclic task placement, or two tasks bound to one GPU).
"""
from __future__ import annotations

import time
from typing import Mapping, Sequence

from trainer.distributed.environment import LaunchError

_KEY = "trainer/bind"


def visible_ids(env: Mapping[str, str], device_count: int) -> list[str]:
    """The GPU ids this process can see, in CUDA's order: CUDA_VISIBLE_DEVICES up to its first "-1"
    (CUDA ignores the rest), or 0..device_count-1 when it is unset. Fake gres ids count without CUDA."""
    spec = env.get("CUDA_VISIBLE_DEVICES")
    if spec is None:
        return [str(i) for i in range(max(device_count, 0))]
    ids: list[str] = []
    for item in (s.strip() for s in spec.split(",")):
        if item == "-1":
            break
        if item:
            ids.append(item)
    return ids


def assign_devices(visible: Sequence[Sequence[str]], share: bool = False) -> list[int]:
    """For the tasks of one node in local-rank order, each with the GPU ids it sees: the index, into its own
    list, of the GPU it drives. Each task takes its first GPU that no lower task took, so tasks sharing a set
    spread over it, and tasks with a set of their own use its first GPU. A task that finds none left raises a
    LaunchError (with a HINT): NCCL refuses two ranks on one GPU. With `share` (the gloo backend, which
    copies through the host and does not mind) it takes its least used GPU instead."""
    if not any(visible):
        return [0] * len(visible)     # no GPUs on this node: every task runs on the CPU
    users: dict[str, int] = {}                 # GPU id -> tasks of this node driving it so far
    chosen: list[int] = []
    for task, ids in enumerate(visible):
        free = [i for i, gpu in enumerate(ids) if gpu not in users]
        if not ids:
            raise LaunchError(f"local task {task} sees no GPU (CUDA_VISIBLE_DEVICES is empty) while "
                              f"{_seen_by_others(visible)} other task(s) of this node see some.\n"
                              f"HINT: give every task GPUs (--gpus-per-task=1) or none.")
        if not free and not share:
            raise _oversubscribed(visible, task)
        pick = free[0] if free else min(range(len(ids)), key=lambda i: (users[ids[i]], i))
        chosen.append(pick)
        users[ids[pick]] = users.get(ids[pick], 0) + 1
    return chosen


def _seen_by_others(visible: Sequence[Sequence[str]]) -> int:
    return sum(1 for ids in visible if ids)


def _oversubscribed(visible: Sequence[Sequence[str]], task: int) -> LaunchError:
    """The tasks up to `task` that compete for its GPUs, named with what they see."""
    mine = set(visible[task])
    rivals = [t for t in range(task + 1) if mine & set(visible[t])]
    gpus = sorted(set().union(*(visible[t] for t in rivals)))
    sets = sorted({",".join(visible[t]) for t in rivals})
    where = "; ".join(f"CUDA_VISIBLE_DEVICES={s}" for s in sets)
    return LaunchError(
        f"{len(rivals)} tasks on this node but only {len(gpus)} visible GPU(s) ({where}; local tasks "
        f"{','.join(map(str, rivals))}).\n"
        f"HINT: run one task per GPU: --ntasks-per-node={len(gpus)} with --gpus-per-node={len(gpus)}, or "
        f"--gpus-per-task=1; --gpu-bind=single:N binds N tasks to one GPU, which NCCL cannot use "
        f"(dist.backend=gloo can, slowly: for tests, not for speed).")


def exchange_and_assign(store, node_rank: int, local_rank: int, local_world_size: int, world_size: int,
                        ids: list[str], timeout_s: float, share: bool = False) -> int:
    """Swap visible GPU ids with the other tasks of this node through the rendezvous store and return this
    task's index (`share`: as assign_devices). Every rank of the job waits for all to report, so an
    oversubscribed node fails the whole job at once, with one message, instead of leaving the other nodes
    hanging in a collective."""
    store.set(f"{_KEY}/{node_rank}/{local_rank}", ",".join(ids))
    table = [_split(store.get(f"{_KEY}/{node_rank}/{i}")) for i in range(local_world_size)]
    index, error = 0, None
    try:
        index = assign_devices(table, share)[local_rank]
    except LaunchError as err:
        error = err
        store.set(f"{_KEY}/error", str(err))
    store.add(f"{_KEY}/done", 1)
    deadline = time.monotonic() + timeout_s
    while store.add(f"{_KEY}/done", 0) < world_size:
        if time.monotonic() > deadline:
            raise LaunchError(f"GPU binding: not every rank reported within {timeout_s:.0f} s")
        time.sleep(0.02)
    if error is not None:
        raise error
    if store.check([f"{_KEY}/error"]):
        raise LaunchError(store.get(f"{_KEY}/error").decode())
    return index


def _split(raw: bytes) -> list[str]:
    text = raw.decode()
    return text.split(",") if text else []
