"""Every numeric config key of every section, recipes included, is range-checked in one place (set_key):
below (and above) its bound is a ConfigError naming the key and the value; the bound itself, the default
and every shipped YAML config pass."""
import dataclasses
import typing
from pathlib import Path

import pytest

from tests.conftest import REPO, clean_env
from tests.inprocess import cli
from trainer.config.bounds import bound_of
from trainer.config.settings import ConfigError, _fields, build_config, default_config, set_key

RECIPES = ["sasrec", "kgat", "har", "video", "toy"]


@pytest.fixture(autouse=True)
def toy_plugin(monkeypatch):
    monkeypatch.setenv("TRAINER_PLUGINS", "tests.toy_recipe")


def numeric_keys(node, prefix=""):
    """(dotted key, parent config, field name, number type, is a list) of every numeric field."""
    for name, hint in _fields(node).items():
        value = getattr(node, name)
        if dataclasses.is_dataclass(value):
            yield from numeric_keys(value, f"{prefix}{name}.")
            continue
        args = typing.get_args(hint)
        kind = args[0] if typing.get_origin(hint) in (list, tuple) and args else hint
        if kind in (int, float):
            yield f"{prefix}{name}", node, name, kind, typing.get_origin(hint) in (list, tuple)


def table():
    import os
    os.environ.setdefault("TRAINER_PLUGINS", "tests.toy_recipe")
    return [(recipe, key) for recipe in RECIPES for key, *_ in numeric_keys(default_config(recipe))]


def test_the_table_covers_every_section():
    keys = {key for _, key in table()}
    assert {"train.epochs", "train.grad_accum_steps", "ckpt.keep_last", "dist.timeout_s", "seed", "optim.betas",
            "model.hidden", "data.maxlen", "eval.negatives", "model.layer_widths", "eval.ks", "data.clip_len",
            "loss.label_smoothing", "loss.cf_l2",
            "model.kernel_size", "data.kg_batch_size"} <= keys
    assert len(table()) > 100


@pytest.mark.parametrize("recipe,key", table())
def test_out_of_range_values_are_refused_naming_key_and_value(recipe, key):
    cfg = default_config(recipe)
    _, parent, name, kind, is_list = next(k for k in numeric_keys(cfg) if k[0] == key)
    bound = bound_of(parent, name)
    default = getattr(parent, name)
    assert all(bound.holds(v) for v in (default if is_list else [default])), f"default {default!r} of {key}"
    wrap = (lambda v: f"[{v}]") if is_list else str
    step = 1 if kind is int else 0.5
    bad = [bound.lo if bound.lo_open else bound.lo - step] if bound.lo is not None else []
    if bound.hi is not None:
        bad.append(bound.hi if bound.hi_open else bound.hi + step)
    for value in bad:
        value = kind(value)
        with pytest.raises(ConfigError, match=rf"override: {key} = .*{value!r}.* is out of range: must be"):
            set_key(cfg, key, wrap(value), "override")
    if bound.lo is not None and not bound.lo_open and (kind is float or float(bound.lo).is_integer()):
        set_key(cfg, key, wrap(kind(bound.lo)), "override")        # the bound itself is allowed
        assert getattr(parent, name) == ([kind(bound.lo)] if is_list else kind(bound.lo))


@pytest.mark.parametrize("key,value,message", [
    ("train.epochs", "-3", "train.epochs = -3 is out of range: must be >= 0 (0: no training"),
    ("train.grad_accum_steps", "-5", "train.grad_accum_steps = -5 is out of range: must be >= 1"),
    ("ckpt.keep_last", "-2", "ckpt.keep_last = -2 is out of range: must be >= 0 (0: keep every periodic checkpoint)"),
    ("dist.timeout_s", "-1", "dist.timeout_s = -1.0 is out of range: must be > 0"),
    ("optim.lr", "nan", "optim.lr = nan is out of range: must be > 0"),
    ("train.max_steps", "-1", "(0: no limit)"),
])
def test_the_issue_examples(key, value, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        build_config("toy", overrides=[f"{key}={value}"])


SPACES = REPO / "configs" / "search"          # search space files (hpc/submit.py --search), not configs


@pytest.mark.parametrize("yaml_path", sorted(str(p.relative_to(REPO)) for p in (REPO / "configs").rglob("*.yaml")
                                             if SPACES not in p.parents))
def test_every_shipped_config_is_in_range(yaml_path):
    build_config(None, str(REPO / yaml_path))


@pytest.mark.parametrize("space_path", sorted(p.name for p in SPACES.glob("*.yaml")))
def test_every_shipped_search_space_builds_its_recipes_config_at_each_end(space_path):
    """configs/search/<recipe>.yaml: every key of the space exists in the recipe's config and takes both ends of its
    range and every choice (the check hpc/submit.py makes before submitting)."""
    from trainer.search.space import load_space
    space = load_space(SPACES / space_path)
    recipe = space_path.removesuffix(".yaml")
    for key, param in space.params.items():
        for value in param.bounds():
            cfg = build_config(recipe, None, None, [f"{key}={value}"])
            section, name = key.split(".", 1)
            assert getattr(getattr(cfg, section), name) == value


def test_the_cli_flag_is_checked_too():
    proc = cli("train", "--recipe", "toy", "--epochs", "-3", "--run-dir", "/nonexistent/never", check=False,
                   env=clean_env())
    assert proc.returncode == 2 and "error: command line: train.epochs = -3 is out of range" in proc.stderr
    assert "Traceback" not in proc.stderr and not Path("/nonexistent/never").exists()
