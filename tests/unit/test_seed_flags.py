"""Every flag of the seed scripts: accepted with the seed's meaning, or refused naming the exact replacement."""
import pytest

from tests.conftest import REPO
from trainer.cli.parser import flags_from_args, get_parser, parse_args
from trainer.config.settings import build_config
from trainer.legacy import flags as legacy_flags


def config_of(*argv):
    args = parse_args(get_parser(), ["train", *argv])
    return build_config(args.recipe, args.config, flags_from_args(args), args.overrides)


@pytest.mark.parametrize("argv,key,value", [
    (["--num_workers", "3"], "train.num_workers", 3),
    (["--num-workers=4"], "train.num_workers", 4),
    (["--batch_size_per_gpu", "2048"], "train.batch_size", 2048),
    (["--maxlen", "100"], "data.maxlen", 100),
    (["--warmup_steps=500"], "optim.warmup_steps", 500),
    (["--backend=gloo"], "dist.backend", "gloo"),
    (["--no_mhc"], "model.mhc", False),
    (["--no_time"], "model.time", False),
    (["--mhc_no_amp"], "model.mhc_fp32", True),
    (["--multi_gpu"], "dist.strategy", "ddp"),
    (["--multi-gpu", "dp"], "dist.strategy", "dp"),
])
def test_legacy_flags_with_the_same_meaning_are_aliases(argv, key, value):
    cfg = config_of("--recipe", "sasrec", *argv)
    section, name = key.split(".")
    assert getattr(getattr(cfg, section), name) == value


def test_every_alias_is_in_the_table():
    assert set(legacy_flags.ALIASES) == {"--num_workers", "--num-workers", "--batch_size_per_gpu", "--maxlen",
                                         "--backend", "--warmup_steps",
                                         "--no_mhc", "--no_time", "--mhc_no_amp", "--multi_gpu", "--multi-gpu"}


REFUSED = [
    (["--use_amp"], "--use_amp is a flag of the seed scripts; here use --amp bf16"),
    (["--fp16"], "--fp16 is a flag of the seed scripts; here use --amp fp16"),
    (["--batch_size", "512"], "--batch_size 512 is a flag of the seed scripts; here use --global-batch-size 512"),
    (["--batch_size=512"], "here use --global-batch-size 512"),
    (["--num_gpus", "4"], "here use torchrun --nproc-per-node 4"),
    (["--master_port=29500"], "here use export MASTER_PORT=29500"),
    (["--train_dir=tisasrec_4gpu"], "here use --run-dir runs/tisasrec_4gpu"),
    (["--save-dir", "checkpoints/ddp_4gpu"], "here use --run-dir checkpoints/ddp_4gpu"),
    (["--state_dict_path", "m.pth"], "here use --init-from m.pth (weights only) or --resume m.pth"),
    (["--inference_only"], "here use python -m trainer eval --checkpoint"),
    (["--dataset=ml-1m"], "here use --config configs/sasrec/ml-1m.yaml data.path=data/ml-1m"),
    (["--dataset", "amazon-book"], "here use --config configs/kgat/amazon-book.yaml data.path=data/amazon-book"),
]


@pytest.mark.parametrize("argv,message", REFUSED)
def test_legacy_flags_with_another_meaning_are_refused_naming_the_replacement(argv, message, capsys):
    with pytest.raises(SystemExit) as err:
        parse_args(get_parser(), ["train", "--recipe", "sasrec", *argv])
    assert err.value.code == 2
    assert message in capsys.readouterr().err


def test_every_refused_flag_is_tested():
    tested = {argv[0].split("=")[0] for argv, _ in REFUSED}
    assert tested == set(legacy_flags.REPLACEMENTS) | {"--dataset"}


def test_the_seed_page_names_the_flags_of_the_guides_troubleshooting():
    """Issue 57: --fp16 (seed 000), --num_workers and --warmup_steps (seeds 000/001) are on the seed page, with
    what they are here."""
    page = (REPO / "docs" / "coming-from-the-seed-scripts.md").read_text()
    for flag in ("--fp16", "--num_workers", "--warmup_steps"):
        assert f"`{flag}" in page, flag


def test_hpc_submit_takes_the_legacy_flags_too(capsys):
    from hpc import submit
    args = parse_args(submit.get_parser(), ["--recipe", "sasrec", "--num_workers", "2"], legacy_flags=True)
    assert "train.num_workers=2" in args.overrides
    with pytest.raises(SystemExit):
        parse_args(submit.get_parser(), ["--recipe", "sasrec", "--use_amp"], legacy_flags=True)
    assert "--amp bf16" in capsys.readouterr().err


def test_inference_only_false_is_the_default_and_accepted():
    """Seed 001's resume command spells it out; =true (or the bare flag) is refused above."""
    cfg = config_of("--recipe", "sasrec", "--inference_only=false")
    assert cfg.recipe == "sasrec"
