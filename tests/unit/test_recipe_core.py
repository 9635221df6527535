"""Issue 83 point 4: the recipe interface cut to its core. `Recipe` is the six members every recipe provides; the rest
are capabilities (trainer/engine/capabilities.py) a recipe opts into; the engine reads them through `of()`, which
also serves a recipe written before them. `RecipeSpec` keeps the run's plug-in, its `tools` the command line's."""
from __future__ import annotations

import re
import warnings
from types import SimpleNamespace

import pytest

from tests.conftest import REPO
from trainer.config.registry import specs
from trainer.config.spec import DataCommand, Flag, RecipeSpec, RecipeTools
from trainer.engine import capabilities as can
from trainer.engine.recipe import Recipe

CORE = ["primary_metric", "build_datasets", "build_model", "training_step", "eval_step", "compute_metrics"]


def test_the_recipe_is_its_core_and_the_capabilities_hold_the_rest():
    assert [n for n in vars(Recipe) if not n.startswith("_")] == CORE
    held = [m for c in can.CAPABILITIES for m in can.members(c)]
    assert len(held) == len(set(held)) == 31, "a member belongs to one capability"
    assert not set(held) & set(CORE)


def test_each_builtin_recipe_declares_the_capabilities_whose_members_it_defines():
    import tests.toy_recipe  # noqa: F401  (the toy recipe, as a plugin writes one)
    owner = {m: c for c in can.CAPABILITIES for m in can.members(c)}
    for spec in specs():
        cls = spec.recipe_class()
        own = {name for k in cls.__mro__ if k.__module__.startswith(("trainer.recipes", "tests."))
               for name in vars(k) if name in owner}
        undeclared = sorted(f"{name} ({owner[name].__name__})" for name in own if not issubclass(cls, owner[name]))
        assert undeclared == [], f"{spec.name}: {undeclared}"


def test_the_page_lists_every_capability_with_its_members():
    page = (REPO / "docs" / "extending.md").read_text().split("## Capabilities", 1)[1].split("\n## ", 1)[0]
    for capability in can.CAPABILITIES:
        line = re.search(rf"^- `{capability.__name__}`: (.*?)(?=^- |\Z)", page, re.M | re.S)
        assert line, capability.__name__
        assert all(f"`{m}" in line.group(1) for m in can.members(capability)), capability.__name__


class OldStyle(Recipe):
    """A plugin recipe of before the capabilities: overrides under the old names, inherits none."""

    def on_epoch_start(self, epoch, model):
        self.started = epoch

    tie_break_metric = ("loss", "min")


def test_of_serves_a_recipe_that_inherits_no_capability():
    recipe = OldStyle(None, None, SimpleNamespace(gpu_path="on"), SimpleNamespace(device="cpu"))
    plan = can.of(recipe, can.EpochPlan)
    plan.on_epoch_start(3, None)
    assert recipe.started == 3                              # its own member, taken
    assert plan.epoch_batches(0) is None and plan.epoch_metrics() == {}           # the defaults, bound to it
    assert can.of(recipe, can.Evaluation).tie_break_metric == ("loss", "min")
    assert can.of(recipe, can.GPUShapedStep).gpu_shaped is True                 # a default property, on its config
    assert can.of(recipe, can.DDPPolicy).broadcast_buffers is True
    with pytest.raises(AttributeError, match="EpochPlan has no member 'predict_rows'"):
        can.of(recipe, can.EpochPlan).predict_rows


def test_of_is_the_recipe_itself_where_it_inherits_the_capability():
    from trainer.recipes.har.recipe import HARRecipe
    recipe = HARRecipe(None, None, SimpleNamespace(gpu_path="off"), SimpleNamespace(device="cpu"))
    assert can.of(recipe, can.DeviceResident) is recipe and can.of(recipe, can.Evaluation) is recipe


def test_the_spec_keeps_the_tooling_apart_and_takes_the_flat_form_with_a_warning():
    tools = RecipeTools(flags=(Flag("--x", "model.x", "x"),))
    assert RecipeSpec(name="a", recipe="m:C", tools=tools).tools.flags == tools.flags
    synth = DataCommand("h", lambda p: None, lambda a: 0)
    with pytest.warns(FutureWarning, match=r"tools=RecipeTools\(synth=\.\.\.\)"):
        old = RecipeSpec(name="b", recipe="m:C", synth=synth, summary="s")
    assert old.tools.synth is synth and old.summary == "s" and old.tools.flags == ()
    with pytest.raises(TypeError, match="given beside tools="):
        RecipeSpec(name="c", recipe="m:C", synth=synth, tools=tools)
    with pytest.raises(TypeError, match="unknown field"):
        RecipeSpec(name="d", recipe="m:C", flagz=())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert all(isinstance(s.tools, RecipeTools) for s in specs())     # the built-ins use the new form
