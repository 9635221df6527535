"""The collectives of one training step, timed alone: an all-reduce of the model's gradients (float32) and the
two one-element all-reduces the loop adds (the preemption-signal agreement and the logged loss), gloo.

    OMP_NUM_THREADS=1 python -m torch.distributed.run --standalone --nproc-per-node=2 bench/allreduce.py 74828
    -> {"numel": 74828, "world": 2, "grad_ms": 0.58, "tiny_ms": 0.25, "step_ms": 1.08}   (rank 0)
"""
from __future__ import annotations

import argparse
import json
import time

import torch
import torch.distributed as dist


def median_ms(tensor: torch.Tensor, repeats: int) -> float:
    for _ in range(3):                                   # connection set-up and allocator warm-up
        dist.all_reduce(tensor)
    times = []
    for _ in range(repeats):
        dist.barrier()                                   # time the collective, not the other rank's lag
        t0 = time.perf_counter()
        dist.all_reduce(tensor)
        times.append(time.perf_counter() - t0)
    return 1000 * sorted(times)[len(times) // 2]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("numel", type=int, help="gradient elements (the model's trainable parameters)")
    p.add_argument("--repeats", type=int, default=31)
    args = p.parse_args(argv)
    dist.init_process_group("gloo")
    grad = median_ms(torch.ones(args.numel), args.repeats)
    tiny = median_ms(torch.ones(1), args.repeats)
    if dist.get_rank() == 0:
        print(json.dumps(dict(numel=args.numel, world=dist.get_world_size(), grad_ms=round(grad, 4),
                              tiny_ms=round(tiny, 4), step_ms=round(grad + 2 * tiny, 4))), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
