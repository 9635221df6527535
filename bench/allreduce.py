"""The collectives of one training step, timed alone: an all-reduce of the model's gradients (float32) and the
one small all-reduce the loop adds (the preemption-signal agreement), through the path the trainer takes
(shared memory for gloo ranks on one host, trainer/distributed/shm.py) and through gloo, for comparison.

    OMP_NUM_THREADS=1 python -m torch.distributed.run --standalone --nproc-per-node=2 bench/allreduce.py 74828
    -> {"numel": 74828, "world": 2, "via": "shm", "grad_ms": 0.05, "tiny_ms": 0.01, "step_ms": 0.06,
        "gloo_grad_ms": 0.58, "gloo_tiny_ms": 0.25, "gloo_step_ms": 0.83}   (rank 0)
"""
from __future__ import annotations

import argparse
import json
import time

import torch
import torch.distributed as dist

from trainer.distributed import shm
from trainer.distributed.runtime import DistInfo


def median_ms(reduce, tensor: torch.Tensor, repeats: int) -> float:
    for _ in range(3):                                   # connection set-up and allocator warm-up
        reduce(tensor)
    times = []
    for _ in range(repeats):
        dist.barrier()                                   # time the collective, not the other rank's lag
        t0 = time.perf_counter()
        reduce(tensor)
        times.append(time.perf_counter() - t0)
    return 1000 * sorted(times)[len(times) // 2]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    p.add_argument("numel", type=int, help="gradient elements (the model's trainable parameters)")
    p.add_argument("--repeats", type=int, default=31)
    args = p.parse_args(argv)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    comm = shm.attach(DistInfo(rank=rank, world_size=world, backend="gloo", local_world_size=world))
    paths = {"gloo": dist.all_reduce}
    if comm is not None:
        paths["shm"] = comm.all_reduce_
    out = dict(numel=args.numel, world=world, via="shm" if comm else "gloo")
    for name, reduce in paths.items():
        grad = median_ms(reduce, torch.ones(args.numel), args.repeats)
        tiny = median_ms(reduce, torch.ones(1, dtype=torch.float64), args.repeats)
        prefix = "" if name == out["via"] else "gloo_"
        out.update({f"{prefix}grad_ms": round(grad, 4), f"{prefix}tiny_ms": round(tiny, 4),
                    f"{prefix}step_ms": round(grad + tiny, 4)})
    if rank == 0:
        print(json.dumps(out), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
