"""One glossary of config names across recipes (docs/configuration.md); the old names keep working for one
release, with a FutureWarning naming the new one."""
from __future__ import annotations

import dataclasses

import pytest

from tests.conftest import REPO
from trainer.config.registry import get_spec
from trainer.config.settings import apply_dict, build_config, default_config, from_dict, to_dict

BUILTIN = ("sasrec", "kgat", "har", "video")
OLD = {"hidden", "blocks", "embed_dim", "layers", "mess_dropout", "relation_dim", "loss", "l2_emb", "cf_l2",
       "kg_l2", "label_smoothing"}


@pytest.mark.parametrize("recipe", BUILTIN)
def test_no_model_section_uses_an_old_name_and_loss_knobs_sit_in_loss(recipe):
    cfg = default_config(recipe)
    assert not OLD & {f.name for f in dataclasses.fields(cfg.model)}
    for new in get_spec(recipe).renamed.values():
        section, name = new.split(".")
        assert hasattr(getattr(cfg, section), name), new


@pytest.mark.parametrize("recipe,old", [(r, old) for r in BUILTIN for old in get_spec(r).renamed])
def test_an_old_name_still_works_and_warns_naming_the_new(recipe, old):
    new = get_spec(recipe).renamed[old]
    value = getattr(getattr(default_config(recipe), new.split(".")[0]), new.split(".")[1])
    value = [2, 2] if isinstance(value, list) else (0.125 if isinstance(value, float) else 3 if isinstance(value, int)
                                                    else "sampled_softmax")
    text = f"{old}={value}".replace(" ", "")
    with pytest.warns(FutureWarning, match=rf"'{old}' is deprecated .*use '{new}'"):
        cfg = build_config(recipe, overrides=[text])
    section, name = new.split(".")
    assert getattr(getattr(cfg, section), name) == value


def test_old_names_in_a_yaml_file_and_in_a_stored_config(tmp_path):
    y = tmp_path / "old.yaml"
    y.write_text("recipe: sasrec\nmodel:\n  hidden: 24\n  blocks: 3\n  loss: sampled_softmax\n")
    with pytest.warns(FutureWarning, match="'model.hidden' is deprecated"):
        cfg = build_config(None, str(y))
    assert (cfg.model.width, cfg.model.depth, cfg.loss.kind) == (24, 3, "sampled_softmax")
    stored = to_dict(cfg)                               # a checkpoint written before the rename
    stored["model"]["hidden"] = stored["model"].pop("width")
    stored["model"]["loss"] = stored.pop("loss")["kind"]
    import warnings
    with warnings.catch_warnings():         # quietly: the checkpoint's writer cannot change it, its reader need not
        warnings.simplefilter("error")
        back = from_dict(stored)
    assert back.model.width == 24 and back.loss.kind == "sampled_softmax"
    assert "hidden" not in to_dict(back)["model"]       # saved under the new names only


def test_new_names_do_not_warn(recipe="kgat"):
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cfg = default_config(recipe)
        apply_dict(cfg, {"model": {"width": 8, "layer_widths": [8]}, "loss": {"cf_l2": 0.0}}, "test")
    assert cfg.model.layer_widths == [8] and cfg.loss.cf_l2 == 0.0


def test_the_readme_glossary_lists_every_renamed_key():
    readme = (REPO / "docs" / "configuration.md").read_text().split("## Config names", 1)[1].split("\n## ", 1)[0]
    for recipe in BUILTIN:
        for old, new in get_spec(recipe).renamed.items():
            assert f"`{new}`" in readme or new.split(".")[1] in readme, new
            assert old.split(".")[1] in readme, old
