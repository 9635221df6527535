"""The record a recipe fills to plug into the trainer (in the spirit of torchtitan's TrainSpec).

    SPEC = RecipeSpec(name="har", recipe="trainer.recipes.har.recipe:HARRecipe", data_config=HARDataConfig,
                      model_config=HARModelConfig, tools=RecipeTools(flags=(Flag("--mode", "model.mode", "fusion"),)))

Everything here is importable without torch: the registry, the config, `--help` and hpc/submit.py read
specs on login nodes. The recipe class (which needs torch) is named by "module:Class" and imported on use.
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Mapping


@dataclass
class EmptyConfig:
    """Placeholder for a recipe without options in a section."""


@dataclass(frozen=True)
class Flag:
    """An extra `train` flag of a recipe: --name VALUE sets the config key (between YAML and key=value)."""

    name: str
    key: str
    help: str
    choices: tuple[str, ...] | None = None
    type: Callable[[str], Any] = str


@dataclass(frozen=True)
class DataCommand:
    """A `python -m trainer data ...` subcommand: its arguments and what it runs (returns an exit code)."""

    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


@dataclass(frozen=True)
class Dataset:
    """A public dataset that `data download NAME` fetches: fetch(out, url=None, sha256=None) -> the folder (or file)
    written under out (a "module:function", imported on use: no network code on import); folder: that name, so a
    missing data.path can say which download makes it."""

    fetch: Any
    folder: str

    def download(self, out: Any, url: str | None = None, sha256: str | None = None) -> Any:
        return _load(self.fetch)(out, url=url, sha256=sha256)


def _load(target: Any) -> Any:
    """A "module:attr" string imported, or the object itself."""
    if not isinstance(target, str):
        return target
    module, attr = target.split(":")
    return getattr(importlib.import_module(module), attr)


@dataclass(frozen=True)
class RecipeTools:
    """What a recipe adds to the command line and the data commands; nothing here is read by a run."""

    FIELDS: ClassVar[tuple[str, ...]] = ("flags", "synth", "converters", "data_commands", "datasets", "data_hints")
    flags: tuple[Flag, ...] = ()                 # extra `train` flags (--mode ...)
    synth: DataCommand | None = None             # `data synth NAME`: a synthetic dataset usable as data.path
    converters: Mapping[str, DataCommand] = field(default_factory=dict)     # `data convert KIND`
    data_commands: Mapping[str, DataCommand] = field(default_factory=dict)  # other `data` subcommands
    datasets: Mapping[str, Dataset] = field(default_factory=dict)   # what `data download NAME` fetches
    data_hints: Mapping[str, str] = field(default_factory=dict)    # folder -> the commands that make it ({parent})


@dataclass(frozen=True, init=False)
class RecipeSpec:
    """One recipe: what a run plugs in (its class, config sections and defaults, renamed keys, what a resume may
    change), and apart from it its command-line and data tooling (`tools`, a RecipeTools)."""

    name: str
    recipe: Any                                   # the Recipe subclass, or "module:Class" (imported on use)
    data_config: Callable[[], Any] = EmptyConfig  # config sections (zero-argument factories, usually dataclasses)
    model_config: Callable[[], Any] = EmptyConfig
    eval_config: Callable[[], Any] = EmptyConfig
    loss_config: Callable[[], Any] = EmptyConfig
    defaults: Mapping[str, Any] = field(default_factory=dict)   # dotted keys over the engine's defaults
    renamed: Mapping[str, str] = field(default_factory=dict)   # deprecated dotted key -> its new name
    resume_changeable: tuple[str, ...] = ()      # key patterns beyond the engine's that a resume may change
    own_batch_plan: bool = False   # EpochPlan.epoch_batches draws the batches: a resume in another world is not exact
    summary: str = ""
    tools: RecipeTools = field(default_factory=RecipeTools)

    def __init__(self, name: str, recipe: Any, **given: Any):
        """The fields by keyword; a RecipeTools field given at the top level (the flat form, before RecipeTools)
        is taken into `tools` with a FutureWarning."""
        flat = {key: given.pop(key) for key in RecipeTools.FIELDS if key in given}
        if flat:
            if "tools" in given:
                raise TypeError(f"RecipeSpec({name!r}): {', '.join(flat)} given beside tools=; put them in RecipeTools")
            warnings.warn(f"RecipeSpec({name!r}, {', '.join(f'{k}=...' for k in flat)}): give them as "
                          f"tools=RecipeTools({', '.join(f'{k}=...' for k in flat)})", FutureWarning, stacklevel=2)
            given["tools"] = RecipeTools(**flat)
        known = {f.name: f for f in dataclasses.fields(RecipeSpec)}
        unknown = sorted(set(given) - set(known))
        if unknown:
            raise TypeError(f"RecipeSpec({name!r}): unknown field(s) {', '.join(unknown)}")
        values = dict(given, name=name, recipe=recipe)
        for key, f in known.items():
            value = values[key] if key in values else \
                f.default if f.default is not dataclasses.MISSING else f.default_factory()   # type: ignore[misc]
            object.__setattr__(self, key, value)

    def recipe_class(self) -> type:
        """The Recipe subclass (imports torch)."""
        return _load(self.recipe)
