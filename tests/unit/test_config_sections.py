"""Issue 83 point 3: config by owner. train.*'s flat keys live in the sections of the parts that read them (optim,
log, faults, compile); every old key still works with a warning naming its new one, in an override, a YAML file and a
flag's place; a checkpoint written with the flat keys resumes, quietly, to the weights of a run-through."""
from __future__ import annotations

import dataclasses
import signal
import warnings

import pytest
import torch
import yaml

import tests.toy_recipe  # noqa: F401  (registers the toy recipe)
from tests.conftest import assert_bitwise_equal, trainer, weights
from tests.inprocess import cli
from trainer.config.sections import ENGINE_RENAMED
from trainer.config.settings import build_config, default_config, from_dict, to_dict, valid_keys

# a value of each moved key other than its default, valid beside the other defaults (adamw, cosine, auto)
NEW_VALUES = {
    "optim.name": "adam", "optim.lr": 0.25, "optim.weight_decay": 0.125, "optim.betas": [0.5, 0.75],
    "optim.lr_scaling": "sqrt", "optim.schedule": "linear", "optim.warmup_steps": 7, "optim.warmup_epochs": 1.5,
    "optim.min_lr_ratio": 0.25, "optim.clip_grad_norm": 2.0, "log.every_steps": 3, "log.per_rank": True,
    "log.measure_sync": True, "log.progress": "off", "log.tensorboard": False, "log.profile": "2:3",
    "faults.preflight": "on", "faults.preflight_slow": 0.25, "faults.straggler_action": "evict",
    "faults.hang_timeout_s": 90.0, "compile.mode": "default", "compile.step_graph": "on",
}


def get(cfg, dotted: str):
    section, key = dotted.split(".")
    return getattr(getattr(cfg, section), key)


def flat(values: dict) -> dict:
    """A config as it was saved before the split: the moved keys back under train.* with their old names."""
    old = {new: o for o, new in ENGINE_RENAMED.items()}
    out = {k: (dict(v) if isinstance(v, dict) else v) for k, v in values.items() if k not in
           {"optim", "log", "faults", "compile"}}
    for section in ("optim", "log", "faults", "compile"):
        for key, value in values[section].items():
            if f"{section}.{key}" in old:        # (keys added after the split, log.tracker, had no flat name)
                out["train"][old[f"{section}.{key}"].split(".", 1)[1]] = value
    return out


def test_the_train_section_keeps_only_the_loops_keys_and_every_moved_key_has_a_home():
    keys = set(valid_keys(default_config("toy")))
    assert set(ENGINE_RENAMED.values()) <= keys and not set(ENGINE_RENAMED) & keys
    assert len(ENGINE_RENAMED) + sum(k.startswith("train.") for k in keys) == 36      # the 36 of the flat section
    assert set(NEW_VALUES) | {"optim.momentum"} == set(ENGINE_RENAMED.values())


@pytest.mark.parametrize("old", sorted(k for k in ENGINE_RENAMED if k != "train.momentum"))
def test_an_old_key_sets_its_new_one_with_a_warning_naming_it(old):
    new = ENGINE_RENAMED[old]
    value = NEW_VALUES[new]
    text = ",".join(map(str, value)) if isinstance(value, list) else str(value)
    with pytest.warns(FutureWarning, match=f"'{old}' is deprecated .*use '{new}'"):
        cfg = build_config("toy", overrides=[f"{old}={text}"])
    assert get(cfg, new) == value and get(cfg, new) != get(default_config("toy"), new)
    saved = to_dict(cfg)
    assert old.split(".")[1] not in saved["train"]                       # saved under the new name only
    assert saved[new.split(".")[0]][new.split(".")[1]] == value


def test_the_old_momentum_key_with_the_old_optimizer_key():
    with pytest.warns(FutureWarning, match="use 'optim.momentum'"):
        cfg = build_config("toy", overrides=["train.optimizer=sgd", "train.momentum=0.25"])
    assert (cfg.optim.name, cfg.optim.momentum) == ("sgd", 0.25)


def test_old_keys_in_a_yaml_file_warn_once_each_and_land_in_their_sections(tmp_path):
    y = tmp_path / "old.yaml"
    y.write_text("recipe: toy\ntrain:\n  epochs: 2\n  optimizer: sgd\n  momentum: 0.5\n  lr: 0.5\n"
                 "  log_every_steps: 4\n  hang_timeout_s: -1\n  compile: default\n")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        cfg = build_config(None, str(y))
    said = sorted(str(w.message).split("'")[1] for w in seen if issubclass(w.category, FutureWarning))
    assert said == sorted(["train.optimizer", "train.momentum", "train.lr", "train.log_every_steps",
                           "train.hang_timeout_s", "train.compile"])
    assert all(str(y) == w.filename for w in seen)                      # attributed to the user's file
    assert (cfg.train.epochs, cfg.optim.name, cfg.optim.momentum, cfg.optim.lr) == (2, "sgd", 0.5, 0.5)
    assert (cfg.log.every_steps, cfg.faults.hang_timeout_s, cfg.compile.mode) == (4, -1.0, "default")


def test_a_stored_flat_config_is_taken_quietly_under_the_new_names():
    cfg = build_config("toy", overrides=[f"{k}={','.join(map(str, v)) if isinstance(v, list) else v}"
                                         for k, v in NEW_VALUES.items() if k != "compile.step_graph"])
    old = flat(to_dict(cfg))
    assert "lr" in old["train"] and "optim" not in old
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        back = from_dict(old)
    assert to_dict(back) == to_dict(cfg)


def test_the_flags_set_the_new_keys_without_a_warning():
    out = cli("train", "--recipe", "toy", "--lr", "0.125", "--warmup-steps", "3", "--print-config")
    assert "deprecated" not in out.stderr, out.stderr
    printed = yaml.safe_load(out.stdout)
    assert (printed["optim"]["lr"], printed["optim"]["warmup_steps"]) == (0.125, 3)
    assert list(printed)[:8] == ["recipe", "run_dir", "seed", "private", "train", "optim", "log", "faults"]
    assert {f.name for f in dataclasses.fields(type(build_config("toy").train))} == set(printed["train"])


def test_a_checkpoint_written_with_the_flat_keys_resumes_to_the_weights_of_a_run_through(tmp_path):
    run, through = tmp_path / "run", tmp_path / "through"
    base = ("train", "--recipe", "toy", "--epochs", "2", "--seed", "3", "log.tensorboard=false", "--lr", "0.05",
            "optim.schedule=linear", "log.every_steps=2")
    first = trainer(*base, "--run-dir", str(run), "data.signal_at_step=5", check=False)
    assert first.returncode == 128 + signal.SIGTERM, first.stderr[-2000:]
    rewritten = 0
    for path in (run / "checkpoints").glob("*.pt"):      # as a release before the split wrote them
        ckpt = torch.load(path, weights_only=True)
        ckpt["config"] = flat(ckpt["config"])
        torch.save(ckpt, path)
        rewritten += 1
    (run / "config.yaml").write_text(yaml.safe_dump(flat(yaml.safe_load((run / "config.yaml").read_text()))))
    assert rewritten >= 1
    second = trainer(*base, "--run-dir", str(run), "--resume", "auto")
    assert "resumed from" in second.stderr and "deprecated" not in second.stderr, second.stderr[-3000:]
    assert "refus" not in second.stderr.lower()
    cli(*base, "--run-dir", str(through))
    assert_bitwise_equal(weights(run), weights(through))
