"""The record a recipe fills to plug into the trainer (in the spirit of torchtitan's TrainSpec).

    SPEC = RecipeSpec(name="har", recipe="trainer.recipes.har.recipe:HARRecipe", data_config=HARDataConfig,
                      model_config=HARModelConfig, flags=(Flag("--mode", "model.mode", "channel fusion"),))

Everything here is importable without torch: the registry, the config, `--help` and hpc/submit.py read
specs on login nodes. The recipe class (which needs torch) is named by "module:Class" and imported on use.
"""
from __future__ import annotations

import argparse
import importlib
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping


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
class RecipeSpec:
    """One recipe: name, config sections and defaults, CLI flags, data commands."""

    name: str
    recipe: Any                                   # the Recipe subclass, or "module:Class" (imported on use)
    data_config: Callable[[], Any] = EmptyConfig  # config sections (zero-argument factories, usually dataclasses)
    model_config: Callable[[], Any] = EmptyConfig
    eval_config: Callable[[], Any] = EmptyConfig
    loss_config: Callable[[], Any] = EmptyConfig
    defaults: Mapping[str, Any] = field(default_factory=dict)   # dotted keys over the engine's defaults
    flags: tuple[Flag, ...] = ()
    synth: DataCommand | None = None             # `data synth NAME`: a synthetic dataset usable as data.path
    converters: Mapping[str, DataCommand] = field(default_factory=dict)     # `data convert KIND`
    data_commands: Mapping[str, DataCommand] = field(default_factory=dict)  # other `data` subcommands
    datasets: Mapping[str, Dataset] = field(default_factory=dict)   # what `data download NAME` fetches
    data_hints: Mapping[str, str] = field(default_factory=dict)    # folder -> the commands that make it ({parent})
    renamed: Mapping[str, str] = field(default_factory=dict)   # deprecated dotted key -> its new name
    resume_changeable: tuple[str, ...] = ()      # key patterns beyond the engine's that a resume may change
    own_batch_plan: bool = False   # Recipe.epoch_batches draws the batches: a resume in another world is not exact
    summary: str = ""

    def recipe_class(self) -> type:
        """The Recipe subclass (imports torch)."""
        return _load(self.recipe)
