"""Recipes by name. Built-in recipes are the folders of trainer/recipes/ that hold a spec.py with SPEC;
out-of-tree ones, and plugins' components and config sections, come from the modules of installed packages'
entry points (group hpc_trainer.plugins) and those named in TRAINER_PLUGINS (comma-separated), which call
register(), register_component(), register_section() at import. Nothing here imports torch.

    from trainer.config.registry import get_spec, recipe_names
    get_spec("har").recipe_class()
"""
from __future__ import annotations

import importlib
import importlib.util
import os
import pkgutil
import sys

from trainer.config.spec import RecipeSpec

_SPECS: dict[str, RecipeSpec] = {}
_LOADED: set[str] = set()
PLUGIN_GROUP = "hpc_trainer.plugins"     # the entry-point group of installed plugins (docs/extending.md)


class DuplicateRecipeError(ValueError):
    """Two recipes registered under one name."""


def _where(spec: RecipeSpec) -> str:
    target = spec.recipe
    return target if isinstance(target, str) else f"{target.__module__}:{target.__qualname__}"


def register(spec: RecipeSpec) -> RecipeSpec:
    """Make spec known under spec.name. Another recipe under a name already taken is an error (a plugin would
    silently replace a built-in recipe); the same recipe registered again (a module imported twice) is not."""
    known = _SPECS.get(spec.name)
    if known is not None and _where(known) != _where(spec):
        raise DuplicateRecipeError(f"recipe name {spec.name!r} is taken by {_where(known)}; {_where(spec)} "
                                   f"registers it again.\nHINT: give the new recipe another name in its RecipeSpec.")
    _SPECS[spec.name] = spec
    return spec


def spec_modules() -> tuple[list[str], list[str]]:
    """(the built-in recipes' spec modules, the TRAINER_PLUGINS modules), by name: what _load_modules imports, and
    where a tool finds what a recipe keeps beside its SPEC (the benchmark harness: BENCH)."""
    # found by name, as the plugins are: the recipes import this module, not the other way round
    folders = importlib.util.find_spec("trainer.recipes").submodule_search_locations
    builtin = [f"trainer.recipes.{m.name}.spec" for m in pkgutil.iter_modules(folders) if m.ispkg]
    return builtin, list(dict.fromkeys(_env_plugins() + entry_point_modules()))


def _env_plugins() -> list[str]:
    """The modules named in TRAINER_PLUGINS (comma-separated)."""
    return [m.strip() for m in os.environ.get("TRAINER_PLUGINS", "").split(",") if m.strip()]


def entry_point_modules() -> list[str]:
    """The modules of the installed packages' entry points in the group PLUGIN_GROUP (a plugin's pyproject.toml:
    [project.entry-points."hpc_trainer.plugins"] NAME = "its_module"), found without any environment variable."""
    from importlib.metadata import entry_points
    return [ep.module for ep in sorted(entry_points(group=PLUGIN_GROUP), key=lambda ep: ep.name)]


def _load_modules() -> None:
    """Import every built-in recipe's spec module and every plugin module (TRAINER_PLUGINS, entry points), once
    each."""
    builtin, plugins = spec_modules()
    for name in builtin + plugins:
        if name in _LOADED:
            continue
        _LOADED.add(name)
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as err:
            if name in builtin and err.name == name:
                continue            # a helper package without a spec (e.g. shared code)
            if name in plugins and err.name is not None and name.startswith(err.name):
                print(f"warning: {_named_by(name)} names {name!r}, which cannot be imported ({err}); its recipes "
                      f"are not registered.\nHINT: put the folder holding it on PYTHONPATH", file=sys.stderr)
                continue
            if name not in plugins:
                raise
            _plugin_failed(name, err)
            continue
        except Exception as err:            # a plugin's own bug must not break every command (doctor, --help)
            if name not in plugins:
                raise
            _plugin_failed(name, err)
            continue
        spec = getattr(module, "SPEC", None)
        if isinstance(spec, RecipeSpec):
            register(spec)


def _plugin_failed(name: str, err: BaseException) -> None:
    """One warning naming the plugin module, its error and where it was raised; its recipes stay unregistered."""
    import traceback
    frames = traceback.extract_tb(err.__traceback__)
    where = f" at {frames[-1].filename}:{frames[-1].lineno}" if frames else ""
    print(f"warning: {_named_by(name)} module {name!r} raised {type(err).__name__}: {err}{where} while importing; "
          f"its recipes are not registered.\nHINT: fix the module, or remove it from {_named_by(name)}",
          file=sys.stderr)


def _named_by(module: str) -> str:
    """Where a plugin module was named: TRAINER_PLUGINS, else an installed package's entry point."""
    return "TRAINER_PLUGINS" if module in _env_plugins() else f"the {PLUGIN_GROUP} entry points"


def specs() -> list[RecipeSpec]:
    """Every registered recipe, by name."""
    _load_modules()
    return [_SPECS[name] for name in sorted(_SPECS)]


def recipe_names() -> list[str]:
    return [s.name for s in specs()]


def get_spec(name: str) -> RecipeSpec:
    """The spec registered under name, or a ValueError listing the known names."""
    _load_modules()
    if name not in _SPECS:
        raise ValueError(f"unknown recipe {name!r}; registered recipes: {', '.join(recipe_names()) or 'none'}")
    return _SPECS[name]
