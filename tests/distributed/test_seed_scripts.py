"""The seed guides' script names at the repository root (main.py, main_multi_gpu.py, train.py): a user who types
the guide's command line gets the guide's run, or, where main.py's flags do not tell which guide, both commands."""
import subprocess

import pytest

from tests.conftest import PY, REPO, clean_env, free_port
from tests.timeouts import limit
from trainer.legacy.scripts import guide_of, trainer_args


@pytest.mark.parametrize("argv, guide", [
    (["--dataset=ml-1m", "--train_dir=x", "--use_amp"], "001"),
    (["--dataset", "ml-1m"], "001"),
    (["--no_time", "--no_mhc"], "001"),
    (["--lr", "1e-3", "--batch-size", "32"], "002"),
    (["--local-rank=0", "--batch-size", "32"], "002"),      # torch.distributed.launch's own argument tells nothing
    ([], None),                                              # `python main.py`: both guides' launch line
    (["--lr", "1e-3"], None),
    (["--dataset=ml-1m", "--print-config", "--epochs", "3"], "001"),   # the trainer's own flags tell nothing
    (["--print-config"], None),
])
def test_main_py_is_told_apart_by_its_flags(argv, guide):
    assert guide_of("main.py", argv) == guide
    assert guide_of("main_multi_gpu.py", argv) == "002" and guide_of("train.py", argv) == "003"


def test_seed_001s_dataset_picks_the_config_of_that_name():
    args = trainer_args("001", ["--dataset", "ml-100k", "--no_mhc"])
    assert args[0:2] == ["train", "--config"] and args[2].endswith("configs/tisasrec/ml-100k.yaml")
    assert args[3:] == ["model.mhc=true", "--no_mhc"]                # the flag after the guide's default: it wins
    assert "--dataset=ml-2m" in trainer_args("001", ["--dataset=ml-2m"])   # the trainer refuses it, with the choices


def test_the_guides_own_flags_mean_in_their_scripts_what_the_guides_say():
    args = trainer_args("001", ["--dataset=ml-1m", "--train_dir=tisasrec_4gpu", "--batch_size", "512", "--use_amp",
                                "--multi_gpu"])
    assert args[4:] == ["--run-dir", "runs/tisasrec_4gpu", "--global-batch-size", "512", "--amp", "auto",
                        "--multi_gpu"]
    assert trainer_args("002", ["--save-dir", "checkpoints/dp_4gpu"])[-2:] == ["--run-dir", "checkpoints/dp_4gpu"]


