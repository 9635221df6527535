"""Two ranks that see one GPU (a fake id: this CPU has no CUDA, the binding is what is tested): refused with the
hint under the automatic backend (NCCL's rule, kept where gloo is only the CPU fallback), allowed when gloo is
asked for (dist.backend=gloo: a one-GPU machine standing in for NCCL's multi-GPU run; tests/gpu runs it on a
GPU)."""
from tests.conftest import launch_ranks, wait_all

ARGS = ("train", "--recipe", "toy", "--epochs", "1", "log.tensorboard=false")


def test_one_gpu_for_two_ranks_needs_gloo_asked_for(tmp_path):
    refused = wait_all(launch_ranks(2, *ARGS, "--run-dir", str(tmp_path / "auto"),
                                    extra_env={"CUDA_VISIBLE_DEVICES": "0"}))
    assert all(code == 2 for code, _ in refused), refused
    assert all("2 tasks on this node but only 1 visible GPU(s)" in err and "dist.backend=gloo can" in err
               for _, err in refused)
    shared = wait_all(launch_ranks(2, *ARGS, "dist.backend=gloo", "--run-dir", str(tmp_path / "gloo"),
                                   extra_env={"CUDA_VISIBLE_DEVICES": "0"}))
    assert all(code == 0 for code, _ in shared), [err[-2000:] for _, err in shared]
    assert (tmp_path / "gloo" / "checkpoints" / "final.pt").exists()
