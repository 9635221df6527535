"""Issue 82 point 4: every setting that the chosen options would ignore is refused before the run starts, in one
line naming what would make it count (trainer/config/ignored.py). The test walks every rule that any recipe's config
declares (its sections' `ignored`), and the rules are docs/configuration.md's table, row for row."""
from __future__ import annotations

import dataclasses
import re

import pytest

from tests.conftest import REPO
from trainer.config.registry import specs as all_specs
from trainer.config.settings import ConfigError, configure, default_config

RULES = sorted({(spec.name, name, rule.key): (rule, section)
                for spec in all_specs()
                for name, section in ((f.name, getattr(default_config(spec.name), f.name))
                                      for f in dataclasses.fields(default_config(spec.name)))
                if dataclasses.is_dataclass(section)
                for rule in getattr(type(section), "ignored", ())}.items())


def test_there_are_rules_to_walk():
    assert {(name, key) for (_, name, key) in dict(RULES)} >= {("loss", "gbce_t"), ("loss", "shared_negatives")}


@pytest.mark.parametrize("where,rule", [(k, v[0]) for k, v in RULES], ids=[".".join(k) for k, _ in RULES])
def test_each_rule_refuses_the_setting_where_it_is_ignored_and_takes_it_where_it_counts(where, rule):
    recipe, section, key = where
    under = [f"{section}.{k}={v}" for k, v in rule.under.items()]
    with pytest.raises(ConfigError, match=re.escape(f"{section}.{key}={rule.example} would be ignored")) as err:
        configure(recipe, overrides=[*under, f"{section}.{key}={rule.example}"])
    assert f"counts only with {rule.when}" in str(err.value)
    configure(recipe, overrides=under)                       # the default value is never refused


def test_the_docs_table_lists_every_rule():
    text = (REPO / "docs" / "configuration.md").read_text()
    table = set(re.findall(r"^\| `([a-z_]+\.[a-z_]+)` \| ", text.split("## Settings that others make ignored")[1]
                           .split("\n## ")[0], re.M))
    assert table == {f"{section}.{key}" for (_, section, key) in dict(RULES)}, table
