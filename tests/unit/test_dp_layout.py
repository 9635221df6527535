"""--strategy dp as the seed describes it, checked without GPUs: --batch-size is per GPU (the process batch
is batch x GPUs), --gpu-ids may be any visible ids (validated), lr scaling counts dp's GPUs."""
import pytest

from trainer.config.settings import TrainConfig
from trainer.distributed.environment import LaunchError
from trainer.distributed.runtime import DistInfo, dp_device_ids
from trainer.engine.loader import per_rank_batch_size
from trainer.engine.optim import scaled_lr


@pytest.mark.parametrize("ids,count,expected", [([], 4, (0, 1, 2, 3)), ([1, 2], 4, (1, 2)), ([3], 4, (3,)),
                                                ([2, 0], 3, (2, 0)), ([], 0, ()), ([1, 2], 0, ())])
def test_dp_devices_are_the_given_ids_or_all_visible(ids, count, expected):
    assert dp_device_ids(ids, count) == expected


@pytest.mark.parametrize("ids,count,message", [
    ([1, 5], 4, "--gpu-ids 1,5: 4 CUDA device(s) are visible (CUDA_VISIBLE_DEVICES=0,1,2,3), ids 0..3; 5 is not"),
    ([-1], 2, "-1 is not one of them"),
    ([1, 1], 4, "a device is listed twice"),
])
def test_bad_gpu_ids_are_refused_naming_the_visible_devices(ids, count, message):
    with pytest.raises(LaunchError) as err:
        dp_device_ids(ids, count, "0,1,2,3" if count == 4 else None)
    assert message in str(err.value)


@pytest.mark.parametrize("devices,batch,process_batch,replicas", [((), 32, 32, 1), ((0,), 32, 32, 1),
                                                                   ((1, 2), 32, 64, 2), ((0, 1, 2, 3), 32, 128, 4)])
def test_batch_size_is_per_gpu_under_dp(devices, batch, process_batch, replicas):
    info = DistInfo(device="cuda:0" if devices else "cpu", dp_devices=devices)
    assert info.replicas == replicas
    assert per_rank_batch_size(TrainConfig(batch_size=batch), info.world_size, info.replicas) == process_batch
    # a global batch is the process's batch whatever the GPU count
    assert per_rank_batch_size(TrainConfig(global_batch_size=256), 1, info.replicas) == 256


def test_lr_scaling_counts_dp_gpus():
    info = DistInfo(device="cuda:1", dp_devices=(1, 2, 3, 4))
    assert scaled_lr(1e-3, "linear", info.world_size * info.replicas) == pytest.approx(4e-3)
    assert scaled_lr(1e-3, "sqrt", info.world_size * info.replicas) == pytest.approx(2e-3)
