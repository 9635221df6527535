"""--private: on a shared file system the run directory, checkpoints, logs and TensorBoard files are the
owner's only; a resumed run that was not private is tightened; hpc/submit.py passes the flag on."""
import stat

from tests.conftest import trainer

RUN = ("--recipe", "toy", "--epochs", "1", "--seed", "1")


def modes(root):
    return {str(p.relative_to(root)): stat.S_IMODE(p.stat().st_mode) for p in [root, *root.rglob("*")]}


def test_private_run_directory_is_owner_only(tmp_path):
    run_dir = tmp_path / "run"
    trainer("train", *RUN, "--run-dir", str(run_dir), "--private")
    found = modes(run_dir)
    assert {"checkpoints/final.pt", "train.log", "metrics.jsonl", "config.yaml"} <= set(found)
    assert any(name.startswith("tb/") for name in found)                 # TensorBoard's files too
    assert {name: mode for name, mode in found.items() if mode & 0o077} == {}
    assert found["."] == 0o700


def test_a_public_run_is_tightened_when_resumed_private(tmp_path):
    run_dir = tmp_path / "run"
    trainer("train", *RUN, "--run-dir", str(run_dir))
    assert modes(run_dir)["checkpoints/final.pt"] & 0o044                # the default leaves them readable
    trainer("train", *RUN, "--epochs", "2", "--run-dir", str(run_dir), "--resume", "auto", "--private")
    assert {name: mode for name, mode in modes(run_dir).items() if mode & 0o077} == {}


def test_submit_passes_private_on():
    from hpc import submit
    from trainer.cli.parser import parse_args
    args = parse_args(submit.get_parser(), ["--recipe", "sasrec", "--private", "--epochs", "2"])
    argv = submit.trainer_argv(args, "/r", [])
    assert "--private" in argv and argv[argv.index("--private") + 1].startswith("--")
