"""GPU binding per rank (issue 19, point 2): every layout Slurm and torchrun produce, as a table of the
CUDA_VISIBLE_DEVICES each task of a node is given (the rows marked "seen" were read from srun on the local
cluster's fake gres; the others are what Slurm documents for hardware we do not have), the index each
task drives, and the exchange through a real TCPStore with one thread per rank."""
import threading

import pytest
import torch.distributed as dist

from tests.conftest import free_port
from trainer.distributed.binding import assign_devices, exchange_and_assign, visible_ids
from trainer.distributed.environment import LaunchError

# layout -> (CUDA_VISIBLE_DEVICES of local tasks 0.., the GPU id each task drives)
LAYOUTS = {
    # seen: srun -n2 --gpus-per-node=4 (no binding: every task sees all)
    "all visible": (["0,1,2,3", "0,1,2,3"], ["0", "1"]),
    # seen: srun -n2 --gpus-per-task=1 (per_task binding)
    "one per task": (["0", "1"], ["0", "1"]),
    # seen: srun -n2 --gpu-bind=map_gpu:2,3
    "map_gpu": (["2", "3"], ["2", "3"]),
    # seen: srun -n2 --gpus-per-task=2, and --gpu-bind=mask_gpu:0x3,0xC: the model on each task's first
    "gpus-per-task=2": (["0,1", "2,3"], ["0", "2"]),
    # --gpu-bind=closest on a 2-socket node, block placement: tasks 0,1 near GPUs 0,1
    "closest, block": (["0,1", "0,1", "2,3", "2,3"], ["0", "1", "2", "3"]),
    # --gpu-bind=closest, cyclic placement: local rank % 2 would put tasks 0 and 2 both on GPU 0
    "closest, cyclic": (["0,1", "2,3", "0,1", "2,3"], ["0", "2", "1", "3"]),
    # more GPUs than tasks: the spare ones stay idle
    "spare GPUs": (["0,1,2,3,4,5,6,7", "0,1,2,3,4,5,6,7"], ["0", "1"]),
    # GPU UUIDs and MIG slices are names, not numbers
    "uuids": (["GPU-aa,GPU-bb", "GPU-aa,GPU-bb"], ["GPU-aa", "GPU-bb"]),
    "mig": (["MIG-1", "MIG-2"], ["MIG-1", "MIG-2"]),
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_layout_binds_each_task_to_its_own_gpu(layout):
    cvd, expected = LAYOUTS[layout]
    visible = [visible_ids({"CUDA_VISIBLE_DEVICES": v}, 0) for v in cvd]
    index = assign_devices(visible)
    assert [visible[t][i] for t, i in enumerate(index)] == expected
    assert len(set(expected)) == len(expected)  # no two tasks share a GPU


def test_unset_visible_devices_mean_every_gpu_cuda_counts():
    # srun --gpu-bind=none leaves CUDA_VISIBLE_DEVICES unset (seen): device = position among the node's tasks
    visible = [visible_ids({}, 4) for _ in range(3)]
    assert visible[0] == ["0", "1", "2", "3"] and assign_devices(visible) == [0, 1, 2]
    assert visible_ids({}, 0) == []               # no CUDA and nothing allocated: the CPU
    assert assign_devices([[], []]) == [0, 0]


def test_cuda_ignores_everything_after_minus_one():
    assert visible_ids({"CUDA_VISIBLE_DEVICES": "2, 3,-1,0"}, 8) == ["2", "3"]
    assert visible_ids({"CUDA_VISIBLE_DEVICES": ""}, 8) == []


@pytest.mark.parametrize("cvd,message", [
    # seen: srun -n4 --gpus-per-node=2 --gpu-bind=single:2 puts tasks 0,1 on GPU 0
    (["0", "0", "1", "1"], "2 tasks on this node but only 1 visible GPU(s) (CUDA_VISIBLE_DEVICES=0; local tasks 0,1)"),
    # seen: srun -n3 --gpus-per-node=2
    (["0,1", "0,1", "0,1"],
     "3 tasks on this node but only 2 visible GPU(s) (CUDA_VISIBLE_DEVICES=0,1; local tasks 0,1,2)"),
    (["0", ""], "local task 1 sees no GPU"),
])
def test_a_layout_ddp_cannot_use_names_the_tasks_and_gpus(cvd, message):
    with pytest.raises(LaunchError) as err:
        assign_devices([visible_ids({"CUDA_VISIBLE_DEVICES": v}, 0) for v in cvd])
    assert message in str(err.value) and "HINT" in str(err.value)


@pytest.mark.parametrize("cvd,expected", [
    (["0", "0"], ["0", "0"]),                                   # --gpu-bind=single:2, or a one-GPU machine
    (["0,1", "0,1", "0,1", "0,1", "0,1"], ["0", "1", "0", "1", "0"]),   # spread evenly, lowest first
    (["0,1", "0,1", "2"], ["0", "1", "2"]),                     # no sharing where a GPU is free
])
def test_gloo_may_put_ranks_on_a_shared_gpu_spread_evenly(cvd, expected):
    visible = [visible_ids({"CUDA_VISIBLE_DEVICES": v}, 0) for v in cvd]
    index = assign_devices(visible, share=True)
    assert [visible[t][i] for t, i in enumerate(index)] == expected
    with pytest.raises(LaunchError, match="dist.backend=gloo can"):
        if len(set(expected)) < len(expected):
            assign_devices(visible)                             # NCCL's rule stands without share
        else:
            raise LaunchError("dist.backend=gloo can")          # nothing shared: nothing to refuse


def _exchange(nodes: list[list[str]], share: bool = False) -> list[object]:
    """Run exchange_and_assign for every rank of `nodes` (CUDA_VISIBLE_DEVICES per local task) in threads
    against one real TCPStore; the index or the exception of each rank, in rank order."""
    port = free_port()
    world = sum(len(n) for n in nodes)
    server = dist.TCPStore("127.0.0.1", port, world, True, wait_for_workers=False)
    out: list[object] = [None] * world

    def rank_main(rank, node, local, cvd):
        store = dist.TCPStore("127.0.0.1", port, world, False)
        try:
            out[rank] = exchange_and_assign(store, node, local, len(nodes[node]), world,
                                            visible_ids({"CUDA_VISIBLE_DEVICES": cvd}, 0), 30, share)
        except LaunchError as err:
            out[rank] = err

    threads, rank = [], 0
    for node, tasks in enumerate(nodes):
        for local, cvd in enumerate(tasks):
            threads.append(threading.Thread(target=rank_main, args=(rank, node, local, cvd)))
            rank += 1
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    del server
    return out


def test_the_exchange_binds_each_node_separately():
    # two nodes with the same GPU numbers (the local cluster's nodes even share a host): no false clash
    assert _exchange([["0,1", "0,1"], ["2,3", "0,1"]]) == [0, 1, 0, 0]


def test_one_oversubscribed_node_fails_every_rank_with_the_same_message():
    out = _exchange([["0,1", "0,1"], ["0", "0"]])
    assert all(isinstance(o, LaunchError) for o in out), out
    assert {str(o) for o in out} == {str(out[2])}
    assert "2 tasks on this node but only 1 visible GPU(s)" in str(out[0])


def test_the_exchange_lets_gloo_ranks_share_a_gpu():
    assert _exchange([["0", "0"], ["0", "0"]], share=True) == [0, 0, 0, 0]
