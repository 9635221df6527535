"""Config precedence, type conversion, unknown keys, YAML errors, resolved config round trip."""
import pytest

import tests.toy_recipe  # noqa: F401  (registers the toy recipe)
from trainer.config.settings import (
    ConfigError,
    build_config,
    from_dict,
    load_yaml,
    parse_override,
    save_config,
    to_dict,
)


def test_precedence_defaults_yaml_flags_overrides(tmp_path):
    y = tmp_path / "c.yaml"
    y.write_text("optim:\n  lr: 0.5\ntrain:\n  epochs: 7\n  batch_size: 4\nmodel:\n  hidden: 8\nseed: 3\n")
    cfg = build_config("toy", str(y), flags={"train.epochs": 9, "train.batch_size": 6},
                       overrides=["train.batch_size=11", "model.dropout=0.0"])
    assert cfg.optim.lr == 0.5                 # YAML over default
    assert cfg.train.epochs == 9               # flag over YAML
    assert cfg.train.batch_size == 11          # key=value over flag
    assert cfg.model.hidden == 8 and cfg.model.dropout == 0.0 and cfg.seed == 3
    assert cfg.optim.weight_decay == 0.0       # untouched default


def test_yaml_booleans_for_choice_fields(tmp_path):
    y = tmp_path / "c.yaml"
    y.write_text("train:\n  amp: off\nlog:\n  progress: on\n")      # YAML 1.1 reads these as booleans
    cfg = build_config("toy", str(y))
    assert (cfg.train.amp, cfg.log.progress) == ("off", "on")


def test_recipe_taken_from_yaml_when_not_given(tmp_path):
    y = tmp_path / "c.yaml"
    y.write_text("recipe: toy\n")
    assert build_config(None, str(y)).recipe == "toy"
    with pytest.raises(ConfigError, match="no recipe"):
        build_config(None)


@pytest.mark.parametrize("text,key,value", [
    ("optim.lr=1e-3", "optim.lr", 1e-3), ("log.tensorboard=false", "log.tensorboard", False),
    ("log.tensorboard=off", "log.tensorboard", False), ("train.epochs=3", "train.epochs", 3),
    ("dist.gpu_ids=0,1", "dist.gpu_ids", [0, 1]), ("dist.gpu_ids=[2,3]", "dist.gpu_ids", [2, 3]),
    ("train.amp=bf16", "train.amp", "bf16"), ("data.path=/x/y", "data.path", "/x/y"),
    ("ckpt.resume=", "ckpt.resume", ""), ("optim.warmup_epochs=2", "optim.warmup_epochs", 2.0),
    ("log.progress=on", "log.progress", "on"), ("train.amp=off", "train.amp", "off"),
    ("dist.gpu_ids=", "dist.gpu_ids", []), ("optim.betas=0.9,0.98", "optim.betas", [0.9, 0.98]),
])
def test_override_type_conversion(text, key, value):
    cfg = build_config("toy", overrides=["dist.strategy=dp", text])     # (dist.gpu_ids counts only under dp)
    section, name = key.split(".")
    got = getattr(getattr(cfg, section), name)
    assert got == value and type(got) is type(value)


@pytest.mark.parametrize("text,message", [
    ("train.lrr=1", "Valid keys under train: train.epochs"),
    ("nope=1", "Valid keys: recipe, run_dir, seed, private, train.*, optim.*, log.*"),
    ("model.depth=3", "model.hidden"),
    ("train.epochs=1.5", "not a valid int"),
    ("train.amp=fp8", "not one of off, bf16, fp16"),
    ("log.tensorboard=maybe", "not a boolean"),
    ("optim.lr", "key=value"),
])
def test_bad_overrides_are_clear_errors(text, message):
    with pytest.raises(ConfigError) as err:
        build_config("toy", overrides=[text])
    assert message in str(err.value)


def test_unknown_yaml_key_names_file(tmp_path):
    y = tmp_path / "bad.yaml"
    y.write_text("train:\n  epochz: 3\n")
    with pytest.raises(ConfigError, match=r"bad.yaml.*unknown config key 'train.epochz'. Did you mean 'train.epochs'"):
        build_config("toy", str(y))


def test_a_misspelt_key_or_config_file_gets_the_nearest_name(tmp_path):
    with pytest.raises(ConfigError, match=r"'trian.lr'. Did you mean 'optim.lr'\?"):
        build_config("toy", overrides=["trian.lr=0.1"])
    with pytest.raises(ConfigError) as err:                      # nothing near: no guess, the sections
        build_config("toy", overrides=["zzz=1"])
    assert "Did you mean" not in str(err.value) and "train.*, optim.*" in str(err.value)
    (tmp_path / "basicmotions.yaml").write_text("train:\n  epochs: 1\n")
    with pytest.raises(ConfigError, match=r"basicmotion.yaml does not exist \(did you mean .*basicmotions.yaml\?\)"):
        load_yaml(tmp_path / "basicmotion.yaml")


def test_yaml_syntax_error_names_line(tmp_path):
    y = tmp_path / "broken.yaml"
    y.write_text("train:\n  lr: 0.1\n  epochs: [1, 2\n")
    with pytest.raises(ConfigError, match=r"broken.yaml: line \d+"):
        load_yaml(y)


def test_unknown_recipe_lists_known():
    with pytest.raises(ValueError, match="registered recipes: .*toy"):
        build_config("nosuch")


def test_resolved_config_round_trip(tmp_path):
    cfg = build_config("toy", overrides=["optim.lr=0.25", "model.hidden=5", "dist.strategy=dp", "dist.gpu_ids=1,2"])
    save_config(cfg, tmp_path / "config.yaml")
    again = build_config(None, str(tmp_path / "config.yaml"))
    assert to_dict(again) == to_dict(cfg)
    assert to_dict(from_dict(to_dict(cfg))) == to_dict(cfg)


def test_parse_override_keeps_strings():
    assert parse_override("data.path=a:b") == ("data.path", "a:b")
    assert parse_override("x={a}") == ("x", "{a}")
    assert parse_override("optim.lr = 0.5") == ("optim.lr", "0.5")


def test_recipe_defaults_sit_between_engine_defaults_and_yaml(tmp_path):
    cfg = build_config("har")
    assert (cfg.train.amp, cfg.train.batch_size, cfg.model.mode) == ("auto", 64, "flatten")
    assert build_config("sasrec").train.amp == "off"                 # other recipes keep the engine's
    path = tmp_path / "c.yaml"
    path.write_text("train:\n  amp: 'off'\n")
    assert build_config("har", yaml_path=str(path)).train.amp == "off"
    assert build_config("har", flags={"model.mode": "first"}).model.mode == "first"