@pytest.mark.long     # a guide's launch as written: make test-fast leaves it out
def test_seed_001s_four_gpu_command_line_as_the_guide_wrote_it(tmp_path):
    """The guide's `python -m torch.distributed.launch ... main.py --dataset=ml-1m --train_dir=... --batch_size=...
    --use_amp --multi_gpu` (2 processes, ml-100k's config on generated data)."""
    proc = subprocess.run([PY, "-m", "torch.distributed.launch", "--nproc_per_node=2", f"--master_port={free_port()}",
                           str(REPO / "main.py"), "--dataset=ml-100k", "--train_dir=tisasrec_2gpu", "--batch_size=64",
                           "--use_amp", "--multi_gpu", "--epochs", "1", "data.path=", "log.tensorboard=false"],
                          cwd=tmp_path, env=clean_env(), capture_output=True, text=True, timeout=limit("start"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "here the same is torchrun --nproc-per-node 2 -m trainer train --config" in proc.stderr
    assert "--local-rank" not in proc.stderr.split("here the same is")[1].splitlines()[0]
    log = (tmp_path / "runs" / "tisasrec_2gpu" / "train.log").read_text()
    assert "recipe=sasrec world=2" in log and "batch/rank=32" in log


def test_bare_main_py_stops_with_both_commands():
    proc = subprocess.run([PY, "main.py"], cwd=REPO, env=clean_env(), capture_output=True, text=True,
                          timeout=limit("minute"))
    assert proc.returncode == 2
    assert "seed 001 (SASRec/TiSASRec+mHC): python -m trainer train --config configs/tisasrec/ml-1m.yaml" in proc.stderr
    assert "seed 002 (HAR): python -m trainer train --config configs/har/uci-har.yaml" in proc.stderr


def test_seed_001s_main_py_refuses_an_unknown_dataset_with_the_choices():
    proc = subprocess.run([PY, "main.py", "--dataset=ml-2m", "--no_mhc"], cwd=REPO, env=clean_env(),
                          capture_output=True, text=True, timeout=limit("minute"))
    assert proc.returncode == 2 and "--dataset ml-2m is a flag of the seed scripts" in proc.stderr


@pytest.mark.long     # a guide's launch as written: make test-fast leaves it out
def test_seed_002s_ddp_command_line_trains_from_another_directory(tmp_path):
    """`torchrun --nproc_per_node=2 main_multi_gpu.py --multi-gpu ddp ...` (data generated: data.path=)."""
    run_dir = tmp_path / "run"
    proc = subprocess.run([PY, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master-port={free_port()}",
                           str(REPO / "main_multi_gpu.py"),
                           "--multi-gpu", "ddp", "--epochs", "1", "--batch-size", "32", "--run-dir", str(run_dir),
                           "data.path=", "log.tensorboard=false"], cwd=tmp_path, env=clean_env(),
                          capture_output=True, text=True, timeout=limit("start"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stderr.count("main_multi_gpu.py: seed 002's script (HAR); here the same is torchrun "
                             "--nproc-per-node 2 -m trainer train --config") == 1      # said once, by rank 0
    log = (run_dir / "train.log").read_text()
    assert "recipe=har world=2" in log and (run_dir / "checkpoints" / "final.pt").exists()


def test_seed_003s_train_py_under_torch_distributed_launch():
    proc = subprocess.run([PY, "-m", "torch.distributed.launch", "--nproc_per_node=1", "train.py", "--print-config"],
                          cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=limit("run"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "recipe: video" in proc.stdout and "path: data/mouse" in proc.stdout


def _sh(args, cwd, timeout=limit("start"), **env):
    return subprocess.run(["bash", *args], cwd=cwd, env=clean_env(**env), capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.long     # a guide's launch as written: make test-fast leaves it out
def test_seed_001s_launch_script_with_its_environment_knobs(tmp_path):
    """`NUM_GPUS=2 BATCH_SIZE=... ./train_distributed.sh DATASET TRAIN_DIR`, from another directory."""
    run_dir = tmp_path / "run"
    proc = _sh([str(REPO / "train_distributed.sh"), "ml-100k", "t", "data.path=", "--epochs", "1", "--run-dir",
                str(run_dir), "log.tensorboard=false"], tmp_path, NUM_GPUS="2", BATCH_SIZE="64",
               MASTER_PORT=str(free_port()))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "here the same is torchrun --nproc-per-node 2 --master-port " in proc.stderr
    assert "model.mhc=true --run-dir runs/t --global-batch-size 64" in proc.stderr
    log = (run_dir / "train.log").read_text()
    assert "world=2" in log and "batch/rank=32" in log and (run_dir / "checkpoints" / "final.pt").exists()


def test_seed_000s_launch_script_and_its_flags(tmp_path):
    run_dir = tmp_path / "run"
    port = free_port()
    proc = _sh([str(REPO / "scripts" / "run_original_kgat_multi_gpu.sh"), "--num_gpus", "2", "--dataset",
                "ml-100k-kg", "--batch_size_per_gpu=256", "--master_port", str(port), "data.path=", "--epochs", "1",
                "--run-dir", str(run_dir), "log.tensorboard=false"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"torchrun --nproc-per-node 2 --master-port {port} -m trainer train --config" in proc.stderr
    log = (run_dir / "train.log").read_text()
    assert "recipe=kgat world=2" in log and "batch/rank=256" in log


def test_seed_003s_launch_script():
    proc = _sh(["train_multigpu.sh", "1", "--print-config"], REPO, timeout=limit("run"), MASTER_PORT="29631")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "recipe: video" in proc.stdout
    assert "torchrun --nproc-per-node 1 --master-port 29631 -m trainer train --config" in proc.stderr


@pytest.mark.parametrize("args, message", [
    (["train_distributed.sh", "ml-2m", "x"], "no tisasrec config for dataset 'ml-2m' (configs/tisasrec/ml-2m.yaml); "
                                             "there are: ml-100k ml-1m"),
    (["train_distributed.sh", "ml-1m"], "usage: train_distributed.sh DATASET TRAIN_DIR"),
    (["train_multigpu.sh", "three"], "the process count must be a positive integer, got 'three'"),
    (["scripts/run_original_kgat_multi_gpu.sh", "--dataset", "yelp"], "no kgat config for dataset 'yelp'"),
    (["scripts/run_original_kgat_multi_gpu.sh", "--num_gpus"], "--num_gpus needs a value"),
])
def test_the_launch_scripts_refuse_bad_arguments_naming_them(args, message):
    proc = _sh(args, REPO, timeout=limit("minute"))
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr
