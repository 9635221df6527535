"""The shared-memory all-reduce (trainer/distributed/shm.py) against gloo's, with real ranks: the same sums,
maxima and minima (every dtype it takes, chunked, empty, non-contiguous) and all-gathers, the same bits on
every rank, one decision for all ranks where it cannot serve them, a dead or frozen peer named instead of a
hang, and a DDP training run bitwise equal to one over gloo."""
import os
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.conftest import assert_bitwise_equal, run_ranks, weights
from trainer.distributed import shm
from trainer.distributed.environment import LaunchError
from trainer.distributed.runtime import DistInfo

pytestmark = pytest.mark.skipif(shm.EXT.load() is None, reason=f"shm extension not built: "
                                f"{shm.EXT.unavailable_reason()}")


def _group(rank: int, world: int, store: str) -> DistInfo:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    return DistInfo(rank=rank, local_rank=rank, world_size=world, backend="gloo", local_world_size=world)


def _collectives(rank: int, world: int, store: str, out: str) -> None:
    info = _group(rank, world, store)
    comm = shm.attach(info, "on", timeout_s=30, slot_bytes=4096)       # 4 KiB slots: most tensors are chunked
    mismatches, gen = [], torch.Generator().manual_seed(rank)
    for n in (0, 1, 7, 1000, 300_001):
        for dtype in (torch.float32, torch.float64, torch.int64, torch.int32):
            x = (torch.randint(-50, 50, (n,), generator=gen)).to(dtype)
            for op, ref_op in (("sum", dist.ReduceOp.SUM), ("max", dist.ReduceOp.MAX), ("min", dist.ReduceOp.MIN)):
                ref, got = x.clone(), x.clone()
                dist.all_reduce(ref, op=ref_op)
                if not comm.all_reduce_(got, op) or not torch.equal(got, ref):
                    mismatches.append((n, str(dtype), op))
    strided = torch.randn(64, 64, generator=gen)[:, ::3]
    ref = strided.contiguous()
    dist.all_reduce(ref)
    comm.all_reduce_(strided, "sum", scale=1 / world)
    mean_ok = torch.allclose(strided, ref / world, atol=1e-6)
    floats = torch.randn(100_003, generator=gen)           # arbitrary floats: every rank must get the same bits
    comm.all_reduce_(floats)
    gathered = [torch.empty_like(floats) for _ in range(world)]
    dist.all_gather(gathered, floats)
    refused = comm.all_reduce_(torch.ones(3, dtype=torch.bfloat16))
    # another device (CUDA buckets when gloo drives GPUs; meta stands in here): refused, left to the group
    off_cpu = (comm.all_reduce_(torch.ones(3, device="meta")), comm.all_gather(torch.ones(3, device="meta")))
    gathers_ok = True
    for shape, dtype in (((0,), torch.int64), ((1,), torch.int64), ((2500, 3), torch.float32), ((7,), torch.bfloat16)):
        mine = (torch.randn(shape, generator=gen) * 100).to(dtype)
        ref = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(ref, mine)
        got = comm.all_gather(mine)                         # 30 KB through 4 KiB slots: chunked too
        gathers_ok &= len(got) == world and all(torch.equal(a, b) for a, b in zip(got, ref))
    many_ok, mixed_refused, grads_ok = _many(comm, info, gen)
    torch.save(dict(mismatches=mismatches, mean_ok=mean_ok, same=all(torch.equal(gathered[0], g) for g in gathered),
                    refused=refused, off_cpu=off_cpu, gathers_ok=gathers_ok, left=os.listdir(shm.SHM_DIR),
                    many_ok=many_ok, mixed_refused=mixed_refused, grads_ok=grads_ok), f"{out}.{rank}")
    dist.destroy_process_group()


def _many(comm, info: DistInfo, gen: torch.Generator) -> tuple[bool, bool, bool]:
    """all_reduce_many_ (tensors across 4 KiB chunk edges as one buffer, one of them strided) against gloo per
    tensor; a mixed-dtype list refused untouched; runtime.average_grads through it and through gloo alone."""
    from trainer.distributed import runtime
    xs = [torch.randn(n, generator=gen) for n in (3, 0, 1500, 1, 2049)] + [torch.randn(40, 40, generator=gen)[:, ::2]]
    refs = [x.clone() for x in xs]
    for r in refs:
        dist.all_reduce(r)
    many_ok = comm.all_reduce_many_(xs, "sum", 0.5)      # gloo sums in another order: the last bits may differ
    many_ok &= all(torch.allclose(x, r / 2, atol=1e-6) for x, r in zip(xs, refs))
    mixed = [torch.ones(3), torch.ones(3, dtype=torch.float64)]
    mixed_refused = not comm.all_reduce_many_(mixed) and all(bool((m == 1).all()) for m in mixed)
    grads_ok = True
    for through in (comm, None):                            # the shared segment, then gloo's flattened all-reduce
        runtime._local["comm"] = through
        params = [torch.nn.Parameter(torch.zeros(s)) for s in ((5, 3), (1030,), (2,))]
        for q in params[:2]:
            q.grad = torch.randn(q.shape, generator=gen)
        expect = [q.grad.clone() for q in params[:2]]
        for e in expect:
            dist.all_reduce(e)
        runtime.average_grads(params, info)
        grads_ok &= params[2].grad is None and all(torch.allclose(q.grad, e / info.world_size, atol=1e-6)
                                                   for q, e in zip(params, expect))
    runtime._local["comm"] = None
    return many_ok, mixed_refused, grads_ok


def test_matches_gloo_and_gives_every_rank_the_same_bits(tmp_path, monkeypatch):
    monkeypatch.setenv("TRAINER_SHM_DIR", str(tmp_path / "shm"))
    (tmp_path / "shm").mkdir()
    monkeypatch.setattr(shm, "SHM_DIR", tmp_path / "shm")
    mp.spawn(_collectives, args=(3, str(tmp_path / "store"), str(tmp_path / "got")), nprocs=3)
    for rank in range(3):
        got = torch.load(tmp_path / f"got.{rank}", weights_only=True)
        assert got["mismatches"] == [] and got["mean_ok"] and got["same"], got
        assert got["refused"] is False                      # bf16: the caller falls back to the process group
        assert got["off_cpu"] == (False, None)              # not a CPU tensor: the same
        assert got["gathers_ok"]                            # all_gather: gloo's result, any dtype
        assert got["left"] == []                            # unlinked once every rank had it mapped
        assert (got["many_ok"], got["mixed_refused"], got["grads_ok"]) == (True, True, True)


def _split_dirs(rank: int, world: int, store: str, base: str, mode: str, out: str) -> None:
    shm.SHM_DIR = shm.Path(base) / str(rank)              # as on two hosts: rank 1 cannot see rank 0's file
    shm.SHM_DIR.mkdir(parents=True, exist_ok=True)
    info = _group(rank, world, store)
    try:
        result = "none" if shm.attach(info, mode, timeout_s=30) is None else "comm"
    except LaunchError as e:
        result = f"error: {e}"
    torch.save(dict(result=result, left=os.listdir(shm.SHM_DIR)), f"{out}.{rank}")
    dist.destroy_process_group()


@pytest.mark.parametrize("mode", ["auto", "on"])
def test_ranks_that_cannot_share_a_segment_all_fall_back_or_all_stop(tmp_path, mode):
    mp.spawn(_split_dirs, args=(2, str(tmp_path / "store"), str(tmp_path / "shm"), mode, str(tmp_path / "got")),
             nprocs=2)
    got = [torch.load(tmp_path / f"got.{r}", weights_only=True) for r in (0, 1)]
    if mode == "auto":
        assert [g["result"] for g in got] == ["none", "none"]
    else:
        for g in got:
            assert g["result"].startswith("error: dist.shm_allreduce=on: rank 1 cannot open"), g["result"]
            assert "dist.shm_allreduce=auto" in g["result"]
    assert got[0]["left"] == [] and got[1]["left"] == []


def _peer_fault(rank: int, world: int, store: str, how: str, out: str) -> None:
    info = _group(rank, world, store)
    comm = shm.attach(info, "on", timeout_s=3)
    comm.all_reduce_(torch.ones(10))
    if rank == 1:
        if how == "exit":
            os._exit(0)
        time.sleep(10)                                      # frozen past the timeout
        return
    t0 = time.monotonic()
    try:
        comm.all_reduce_(torch.ones(10))
        error = None
    except RuntimeError as e:
        error = str(e)
    torch.save(dict(error=error, after=time.monotonic() - t0), f"{out}.0")
    os._exit(0)                                             # the group is broken; do not wait in its teardown


@pytest.mark.timing
@pytest.mark.parametrize("how", ["exit", "freeze"])
def test_a_dead_or_frozen_peer_is_named_not_waited_for(tmp_path, how):
    ctx = mp.spawn(_peer_fault, args=(2, str(tmp_path / "store"), how, str(tmp_path / "got")), nprocs=2, join=False)
    for p in ctx.processes:
        p.join(60)
    got = torch.load(tmp_path / "got.0", weights_only=True)
    if how == "exit":
        assert "rank 1 (pid" in got["error"] and "has exited" in got["error"] and got["after"] < 2.0, got
    else:
        assert "timed out after 3 s (dist.timeout_s)" in got["error"] and 3.0 <= got["after"] < 6.0, got


RUN = ("--recipe", "toy", "--epochs", "2", "--seed", "5", "--batch-size", "16", "log.tensorboard=false")


def test_ddp_training_through_shared_memory_is_bitwise_gloos(tmp_path):
    """Two ranks, one host: the default path (shared memory) gives the same weights as gloo's all-reduce
    (for two ranks both sum a + b, and halving is exact), and its log says which path ran."""
    fast = run_ranks(2, "train", *RUN, "--run-dir", str(tmp_path / "shm"))
    slow = run_ranks(2, "train", *RUN, "--run-dir", str(tmp_path / "gloo"), "dist.shm_allreduce=off")
    assert "DDP's gradient all-reduce: shared memory, 2 ranks on one host" in fast[0][1]
    assert "DDP's gradient all-reduce: gloo (no shared memory: dist.shm_allreduce=off)" in slow[0][1]
    assert_bitwise_equal(weights(tmp_path / "shm"), weights(tmp_path / "gloo"))
